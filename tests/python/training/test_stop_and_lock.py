"""The run directory's lock (lrmoe/training/run_lock.py) and the stop signals
(lrmoe/training/stop.py), each against what the operating system does: a second process
that asks for the lock, a real SIGTERM / SIGINT to this process, a launcher killed with
SIGKILL. Whole runs under torchrun are in tests/python/parallel/test_expert_parallel.py."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lrmoe.training import stop
from lrmoe.training.run_lock import LOCK_FILE, RunDirBusy, RunLock

ROOT = Path(__file__).resolve().parents[3]
TRY_LOCK = ("import sys; from lrmoe.training.run_lock import RunLock, RunDirBusy\n"
            "try:\n    RunLock(sys.argv[1])\nexcept RunDirBusy as e:\n"
            "    print(e); sys.exit(3)\n")


def _try_lock_elsewhere(run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TRY_LOCK, str(run_dir)], capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def test_a_second_job_is_refused_naming_the_holder_and_freed_when_it_ends(tmp_path):
    run = tmp_path / "run"
    lock = RunLock(run)  # makes the folder
    other = _try_lock_elsewhere(run)
    assert other.returncode == 3, other.stderr
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in other.stdout
    assert "give this run another --out" in other.stdout
    lock.release()
    assert _try_lock_elsewhere(run).returncode == 0


def test_the_lock_of_a_killed_holder_is_free(tmp_path):
    """kill -9 leaves no lock behind: the OS releases it with the process."""
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from lrmoe.training.run_lock import "
         "RunLock; RunLock(sys.argv[1]); print('held', flush=True); time.sleep(600)",
         str(run)], stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy, match=rf"pid {holder.pid} on host"):
            RunLock(run)
    finally:
        holder.kill()
        holder.wait(timeout=600)
    RunLock(run).release()
    assert (run / LOCK_FILE).is_file()  # the file stays; only the lock is gone


def test_sigterm_asks_for_one_stop_and_never_aborts(monkeypatch):
    calls, lines = [], []
    monkeypatch.setattr(stop, "SIGINT_REPEAT_S", 0.0)  # any second SIGINT would abort
    before = signal.getsignal(signal.SIGTERM)
    with stop.StopSignals(lambda: calls.append(1), lines.append):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM: still no abort
        time.sleep(0)  # handlers run between bytecodes
    assert calls == [1] and len(lines) == 1 and lines[0].startswith("SIGTERM: stopping")
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("repeat_s, aborts", [(0.0, True), (1e9, False)])
def test_a_second_ctrl_c_aborts_only_after_the_repeat_window(monkeypatch, repeat_s, aborts):
    """The window is set, not waited for: 0 makes any second SIGINT an abort, 1e9 none."""
    calls = []
    monkeypatch.setattr(stop, "SIGINT_REPEAT_S", repeat_s)
    with stop.StopSignals(lambda: calls.append(1), lambda line: None):
        os.kill(os.getpid(), signal.SIGINT)
        if aborts:
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0)
        else:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0)
    assert calls == [1]


def test_a_worker_gets_sigterm_when_its_launcher_is_killed(tmp_path):
    """The launcher (a stand-in for torchrun's agent) starts a worker that calls
    stop_with_launcher() and waits for SIGTERM; kill -9 of the launcher must reach it."""
    flag = tmp_path / "got-sigterm"
    worker = textwrap.dedent(f"""
        import os, signal, sys, time
        from lrmoe.training.stop import stop_with_launcher
        def on_term(*_):
            # written whole, then renamed: the test polls for the flag and must never see
            # it created but still empty (it did once, on a loaded machine)
            with open({str(flag)!r} + ".tmp", "w") as f:
                f.write("1")
            os.replace({str(flag)!r} + ".tmp", {str(flag)!r})
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
        assert not stop_with_launcher()
        print("ready", flush=True)
        time.sleep(600)
    """)
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "subprocess.Popen([sys.executable, '-c', sys.argv[1]]); time.sleep(600)", worker],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        assert launcher.stdout.readline().strip() == "ready"  # the worker inherited stdout
    finally:
        launcher.kill()
        launcher.wait(timeout=600)
    deadline = time.monotonic() + 600  # a hang guard: the signal comes at once
    while not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert flag.read_text() == "1", "the orphaned worker did not get SIGTERM"
