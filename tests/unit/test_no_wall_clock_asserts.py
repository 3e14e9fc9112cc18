"""No unit test asserts on elapsed wall-clock time: the suite runs on loaded 2-core machines, where any
figure in seconds fails at random. Timings belong in bench/; a unit test checks what the timing stood
for (no torch imported, work done, a linear count). An assert is flagged where it reads a clock
(time.perf_counter, time.monotonic, time.time and their _ns forms), directly or through a name assigned
from one earlier in the same function."""

from __future__ import annotations

import ast
from pathlib import Path

UNIT = Path(__file__).resolve().parent
CLOCKS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "time", "time_ns"}


def _reads_clock(node: ast.AST, timed: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            f = sub.func
            if (
                isinstance(f, ast.Attribute)
                and f.attr in CLOCKS
                and isinstance(f.value, ast.Name)
                and f.value.id == "time"
            ):
                return True
        if isinstance(sub, ast.Name) and sub.id in timed:
            return True
    return False


def _assigned_names(node: ast.Assign | ast.AugAssign | ast.AnnAssign) -> set[str]:
    """The plain names an assignment binds (an attribute or item target binds none)."""
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = set()
    for t in targets:
        elts = t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
        names |= {e.id for e in elts if isinstance(e, ast.Name)}
    return names


def wall_clock_asserts(source: str) -> list[int]:
    """The lines of the asserts in `source` that read a clock, directly or through a timed name."""
    found = []
    for scope in ast.walk(ast.parse(source)):
        if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assigns = [n for n in ast.walk(scope) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and n.value]
        timed: set[str] = set()
        while True:  # to a fixed point: a name assigned from a timed name is timed too
            more = {name for a in assigns if _reads_clock(a.value, timed) for name in _assigned_names(a)}
            if more <= timed:
                break
            timed |= more
        found += [n.lineno for n in ast.walk(scope) if isinstance(n, ast.Assert) and _reads_clock(n.test, timed)]
    return sorted(found)


def test_the_detector_finds_direct_and_indirect_clock_asserts():
    source = """
import time
def f():
    t0 = time.perf_counter()
    work()
    assert time.perf_counter() - t0 < 0.5
def g():
    best = float("inf")
    for _ in range(3):
        t0 = time.monotonic()
        best = min(best, time.monotonic() - t0)
    assert best < 1.0
def h():
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        pass
    now = time.monotonic()
    state.seen_at = now
    assert state.done()
"""
    assert wall_clock_asserts(source) == [6, 12]


def test_no_unit_test_asserts_on_wall_clock_time():
    offenders = [
        f"{path.relative_to(UNIT)}:{line}"
        for path in sorted(UNIT.rglob("*.py"))
        for line in wall_clock_asserts(path.read_text())
    ]
    assert not offenders, f"wall-clock asserts (move the timing to bench/, assert what it stood for): {offenders}"
