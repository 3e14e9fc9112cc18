"""Ferry: serve Mixture-of-Experts language models from GPUs too small to hold them.

The code lives in folders beside pyproject.toml (shared/, plan/, services/, kernels/), mapped into
this package as ferry.shared, ferry.plan, ferry.services and ferry.kernels: by pyproject.toml's
package-dir when installed, and by the lines below when run from the source tree with
PYTHONPATH=<repo root> and no install (python3 -m ferry.services.cli ...). An installed copy has
no pyproject.toml beside it, so its path stays its own."""

from pathlib import Path as _Path

_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "services" / "cli.py").is_file():
    __path__.append(str(_root))  # noqa: F821 (a package's module search path)
del _Path, _root
