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
    # as the language was before the launch: Triton's own helper calls patch modules their kernel's launch
    # did not and never restore them, so an earlier test in this process may have left `core` patched
    before = (core.is_builtin(tl.load), core.is_builtin(core.where))
    src = torch.linspace(-3.0, 3.0, 24)
    dst = torch.empty_like(src)
    _kernel[(3,)](src, dst, 24, BLOCK=8)
    for block in range(3):
        twice = torch.clamp_min(src[block * 8 : block * 8 + 8] * 2.0, -1.0)
        want = twice + twice.clamp_min(0.0).sum()
        torch.testing.assert_close(dst[block * 8 : block * 8 + 8], want, rtol=0, atol=1e-6)
    after = (core.is_builtin(tl.load), core.is_builtin(core.where))
    assert after == before, "the launch left the language patched"


def test_each_dtypes_numpy_dtype_is_the_interpreters_own_when_asked_again():
    from triton.runtime import interpreter

    kept, own = interpreter._get_np_dtype, interpreter._get_np_dtype.__wrapped__
    scalars = [tl.int1, tl.int8, tl.int32, tl.uint32, tl.int64, tl.float16, tl.bfloat16, tl.float32, tl.float8e4nv]
    pointers = [tl.pointer_type(tl.float32), tl.pointer_type(tl.bfloat16)]
    for dtype in [*scalars, *pointers, *(tl.block_type(d, [4, 2]) for d in [*scalars, *pointers])]:
        for _ in range(2):  # asked first, then answered from what was kept
            assert kept(dtype) == own(dtype), dtype


def test_the_type_fast_paths_give_what_the_originals_give():
    unwrap, own_unwrap = core._unwrap_if_constexpr, core._unwrap_if_constexpr.__wrapped__
    values = [3, 2.5, True, "s", None, core.constexpr(7), [core.constexpr(1), 2], (4, core.constexpr(5)), tl.float32]
    for value in values:
        assert unwrap(value) == own_unwrap(value) and type(unwrap(value)) is type(own_unwrap(value)), value
    init, own_init = core.block_type.__init__, core.block_type.__init__.__wrapped__
    for element in (tl.float32, tl.bfloat16, tl.pointer_type(tl.float32)):
        for shape in ([4, 2], [core.constexpr(4), 2], [16], core.tuple([4, 2])):
            for _ in range(2):  # made first, then from what was kept
                fast, own = object.__new__(core.block_type), object.__new__(core.block_type)
                init(fast, element, shape)
                own_init(own, element, shape)
                assert (fast.element_ty, fast.shape, fast.numel, fast.name) == (
                    own.element_ty,
                    own.shape,
                    own.numel,
                    own.name,
                )
    with pytest.raises(TypeError, match="0d"):
        init(object.__new__(core.block_type), tl.float32, [])
    with pytest.raises(AssertionError):  # a builtin tuple is refused as the original refuses it, kept shape or not
        init(object.__new__(core.block_type), tl.float32, (4, 2))
    tensor_init, own_tensor_init = core.tensor.__init__, core.tensor.__init__.__wrapped__
    for kind in (tl.float32, tl.block_type(tl.float32, [4, 2]), tl.block_type(tl.int32, [4, 2])):
        for _ in range(2):
            fast, own = object.__new__(core.tensor), object.__new__(core.tensor)
            tensor_init(fast, "handle", kind)
            own_tensor_init(own, "handle", kind)
            assert (fast.handle, fast.type, fast.dtype, fast.numel.value) == (
                own.handle,
                own.type,
                own.dtype,
                own.numel,
            )
            assert [s.value for s in fast.shape] == [s.value for s in own.shape] and type(fast.shape) is type(own.shape)
