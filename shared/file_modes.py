"""Modes of the files a command writes for others to read: a model directory written by a host user and
served by a container's user (uid 10001 in the image) must be readable by that other user."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def current_umask() -> int:
    """This process's umask (os.umask only sets it: set and restore)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _file_stamps(directory: Path) -> dict[Path, tuple[int, int]]:
    """(inode, mtime) of each regular file directly in `directory`, symlinks left out; {} if it does not exist."""
    stamps = {}
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return stamps
    for entry in entries:
        if entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            stamps[Path(entry.path)] = (st.st_ino, st.st_mtime_ns)
    return stamps


@contextmanager
def written_with_umask_modes(directory: str | Path) -> Iterator[None]:
    """Files written into `directory` inside the block (new or rewritten) get the mode open() gives a new
    file under the umask, 0644 under the usual 022, whatever their writer chose: transformers writes
    safetensors through a temporary file, which is 0600, so a container's user could not read the model.
    A umask that keeps others out (077) is kept: the files are then as private as the user asked."""
    directory = Path(directory)
    before = _file_stamps(directory)
    yield
    mode = 0o666 & ~current_umask()
    for path, stamp in _file_stamps(directory).items():
        if before.get(path) != stamp and stat.S_IMODE(path.stat().st_mode) != mode:
            path.chmod(mode)


__all__ = ["current_umask", "written_with_umask_modes"]
