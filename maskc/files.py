"""Files maskc writes for other people to read: artifact directories and the kernel cache.

Every file appears atomically (written under a temporary name in its directory, then
renamed over the target), so a reader never sees half of one and concurrent writers of the
same content cannot corrupt it. Temporary files and directories are created with the modes
the umask gives any new file (0644 and 0755 under the usual 022), not the owner-only 0600 /
0700 of `tempfile`, so a directory compiled by one user can be read by a team, a shared
file system or a model repository. A lock file (`locked`) lets one writer at a time fill a
directory or a cache entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def _temporary_name(directory: Path, name: str) -> Path:
    return directory / f".{name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"


def temporaries(directory: Path) -> Iterator[tuple[Path, str]]:
    """The temporary files and directories in `directory`, each with the name it was made for:
    what a writer killed before its rename left behind (or one still writing)."""
    for path in directory.glob(".*.tmp"):
        parts = path.name[1:].rsplit(".", 3)
        if len(parts) == 4 and parts[1].isdigit() and len(parts[2]) == 12:
            yield path, parts[0]


def write_atomic(path: str | Path, data: bytes | str) -> Path:
    """Write `data` to `path` by renaming a fully written temporary file over it."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    tmp = _temporary_name(path.parent, path.name)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def make_temporary_dir(parent: Path, name: str) -> Path:
    """A new directory in `parent` with the umask's mode, to fill and then rename into place as `name`."""
    path = _temporary_name(parent, name)
    path.mkdir(0o777)  # the umask applies
    return path


@contextlib.contextmanager
def locked(path: Path, wait: bool = True, remove: bool = False) -> Iterator[bool]:
    """Hold the lock file `path` (created where absent) for the block; without `wait`, yield
    False at once where another process holds it. With `remove`, the file is removed before it
    is released, so it leaves nothing behind: a process that waited for a file removed meanwhile
    takes the lock of the file now at `path` instead."""
    while True:
        with open(path, "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            if remove and not _is_at(lock.fileno(), path):
                continue
            try:
                yield True
            finally:
                if remove:
                    path.unlink(missing_ok=True)
            return


def _is_at(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is the one at `path`."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
