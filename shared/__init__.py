"""Code shared by every Ferry process: configs, messages, wire, errors, logging. Never imports torch."""
