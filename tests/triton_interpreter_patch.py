"""Two pieces of Triton's interpreter (TRITON_INTERPRET=1, triton/runtime/interpreter.py) that redo the same work
on every call, made to do it once; together about half an interpreted kernel's time in the suite:

* `_patch_lang` patches triton.language once per kernel launch, then again at every call of a @triton.jit helper
  inside the kernel, walking the modules' members with inspect each time. The helper's call now skips the walk
  when the launch already patched the modules the helper sees.
* `_get_np_dtype` (a Triton dtype's numpy dtype, asked at every interpreted op) builds its table at each call.
  Its answers are kept by the dtype's element type, on which alone they depend.
* `_unwrap_if_constexpr`, called for every operand and shape entry of every op, runs four isinstance checks on a
  plain int before returning it: a plain int, float, bool, str or None, and a constexpr, now return at once.
* `block_type.__init__` (a type made for every op's result) unwraps and validates its shape each time: the shape
  checked, its element count, are kept by the shape's ints, on which alone they depend.
* `tensor.__init__` (every op's result) builds its shape as a Triton tuple of constexprs, typing each entry: the
  shape and the element count are kept by the type's shape and shared by the tensors of that shape (nothing
  changes either after it is made).

What the kernels compute, and every check on it, is the same (tests/unit/test_triton_interpreter_patch.py)."""

from __future__ import annotations

import inspect


def install() -> bool:
    """Patches the interpreter of this process (whatever its TRITON_INTERPRET: nothing runs until a kernel does);
    False, changing nothing, where the interpreter is not the one this was written against."""
    from triton import language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if patch_lang is None or np_dtype is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    if getattr(patch_lang, "skips_patched", False):
        return True
    if not tl.core.is_builtin(tl.load):  # a kernel is running: not the moment to swap its machinery
        return False

    langs_of = {}  # function -> the language modules among its globals (a module's, set at its import)

    def patch_lang_once(fn):
        langs = langs_of.get(fn)
        if langs is None:
            langs = langs_of[fn] = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        # a launch patches every builtin of a module at once: tl.load replaced means the rest is too
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return interpreter._LangPatchScope()  # nothing changed here, nothing to restore
        return patch_lang(fn)

    known = {}

    def np_dtype_kept(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype  # a block's: its element's
        found = known.get(element.name)  # the name: a pointer type has no hash
        if found is None:
            found = known[element.name] = np_dtype(tt_dtype)
        return found

    patch_lang_once.skips_patched = True
    np_dtype_kept.__wrapped__ = np_dtype
    interpreter._patch_lang = patch_lang_once
    interpreter._get_np_dtype = np_dtype_kept
    _install_type_fast_paths(tl.core)
    return True


def _install_type_fast_paths(core) -> None:
    """The fast paths of `_unwrap_if_constexpr`, `block_type.__init__` and `tensor.__init__`: what they give is what
    the originals give (the originals run for everything else). core.py and semantic.py look each up at each call, so
    this reaches them."""
    unwrap, constexpr = core._unwrap_if_constexpr, core.constexpr
    plain = (int, float, bool, str, type(None))

    def unwrap_fast(o):
        kind = type(o)
        if kind in plain:  # neither a list, a tuple nor a constexpr: returned as it is
            return o
        if kind is constexpr:
            return o.value
        return unwrap(o)

    unwrap_fast.__wrapped__ = unwrap
    core._unwrap_if_constexpr = unwrap_fast

    block_init = core.block_type.__init__
    checked = {}  # shape_key(shape) -> (the shape as block_type keeps it, its element count)

    def shape_key(shape):
        """The shape's ints where it is a list or a Triton tuple of ints and int constexprs (what the ops pass), else
        None: anything else, e.g. a builtin tuple, which the original refuses, goes to the original."""
        if type(shape) is not list and type(shape) is not core.tuple:
            return None
        key = []
        for s in shape:
            value = s.value if type(s) is constexpr else s
            if type(value) is not int:
                return None
            key.append(value)
        return tuple(key)

    def block_init_kept(self, element_ty, shape):
        key = shape_key(shape)
        found = checked.get(key) if key else None
        if found is None:
            block_init(self, element_ty, shape)
            if key:
                checked[key] = (self.shape, self.numel)
            return
        self.element_ty = element_ty
        self.shape, self.numel = found
        self.name = f"<{self.shape}, {self.element_ty}>"

    block_init_kept.__wrapped__ = block_init
    core.block_type.__init__ = block_init_kept

    tensor_init = core.tensor.__init__
    made = {}  # a type's shape (a tuple of ints; () for a scalar) -> (the tensor's numel, its shape)

    def tensor_init_kept(self, handle, type):
        key = type.shape if type.is_block() else ()
        found = made.get(key)
        if found is None:
            tensor_init(self, handle, type)
            made[key] = (self.numel, self.shape)
            return
        self.handle = handle
        self.numel, self.shape = found
        self.type = type
        self.dtype = type.scalar

    tensor_init_kept.__wrapped__ = tensor_init
    core.tensor.__init__ = tensor_init_kept
