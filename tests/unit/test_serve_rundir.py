"""Where `ferry serve` puts its ipc sockets: under TMPDIR unless their paths would be longer than a Unix
socket path may be (the serve then died binding them, with ZMQError "File name too long")."""

import pytest

from ferry.shared.defaults import IPC_PATH_MAX, IPC_SOCKET_NAMES, RUNDIR_NAME_LEN, rundir_base


def _longest_socket(base: str) -> int:
    return len(f"{base}/{'x' * RUNDIR_NAME_LEN}/") + max(len(f"{n}.sock") for n in IPC_SOCKET_NAMES)


def test_a_usual_tmpdir_is_kept():
    assert rundir_base("/tmp") == "/tmp"
    assert rundir_base("/var/folders/ab/xyz123/T") == "/var/folders/ab/xyz123/T"


def test_a_deep_tmpdir_gives_way_to_the_first_fallback_that_fits():
    deep = "/tmp/pytest-of-root/pytest-175/test_eight_streams_sharing_a_40/prefix_cache"
    assert _longest_socket(deep) > IPC_PATH_MAX
    assert rundir_base(deep, fallbacks=("/" + "r" * 90, "/run/user/0", "/tmp")) == "/run/user/0"
    assert _longest_socket(rundir_base(deep)) <= IPC_PATH_MAX


def test_the_longest_tmpdir_kept_fits_exactly():
    for n in range(40, 100):
        base = "/" + "d" * n
        kept = rundir_base(base, fallbacks=("/tmp",)) == base
        assert kept == (_longest_socket(base) <= IPC_PATH_MAX)


def test_nothing_short_enough_names_tmpdir():
    with pytest.raises(ValueError, match="set TMPDIR to a shorter path"):
        rundir_base("/" + "d" * 200, fallbacks=())
