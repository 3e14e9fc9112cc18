"""Triton's interpreter (TRITON_INTERPRET=1) patches triton.language once per kernel launch, then again at every
call of a @triton.jit helper inside the kernel (triton/runtime/interpreter.py, `_patch_lang`), walking the modules'
members with inspect each time: two thirds of an interpreted kernel's time in the suite. `install()` makes the
helper calls skip the walk when the launch already patched the modules the helper sees: what the kernels compute,
and every check on it, is the same."""

from __future__ import annotations

import inspect


def install() -> bool:
    """Patches the interpreter of this process (whatever its TRITON_INTERPRET: nothing runs until a kernel does);
    False, changing nothing, where the interpreter is not the one this was written against."""
    from triton import language as tl
    from triton.runtime import interpreter

    patch_lang = getattr(interpreter, "_patch_lang", None)
    if patch_lang is None or getattr(patch_lang, "skips_patched", False):
        return patch_lang is not None
    if not hasattr(interpreter, "_LangPatchScope") or not tl.core.is_builtin(tl.load):
        return False

    def patch_lang_once(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)]
        # a launch patches every builtin of a module at once: tl.load replaced means the rest is too
        if langs and not any(tl.core.is_builtin(lang.load) for lang in langs):
            return interpreter._LangPatchScope()  # nothing changed here, nothing to restore
        return patch_lang(fn)

    patch_lang_once.skips_patched = True
    interpreter._patch_lang = patch_lang_once
    return True
