"""How much of the host's CPU time the hypervisor took while a bench ran (/proc/stat's steal column).

A device host may be a virtual machine of a few vCPUs. On one, the host kernel took 98-582 µs an expert at one token
in back-to-back runs of the same bench, and 280-1,150 µs in service, against 134-185 µs on a quiet day: a pool of 12
threads that meet at a barrier waits for whichever vCPU the hypervisor has descheduled. Recording the steal share
beside each figure tells a contended machine from a regression.
"""

from __future__ import annotations

from pathlib import Path

PROC_STAT = Path("/proc/stat")


def cpu_times(path: Path = PROC_STAT) -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat's `cpu` line; None where there is none."""
    try:
        line = path.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = line.split()
    if fields[0] != "cpu" or len(fields) < 9:
        return None
    values = [int(v) for v in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice, already counted in user and nice]
    return values[7], sum(values[:8])


class StealMeter:
    """`with StealMeter() as m: ...` then m.fraction: the share of all CPUs' time stolen inside the block
    (None without /proc/stat)."""

    def __init__(self, path: Path = PROC_STAT):
        self.path, self.fraction = path, None

    def __enter__(self) -> StealMeter:
        self._start = cpu_times(self.path)
        return self

    def __exit__(self, *exc) -> None:
        end = cpu_times(self.path)
        if self._start is not None and end is not None and end[1] > self._start[1]:
            self.fraction = round((end[0] - self._start[0]) / (end[1] - self._start[1]), 4)
