"""One training run per workdir: an exclusive OS file lock on WORKDIR/.lock.

`train` holds the lock from before it opens the run's checkpoints and metrics until its last
checkpoint has committed, so a second run started in the same workdir is refused at once
(instead of doubling every metrics line and deleting the first run's checkpoint that is being
written). While held, the file's text is the holder's process id, which the refusal names.

The lock is `flock(2)`: the OS drops it when the holding process exits or dies (a crash or
SIGKILL never leaves a workdir locked), and it also excludes a second lock taken in the same
process. The file stays when released (empty): deleting it would race with a process that has
just opened it. Reading a run (`tfx eval`, `tfx sample`) takes no lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

__all__ = ["WorkdirBusyError", "WorkdirLock"]


class WorkdirBusyError(ValueError):
    """Another process (or another lock in this one) holds the workdir's lock."""


class WorkdirLock:
    """The exclusive lock on `workdir` (created if missing); `acquire` / `release`, or use it as
    a context manager."""

    def __init__(self, workdir: str | os.PathLike):
        self.workdir = Path(workdir)
        self.path = self.workdir / ".lock"
        self._fd: int | None = None

    def acquire(self) -> WorkdirLock:
        """Take the lock without waiting.

        Raises:
          WorkdirBusyError: (a ValueError) naming the holder's process id when it is taken.
          OSError: naming the workdir when it cannot be created or written (read-only file
            system, a regular file in the way, a full disk, no permission).
        """
        if self._fd is not None:
            raise RuntimeError(f"this lock on {self.workdir} is already held")
        fd = _writable(self.workdir, lambda: _open(self.path))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WorkdirBusyError(
                f"workdir {self.workdir} is in use by another training run (process id "
                f"{holder}); wait for it to end, stop it, or choose another workdir") from None
        try:
            _writable(self.workdir, lambda: _write_pid(fd))
        except OSError:
            os.close(fd)  # closing drops the lock
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock and empty the file (nothing happens when it is not held)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # closing drops the lock

    def __enter__(self) -> WorkdirLock:
        return self.acquire()

    def __exit__(self, *exc_info) -> None:
        self.release()


def _open(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)


def _write_pid(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _writable(workdir: Path, action):
    """`action()`, with an OSError re-raised as one of the same kind that names the workdir."""
    try:
        return action()
    except OSError as error:
        raise type(error)(error.errno, f"cannot write in the workdir {workdir}: "
                                       f"{error.strerror or error}") from error
