"""Keep torch out of control-plane processes (api, scheduler), even when it is installed.

transformers imports torch as soon as it finds it installed (transformers.modeling_rope_utils via
configuration_utils), although tokenizers and chat templates do not need it. Loading torch costs
the api ~1 s and hundreds of MiB per replica and breaks the rule that only the worker touches it.
Marking torch as absent in sys.modules makes `import torch` raise ImportError and makes
importlib.util.find_spec report it missing, so transformers takes its torch-free paths.
"""

from __future__ import annotations

import sys


def forbid_torch() -> None:
    """Call before importing transformers. A process that already imported torch is left alone."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # the documented "not importable" marker
