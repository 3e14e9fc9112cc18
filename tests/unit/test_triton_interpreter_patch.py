"""tests/triton_interpreter_patch.py: installed in this process (tests/conftest.py) and in the interpreted
children, it must leave what a kernel computes as it was: helpers called inside a kernel see the interpreted
language, the language is the compiler's again after the launch, and each dtype's numpy dtype is the interpreter's."""

import os

import pytest
import torch
import triton
import triton.language as tl
from triton.language import core

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter's patch only")


@triton.jit
def _clamped_twice(x, lo):
    return tl.maximum(x * 2.0, lo)


@triton.jit
def _plus_row_sum(x):
    return x + tl.sum(core.where(x > 0.0, x, 0.0), axis=0)  # core.where: the language through triton.language.core


@triton.jit
def _kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=0.0)
    y = _plus_row_sum(_clamped_twice(x, -1.0))
    tl.store(dst + offs, y, mask=offs < n)


def test_the_patch_is_installed_with_this_triton():
    from triton.runtime import interpreter

    from tests.triton_interpreter_patch import install

    assert install(), "the interpreter changed: tests/triton_interpreter_patch.py no longer applies"
    assert getattr(interpreter._patch_lang, "skips_patched", False)


def test_nested_helpers_compute_as_without_the_patch():
    src = torch.linspace(-3.0, 3.0, 24)
    dst = torch.empty_like(src)
    _kernel[(3,)](src, dst, 24, BLOCK=8)
    for block in range(3):
        twice = torch.clamp_min(src[block * 8 : block * 8 + 8] * 2.0, -1.0)
        want = twice + twice.clamp_min(0.0).sum()
        torch.testing.assert_close(dst[block * 8 : block * 8 + 8], want, rtol=0, atol=1e-6)
    assert core.is_builtin(tl.load) and core.is_builtin(core.where), "the launch left the language patched"


def test_each_dtypes_numpy_dtype_is_the_interpreters_own_when_asked_again():
    from triton.runtime import interpreter

    kept, own = interpreter._get_np_dtype, interpreter._get_np_dtype.__wrapped__
    scalars = [tl.int1, tl.int8, tl.int32, tl.uint32, tl.int64, tl.float16, tl.bfloat16, tl.float32, tl.float8e4nv]
    pointers = [tl.pointer_type(tl.float32), tl.pointer_type(tl.bfloat16)]
    for dtype in [*scalars, *pointers, *(tl.block_type(d, [4, 2]) for d in [*scalars, *pointers])]:
        for _ in range(2):  # asked first, then answered from what was kept
            assert kept(dtype) == own(dtype), dtype
