"""Two pieces of Triton's interpreter (TRITON_INTERPRET=1, triton/runtime/interpreter.py) that redo the same work
on every call, made to do it once; together about half an interpreted kernel's time in the suite:

* `_patch_lang` patches triton.language once per kernel launch, then again at every call of a @triton.jit helper
  inside the kernel, walking the modules' members with inspect each time. The helper's call now skips the walk
  when the launch already patched the modules the helper sees.
* `_get_np_dtype` (a Triton dtype's numpy dtype, asked at every interpreted op) builds its table at each call.
  Its answers are kept by the dtype's element type, on which alone they depend.

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
    return True
