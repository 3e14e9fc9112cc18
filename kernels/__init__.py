"""Kernels: Triton where a GPU runs them, plain torch elsewhere; torch is allowed here.

One naming rule (docs/ARCHITECTURE.md, "Layout and the torch boundary"):
* `<op>.py` is what the model calls: the Triton kernel and its dispatch (`dispatch.use_triton`), or
  only the dispatch when the kernels live apart, or plain torch where there is no Triton version.
* `<op>_reference.py` is the plain-torch twin of `<op>.py`: the CPU path and the tests' oracle.
* `<op>_triton.py` holds the Triton kernels that `<op>.py` dispatches to, when they are several.
"""
