"""One job per run directory: an exclusive lock held for the life of the job.

A ``kill -9`` that reaches torchrun but not its workers left them training and writing
checkpoints while a ``--resume`` (or an ``--overwrite``) started on the same directory:
two jobs wrote one run. Every rank of a job now holds ``flock(LOCK_EX)`` on
``<its run folder>/.lrmoe.lock`` from the moment it starts writing there until the
process ends; the operating system releases it when the process dies, ``kill -9``
included, so a lock is never left behind. The file holds the holder's pid, host and start
time, which the refusal names. Rank folders: :func:`lrmoe.training.checkpoint.rank_dir`.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Optional

LOCK_FILE = ".lrmoe.lock"


class RunDirBusy(FileExistsError):
    """Another live process holds the run directory's lock."""


class RunLock:
    """The exclusive lock of one run folder (see the module docstring).

    Args:
        run_dir: the folder this process writes (made if missing).

    Raises:
        RunDirBusy: another process holds the lock; the message names its pid, host and
            start time and the fix.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(self._fd)
            os.close(self._fd)
            self._fd = None
            raise RunDirBusy(
                f"run directory {self.path.parent} is in use by {holder}; wait for that job "
                "to end (or stop it), or give this run another --out") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (json.dumps(record) + "\n").encode(), 0)

    def release(self) -> None:
        """Give the lock back (also done by the OS when the process ends)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _read_holder(fd: int) -> str:
    """'pid P on host H (since T)' from the lock file, or a plain description."""
    try:
        rec = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {rec['pid']} on host {rec['host']} (since {rec['started']})"
    except (ValueError, KeyError, OSError):
        return "another process"
