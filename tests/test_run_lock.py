"""One run per run directory: ``<run_dir>/run.lock`` with real processes. Two runs of one
``run.name`` started together or apart: one is refused with one line naming the holder, the
other finishes with its metrics intact; a lock left by a dead process is taken over."""

import json
import os
import socket
import subprocess
import sys
import time

from tests.conftest import cpu_env
from tests.test_preemption import ARGS, REPO

CONFIG = os.path.join(REPO, "configs", "quickstart.yaml")


def _cmd(tmp_path, *extra):
    return [sys.executable, "-m", "maxfp4.train", CONFIG, *ARGS, f"run.output_dir={tmp_path}", "run.name=shared",
            "checkpoint.every=2", *extra]


def _start(tmp_path, *extra):
    return subprocess.Popen(_cmd(tmp_path, *extra), env=cpu_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _steps(tmp_path):
    path = tmp_path / "shared" / "metrics.jsonl"
    return [json.loads(l)["step"] for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def _refusal(err: str, holder_pid: int) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run directory "), err[-3000:]
    assert "is in use by another run" in lines[0]
    assert f"host {socket.gethostname()} pid {holder_pid} started " in lines[0]


def test_two_runs_started_together_one_is_refused_the_other_finishes(tmp_path):
    procs = [_start(tmp_path, "train.steps=6") for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], [o[1][-2000:] for o in outs]
    winner, loser = (0, 1) if procs[0].returncode == 0 else (1, 0)
    _refusal(outs[loser][1], procs[winner].pid)
    assert _steps(tmp_path) == [1, 2, 3, 4, 5, 6]  # one run's records, once each
    assert sorted(os.listdir(tmp_path / "shared" / "checkpoints")) == ["2", "4", "6"]
    assert not (tmp_path / "shared" / "run.lock").exists()


def test_a_second_run_started_later_is_refused_while_the_first_runs(tmp_path):
    first = _start(tmp_path, "train.steps=8", "resilience.fault.slow_process=0", "resilience.fault.slow_seconds=0.5")
    deadline = time.time() + 240
    while len(_steps(tmp_path)) < 2:
        assert first.poll() is None and time.time() < deadline, "the first run did not get going"
        time.sleep(0.1)
    lock = json.loads((tmp_path / "shared" / "run.lock").read_text())
    assert lock["pid"] == first.pid and lock["host"] == socket.gethostname() and lock["started"] <= time.time()
    second = subprocess.run(_cmd(tmp_path, "train.steps=8"), env=cpu_env(1), capture_output=True, text=True,
                            timeout=240)
    assert second.returncode == 2
    _refusal(second.stderr, first.pid)
    assert first.poll() is None  # refused before it wrote anything: the first run goes on
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert _steps(tmp_path) == list(range(1, 9))
    assert not (tmp_path / "shared" / "run.lock").exists()


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_one_line(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "shared"
    run.mkdir()
    (run / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "started": 1.7e9}))
    out = subprocess.run(_cmd(tmp_path, "train.steps=2"), env=cpu_env(1), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(l for l in out.stdout.splitlines() if "run.lock" in l)
    assert f"host {socket.gethostname()} pid {dead.pid} started " in line
    assert "is stale (that process is gone); taking it over" in line
    assert _steps(tmp_path) == [1, 2] and not (run / "run.lock").exists()


def test_a_run_refused_while_the_holder_writes_its_record_names_the_holder(tmp_path):
    """The holder takes the lock, then writes who it is: a run refused in between waits for the
    record instead of naming nobody (seen once with two runs started together)."""
    import fcntl
    import threading

    import pytest

    from maxfp4.reliability.run_lock import LOCK_NAME, RunLock, RunLocked

    path = tmp_path / LOCK_NAME
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # locked, nothing written yet
    record = json.dumps({"host": socket.gethostname(), "pid": 4242, "started": time.time()}).encode()
    writer = threading.Timer(0.3, lambda: os.pwrite(holder, record, 0))
    writer.start()
    try:
        with pytest.raises(RunLocked, match=f"host {socket.gethostname()} pid 4242 started "):
            RunLock(str(tmp_path)).acquire()
    finally:
        writer.join()
        os.close(holder)


def _old(path, seconds: float) -> None:
    past = time.time() - seconds
    os.utime(path, (past, past))


def test_another_hosts_lock_is_taken_over_once_its_heartbeat_is_stale(tmp_path):
    """A job requeued on another node finds the dead node's run.lock: its flock is gone, its pid
    cannot be checked from here, so its heartbeat (the file's modification time) decides."""
    import pytest

    from maxfp4.reliability.run_lock import LOCK_NAME, RunLock, RunLocked

    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": "node-gone", "pid": 77, "started": 1.7e9, "heartbeat": 1.7e9}))
    _old(path, 100)
    with pytest.raises(RunLocked, match=r"locked by host node-gone pid 77 started .* last heartbeat was 100 s ago, "
                                        r"and the lock is taken over once that exceeds run.lock_stale_s=300$"):
        RunLock(str(tmp_path), stale_s=300).acquire()
    _old(path, 400)
    said = []
    lock = RunLock(str(tmp_path), say=said.append, stale_s=300)
    lock.acquire()
    try:
        assert len(said) == 1 and said[0].startswith(f"run directory lock {path} of host node-gone pid 77 started ")
        assert said[0].endswith("has had no heartbeat for 400 s (run.lock_stale_s=300); taking it over")
        assert json.loads(path.read_text())["host"] == socket.gethostname()
    finally:
        lock.release()
    # A record nobody can read: the same rule, and the line says so.
    path.write_bytes(b"\x00garbage{")
    _old(path, 50)
    with pytest.raises(RunLocked, match="last heartbeat was 50 s ago"):
        RunLock(str(tmp_path), stale_s=300).acquire()
    _old(path, 301)
    said.clear()
    lock = RunLock(str(tmp_path), say=said.append, stale_s=300)
    lock.acquire()
    lock.release()
    assert said == [f"run directory lock {path} holding an unreadable record has had no heartbeat for 301 s "
                    f"(run.lock_stale_s=300); taking it over"]


def test_the_holder_beats_and_a_lock_symlink_or_non_file_is_refused_untouched(tmp_path):
    import pytest

    from maxfp4.reliability.run_lock import LOCK_NAME, RunLock, RunLocked

    path = tmp_path / LOCK_NAME
    lock = RunLock(str(tmp_path), beat_s=0.05)
    lock.acquire()
    try:
        first = json.loads(path.read_text())["heartbeat"]
        _old(path, 1000)
        deadline = time.time() + 10
        while json.loads(path.read_text())["heartbeat"] == first:
            assert time.time() < deadline, "no heartbeat"
            time.sleep(0.05)
        assert time.time() - path.stat().st_mtime < 5  # the beat renews the file's time too
    finally:
        lock.release()
    assert not path.exists()
    target = tmp_path / "precious.txt"
    for content in ("", "keep me"):
        target.write_text(content)
        path.symlink_to(target)
        with pytest.raises(RunLocked, match=f"^run directory lock {path} is a symbolic link; expected a regular file"):
            RunLock(str(tmp_path)).acquire()
        assert target.read_text() == content and path.is_symlink()
        path.unlink()
    path.mkdir()
    with pytest.raises(RunLocked, match=f"^run directory lock {path} is not a regular file"):
        RunLock(str(tmp_path)).acquire()
