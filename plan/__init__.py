"""The memory plan: model config, byte costs, pool layout, the planner, its report and flags.

No torch here, not even transitively (tests/unit/test_torch_free.py): `ferry plan` runs on
machines without a GPU or torch, and the worker runs the same planner at boot with measured
numbers."""
