"""Suite-wide fixtures. The tiny checkpoints are built once per session: they are the demo model
and every end-to-end test's model, generated (not downloaded) so the suite runs offline."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.doubles.harmony_tokenizer import harmony_tokenizer_dir  # noqa: F401 (fixtures)
from tests.doubles.tiny_tokenizer import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)

# Without CUDA, Triton can only interpret. Triton fixes part of that choice when it is first
# imported (transformers imports it early), so the interpreted kernel tests would depend on
# whether an earlier test imported transformers. Decide it once, before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # the kernel tests run in this process too
    from tests.triton_interpreter_patch import install as install_interpreter_patch

    install_interpreter_patch()

TINY_ARCHS = ("qwen3_moe", "qwen3_5_moe")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """{arch: directory of a tiny random-weight checkpoint (seed 0)} for both architectures."""
    from ferry.services.make_tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch, seed=0) for arch in TINY_ARCHS}


@pytest.fixture(params=TINY_ARCHS)
def tiny_model(request, tiny_models) -> Path:
    """One tiny checkpoint per architecture (tests using it run once for each)."""
    return tiny_models[request.param]


@pytest.fixture(scope="session")
def quantized_tiny_models(tiny_models, tmp_path_factory):
    """(arch, layout) -> a quantized copy of that tiny checkpoint (tests/quantized_models.py), made once."""
    from tests.quantized_models import quantize_tiny

    root = tmp_path_factory.mktemp("quantized-tiny-models")
    made: dict[tuple[str, str], Path] = {}

    def get(arch: str, layout: str) -> Path:
        if (arch, layout) not in made:
            made[(arch, layout)] = quantize_tiny(tiny_models[arch], root / f"{arch}-{layout}", layout)
        return made[(arch, layout)]

    return get


def pytest_collection_modifyitems(config, items):
    """The files holding a test marked slow run first. `make test` hands pytest-xdist's workers whole files in
    this order (--dist loadfile --no-loadscope-reorder): a file's module-scoped fixtures (a served cluster, an
    interpreted kernel run) are built once, and the workers end together on short files rather than one of them
    waiting on the other's last long one."""
    slow_files = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in slow_files)  # stable: files stay whole, in order
