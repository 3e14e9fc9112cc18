"""bench/cpu_steal.py: the steal share of /proc/stat's cpu line between two readings."""

from __future__ import annotations

from bench.cpu_steal import StealMeter, cpu_times


def _stat(path, user, idle, steal):
    path.write_text(f"cpu  {user} 0 10 {idle} 0 0 0 {steal} 5 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")


def test_the_stolen_share_is_steal_over_all_time_between_the_readings(tmp_path):
    stat = tmp_path / "stat"
    _stat(stat, 100, 800, 50)
    assert cpu_times(stat) == (50, 960)  # guest time is inside user already: not counted twice
    with StealMeter(stat) as m:
        _stat(stat, 160, 900, 90)  # +60 user, +100 idle, +40 steal: 40 of 200
    assert m.fraction == 0.2


def test_without_proc_stat_the_share_is_unknown(tmp_path):
    with StealMeter(tmp_path / "absent") as m:
        pass
    assert m.fraction is None and cpu_times(tmp_path / "absent") is None
    (tmp_path / "odd").write_text("intr 1 2 3\n")
    assert cpu_times(tmp_path / "odd") is None
