"""Ferry's processes: api, scheduler, worker, and the command line that starts them."""
