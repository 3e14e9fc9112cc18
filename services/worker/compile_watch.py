"""Triton kernels compiled while the worker serves: each one logged with its kernel and seconds, and counted.

Boot's warm-up (warmup.py) runs every class of shape a served step takes so that nothing compiles inside a request:
a compile there stalls every stream of the step for its seconds. When a path the warm-up missed compiles anyway,
this says which kernel and for how long (`kernel_compiled_in_service` in the log,
`ferry_worker_kernel_compiles_total` and `ferry_worker_kernel_compile_seconds_total` in /metrics), rather than
leaving a step that took seconds unexplained. It is installed once the worker is ready (`install`), through Triton's
own hooks around a compile (`triton.knobs.runtime.jit_cache_hook`, `jit_post_compile_hook`); a Triton without them,
or none (the CPU build's interpreter compiles nothing), leaves it off.
"""

from __future__ import annotations

import threading
import time

import structlog

log = structlog.get_logger("worker.compile")


class CompileWatch:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.compiles = 0
        self.seconds = 0.0
        self.installed = False
        self._started: dict[str, float] = {}
        self._lock = threading.Lock()  # Triton may finish a compile on a thread of its own (async mode)

    def install(self) -> bool:
        """Hook Triton's compiles from now on; False where this Triton has no such hooks (or is absent)."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook") or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        if runtime.jit_cache_hook is not None or runtime.jit_post_compile_hook is not None:
            return False  # someone else's hooks (a profiler): left alone
        runtime.jit_cache_hook = self.before_compile
        runtime.jit_post_compile_hook = self.after_compile
        self.installed = True
        return True

    def before_compile(self, *, key, **_) -> bool:
        """Triton is about to compile a kernel variant it does not hold (or load it from its disk cache).
        Returns False: the compile goes ahead (True would skip it)."""
        with self._lock:
            self._started[str(key)] = self.clock()
        return False

    def after_compile(self, *, key, repr="", **_) -> None:
        with self._lock:
            started = self._started.pop(str(key), None)
            seconds = self.clock() - started if started is not None else 0.0
            self.compiles += 1
            self.seconds += seconds
        kernel = repr.split("[", 1)[0] or "?"
        log.warning("kernel_compiled_in_service", kernel=kernel, seconds=round(seconds, 3), signature=repr[:400])

    def report(self) -> dict:
        with self._lock:
            return {"compiles": self.compiles, "seconds": self.seconds}
