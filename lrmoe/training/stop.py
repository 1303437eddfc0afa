"""How a run is asked to stop: Ctrl-C (SIGINT), SIGTERM, the death of its launcher.

The first SIGINT or SIGTERM finishes the step in progress, saves a checkpoint and ends
the run (under expert parallelism every rank stops after the same step: the request rides
on the step's loss all-reduce, :func:`lrmoe.training.distributed.reduce_step_totals`), so
the wait is bounded by one step and one save. SIGTERM is what Slurm, Kubernetes and
torchrun send before a kill: torchrun passes a Ctrl-C on to its workers and turns a second
one into SIGTERM, which before ended the workers without their checkpoint. A second SIGINT
at least :data:`SIGINT_REPEAT_S` after the first aborts without saving; SIGTERM never
aborts. Under torchrun a worker also asks the kernel for a SIGTERM when its launcher dies
(``prctl(PR_SET_PDEATHSIG)``): a ``kill -9`` of torchrun no longer leaves workers
training into a run directory that a new job may open (:mod:`lrmoe.training.run_lock`).
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional

#: seconds after a Ctrl-C in which another SIGINT counts as the same one
SIGINT_REPEAT_S = 1.0
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class StopSignals:
    """Routes (``install`` / ``restore``, or as a context manager) SIGINT and SIGTERM to ``request_stop`` while a run
    trains, and puts the previous handlers back after (main thread only: Python runs
    handlers there; elsewhere it does nothing).

    Args:
        request_stop: called once, at the first signal.
        log: prints the one line that says what happens next.
    """

    def __init__(self, request_stop: Callable[[], None], log: Callable[[str], None]) -> None:
        self._request_stop, self._log = request_stop, log
        self._old: Dict[int, Any] = {}
        self._first: Optional[float] = None

    def install(self) -> None:
        """Route SIGINT and SIGTERM here (main thread only)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._on_signal)

    def restore(self) -> None:
        """Put the previous handlers back."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def __enter__(self) -> "StopSignals":
        self.install()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._first is not None:
            # A terminal's Ctrl-C reaches the whole process group, and a parent that also
            # passes it on sends a second one milliseconds later: the same Ctrl-C, not a
            # request to abort without the checkpoint. (experiments/grid.py passes nothing
            # on for this reason; the window guards other parents.) A SIGTERM is never
            # an abort: it is the launcher's or the scheduler's last word before a kill.
            if signum == signal.SIGINT and time.monotonic() - self._first >= SIGINT_REPEAT_S:
                raise KeyboardInterrupt
            return
        self._first = time.monotonic()
        self._request_stop()
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self._log(f"{what}: stopping after the step in progress and saving a checkpoint "
                  f"(Ctrl-C again, after {SIGINT_REPEAT_S:g} s, aborts without saving)")


def stop_with_launcher() -> bool:
    """Ask the kernel to send this process SIGTERM when its parent (torchrun's agent)
    dies. Linux only; elsewhere a no-op.

    Returns:
        True when the parent is already gone (re-parented to init or a subreaper): the
        caller should stop at once instead of waiting for a signal that already passed.
    """
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return False
    # the parent may have died between fork and prctl: then no signal will ever come
    return os.getppid() != parent or parent == 1
