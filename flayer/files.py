"""Private files: every state folder 0700 and every state file 0600, whatever the umask.

The coordinator's journal holds each device's clipped update before any noise, a device's folder its pending
upload and personal model, the broker's folder its passwords: no other local user may read them. Every folder
and file the project keeps state in is made here, so the rule holds in one place:

- :func:`private_dir` creates a state folder 0700. An existing one another user owns is refused, whatever its mode
  (its owner could swap what it holds), and files in it are opened without following links. An existing one that other users can enter (group or world
  bits set, as ``mkdir`` under umask 022 leaves it) is made 0700 with a warning when this user owns it and it
  is not a shared sticky folder such as ``/tmp``; otherwise it is refused (:class:`OpenFolderError`): changing
  the mode of a folder someone else owns, or of a shared one, is not this program's call.
- :func:`atomic_write` writes a file 0600 (or ``mode``) through a temporary file created with that mode.
- :func:`open_private` opens a file for appending, created 0600.
- :class:`FolderLock` holds a state folder for one process (``.lock``, an exclusive ``flock``): a second program
  over the same folder is refused with :class:`FolderBusyError` naming the holder's PID. The kernel drops the lock
  when its holder exits, a crash included: no stale lock to remove by hand.

Torch-free, so the broker side imports it too (the house rule of ``tests/house``).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["FolderBusyError", "FolderLock", "OpenFolderError", "atomic_write", "exclusive", "open_private",
           "private_dir"]

log = logging.getLogger(__name__)

_OTHERS = 0o077  # group and world bits


class OpenFolderError(PermissionError):
    """A state folder other users can enter, which this program may not close (not its own, or shared)."""


class FolderBusyError(OSError):
    """Another process holds the state folder (:class:`FolderLock`)."""


class FolderLock:
    """An exclusive lock on ``folder`` for this process's lifetime or until :meth:`release` (module docstring)."""

    NAME = ".lock"

    def __init__(self, folder: str | Path, what: str = "state folder") -> None:
        import fcntl

        self.path = Path(folder) / self.NAME
        self._fd: int | None = None
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode("ascii", "replace").strip() or "?"
            self.release()
            raise FolderBusyError(f"{what} {Path(folder)} is in use by another process (pid {holder}); two over one "
                                  f"folder would overwrite each other's state: stop it first, or use another "
                                  f"folder") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __del__(self) -> None:
        self.release()


@contextmanager
def exclusive(lock_file: str | Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_file`` (created 0600, no link followed) while the block runs: one
    writer at a time across processes, waiting for the others."""
    import fcntl

    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def private_dir(path: str | Path, what: str = "state folder") -> Path:
    """Create ``path`` (its parents as usual) as a 0700 folder, or make an existing one 0700 (module
    docstring); returns it."""
    path = Path(path)
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)  # umask only removes bits: at most 0700
    st = path.stat()
    if st.st_uid != os.geteuid():  # even at 0700: its owner may swap or plant what it holds (links included)
        raise OpenFolderError(f"{what} {path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): its "
                              f"owner could replace what it holds; give it a folder of its own")
    if st.st_mode & _OTHERS:
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.geteuid() or st.st_mode & stat.S_ISVTX:
            owner = "a shared (sticky) folder" if st.st_mode & stat.S_ISVTX else f"owned by uid {st.st_uid}"
            raise OpenFolderError(f"{what} {path} is open to other users (mode {mode:04o}, {owner}): it would hold "
                                  f"private state; give it a folder of its own (made 0700), or `chmod 700 {path}`")
        os.chmod(path, 0o700)
        log.warning("%s %s was open to other users (mode %04o): made it 0700; what it held before could be read",
                    what, path, mode)
    return path


def atomic_write(path: str | Path, data: bytes | str, mode: int = 0o600) -> Path:
    """Write ``data`` to ``path`` through a temporary file in the same folder, created with ``mode`` from the
    start (never readable by others, not even briefly), fsynced and renamed: readers see the old file or the new
    one, never half of one. A missing folder is created 0700. The temporary name is ``.<name>.<pid><thread>.tmp``
    (digits: two threads writing one path do not share it)."""
    path = Path(path)
    if not path.parent.is_dir():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{threading.get_native_id()}.tmp")
    tmp.unlink(missing_ok=True)  # a stale one from a crash: created afresh below, with this mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
    try:
        os.fchmod(fd, mode)  # exactly ``mode``, whatever the umask
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return path


def open_private(path: str | Path, mode: str = "ab", **kwargs: Any) -> IO[Any]:
    """``open(path, mode)`` for writing or appending, a new file created 0600 whatever the umask."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    try:
        return os.fdopen(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise
