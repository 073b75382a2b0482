"""One run per run directory: ``<run_dir>/run.lock`` with real processes. Two runs of one
``run.name`` started together or apart: one is refused with one line naming the holder, the
other finishes with its metrics intact; a lock left by a dead process is taken over, one of
another host once its heartbeat is stale; a symlink in its place is refused."""

import fcntl
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from maxfp4.reliability.run_lock import LOCK_NAME, RunLock, RunLocked
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
    first = _start(tmp_path, "train.steps=8", "resilience.fault.slow_process=0", "resilience.fault.slow_seconds=1.5")
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


# ----------------------------------------------------------------------------- stale and odd lock files
# In-process: the lock's own functions on real files; a second open file description of the same
# file is a second flock holder, as another process would be.


def _write_lock(run_dir, record, age_s=0.0):
    path = run_dir / LOCK_NAME
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    os.utime(path, (time.time() - age_s,) * 2)
    return path


@pytest.mark.parametrize("heartbeat_age, flock_held, taken", [(400, False, True), (100, False, False),
                                                               (400, True, False)])
def test_a_lock_of_another_host_is_taken_over_once_its_heartbeat_is_stale_and_its_flock_free(
        tmp_path, heartbeat_age, flock_held, taken):
    now = time.time()
    path = _write_lock(tmp_path, {"host": "node-gone", "pid": 4242, "started": now - 1000,
                                  "heartbeat": now - heartbeat_age}, age_s=heartbeat_age)
    holder = os.open(path, os.O_RDWR)
    if flock_held:  # the old holder is alive on a host whose flock this file system shows
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    said = []
    lock = RunLock(str(tmp_path), say=said.append, stale_s=300)
    try:
        if not taken:
            with pytest.raises(RunLocked, match="host node-gone pid 4242 started "):
                lock.acquire()
            assert json.loads(path.read_text())["host"] == "node-gone" and said == []
            return
        lock.acquire()
        assert len(said) == 1 and "host node-gone pid 4242 started " in said[0], said
        assert f"last heartbeat {time.strftime('%Y-%m-%d %H:%M', time.localtime(now - heartbeat_age))}" in said[0]
        assert "is stale (no heartbeat for more than run.lock_stale_s=300 s, flock free); taking it over" in said[0]
        record = json.loads(path.read_text())
        assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    finally:
        lock.release()
        os.close(holder)


@pytest.mark.parametrize("age, taken", [(400, True), (5, False)])
def test_a_lock_file_of_garbage_is_taken_over_once_older_than_the_limit(tmp_path, age, taken):
    path = _write_lock(tmp_path, "\x00\xffnot a lock record", age_s=age)
    said = []
    lock = RunLock(str(tmp_path), say=said.append, stale_s=300)
    if not taken:
        with pytest.raises(RunLocked, match=r"holds an unreadable record, last written \d+ s ago; it is taken over "
                                            r"once older than run.lock_stale_s=300 s"):
            lock.acquire()
        assert path.read_text() == "\x00\xffnot a lock record"
        return
    with lock:
        assert len(said) == 1 and "holds an unreadable record" in said[0] and "taking it over" in said[0], said
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists()


@pytest.mark.parametrize("target_exists", [True, False])
def test_a_run_lock_symlink_is_refused_and_its_target_left_untouched(tmp_path, target_exists):
    run_dir, target = tmp_path / "run", tmp_path / "elsewhere.txt"
    run_dir.mkdir()
    if target_exists:
        target.write_text("")  # an empty file: the lock would have written its record into it
    (run_dir / LOCK_NAME).symlink_to(target)
    with pytest.raises(RunLocked, match=f"run directory lock {run_dir / LOCK_NAME} is a symbolic link "
                                        f"\\(to {target}\\); expected a regular file"):
        RunLock(str(run_dir)).acquire()
    assert (target.read_text() == "") if target_exists else not target.exists()
    assert (run_dir / LOCK_NAME).is_symlink()


def test_the_holder_refreshes_its_heartbeat_while_it_holds_the_lock(tmp_path):
    lock = RunLock(str(tmp_path), stale_s=300, heartbeat_s=0.05)
    assert lock.heartbeat_s == 0.05 and RunLock(str(tmp_path)).heartbeat_s == 60  # at least every minute
    lock.acquire()
    try:
        path = tmp_path / LOCK_NAME
        first = json.loads(path.read_text())
        beats = [first["heartbeat"]]
        deadline = time.time() + 5
        while len(set(beats)) < 3 and time.time() < deadline:
            time.sleep(0.05)
            beats.append(json.loads(path.read_text())["heartbeat"])
        assert len(set(beats)) >= 3 and beats == sorted(beats), beats
        record = json.loads(path.read_text())
        assert (record["pid"], record["started"]) == (os.getpid(), first["started"])
    finally:
        lock.release()
    assert not [t for t in threading.enumerate() if t.name == "maxfp4-run-lock-heartbeat"]  # stopped
    assert not (tmp_path / LOCK_NAME).exists()
