"""One run at a time in a run directory: ``<run_dir>/run.lock``.

Two jobs with the same ``run.name`` would otherwise write one checkpoint directory and one
``metrics.jsonl`` together. The lock is taken before anything else is written to the run
directory and released on every way out (a normal end, an error, a signal; ``os._exit`` paths
call :meth:`RunLock.release` first).

How it is held: the file is created (``O_EXCL``; an existing one is opened ``O_NOFOLLOW``, so a
``run.lock`` symlink never makes the trainer write another file) and ``flock``-ed, and holds
JSON naming its holder (host, pid, start time, heartbeat). A daemon thread rewrites the
heartbeat every ``min(60 s, stale_s / 5)``. A live holder keeps the flock, so a second run on
the same host (or on a file system with working ``flock``) is refused with one line naming the
holder. A lock whose flock is free was left by a process that died (kill -9, a lost node):

- same host: its pid is checked and, dead, the lock is taken over with one line;
- another host (a job requeued elsewhere): taken over with one line naming the old holder once
  its heartbeat is older than ``stale_s`` (``run.lock_stale_s``); a fresher one may be a live
  run whose flock this file system does not show across hosts, so it is refused;
- a record that cannot be read (garbage): taken over once the file was last written more than
  ``stale_s`` ago (its mtime; a live holder rewrites it with every heartbeat).

With several processes only process 0 takes the lock (the others learn the outcome from a
broadcast in :func:`lock_run_dir`): the run directory is one per job, not per host.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np

from maxfp4.errors import UserError

LOCK_NAME = "run.lock"
DEFAULT_STALE_S = 300.0  # run.lock_stale_s
MAX_HEARTBEAT_S = 60.0
RECORD_BYTES = 512  # records are padded to one length, so a heartbeat is one in-place write


class RunLocked(UserError):
    """Another run holds the run directory (exit code 2)."""


class RunDirNotWritable(UserError):
    """The run directory cannot be created or written (exit code 2)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _when(t) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if isinstance(t, (int, float)) else "?"


def _describe(holder: dict) -> str:
    text = f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} started {_when(holder.get('started'))}"
    beat = holder.get("heartbeat")
    if isinstance(beat, (int, float)):
        text += f", last heartbeat {_when(beat)} ({max(0.0, time.time() - beat):.0f} s ago)"
    return text


def _unreadable(holder: dict) -> bool:
    return not (isinstance(holder.get("host"), str) and isinstance(holder.get("pid"), int))


def _record(holder: dict) -> bytes:
    return json.dumps(holder).encode().ljust(RECORD_BYTES)


class RunLock:
    """``with RunLock(run_dir, say=print):`` or ``acquire()`` / ``release()``. ``stale_s``: a lock
    whose flock is free and whose heartbeat is older is taken over; ``heartbeat_s``: how often
    the holder refreshes its heartbeat (default ``min(60 s, stale_s / 5)``)."""

    def __init__(self, run_dir: str, say: Callable[[str], None] = print, *, stale_s: float = DEFAULT_STALE_S,
                 heartbeat_s: float | None = None):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self._say = say
        self.stale_s = stale_s
        self.heartbeat_s = heartbeat_s if heartbeat_s is not None else min(MAX_HEARTBEAT_S, stale_s / 5)
        self._fd: int | None = None
        self._record: dict = {}
        self._stop = threading.Event()
        self._beating: threading.Thread | None = None

    def acquire(self) -> None:
        while self._fd is None:
            try:
                os.makedirs(self.run_dir, exist_ok=True)
                fd = self._open()
            except OSError as e:
                raise RunDirNotWritable(f"run directory {self.run_dir}: cannot be written ({e.strerror or e}); "
                                        f"expected a writable run.output_dir") from None
            try:
                taken = self._take(fd)
            except BaseException:
                os.close(fd)
                raise
            if not taken:
                os.close(fd)
        self._start_heartbeat()

    def _open(self) -> int:
        """A new lock file (``O_EXCL``), else the existing one without following a symlink."""
        while True:
            try:
                return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            except FileExistsError:
                pass
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                continue  # released between the two opens
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.EISDIR):
                    self._refuse_odd_file()
                raise
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                self._refuse_odd_file()
            return fd

    def _refuse_odd_file(self) -> None:
        mode = os.lstat(self.path).st_mode
        what = (f"a symbolic link (to {os.readlink(self.path)})" if stat.S_ISLNK(mode) else
                "a directory" if stat.S_ISDIR(mode) else "not a regular file")
        raise RunLocked(f"run directory lock {self.path} is {what}; expected a regular file written by the "
                        f"trainer (left untouched): remove it and rerun")

    def _take(self, fd: int) -> bool:
        """Lock ``fd`` and write our record; False when the file was replaced meanwhile (retry)."""
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLocked(self._refusal(self._holder(fd), live=True)) from None
        except OSError as e:  # no flock on this file system: the pid check below decides alone
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            locked = False
        try:
            replaced = os.fstat(fd).st_ino != os.stat(self.path, follow_symlinks=False).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:  # the holder released (unlinked) it between our open and flock: a fresh file now
            return False
        previous = self._read(fd)
        if previous:
            self._take_over(fd, previous, locked)
        now = time.time()
        self._record = {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "heartbeat": now}
        os.ftruncate(fd, 0)
        os.pwrite(fd, _record(self._record), 0)
        os.fsync(fd)
        self._fd = fd
        return True

    def _take_over(self, fd: int, previous: dict, locked: bool) -> None:
        """Say why the free lock ``previous`` may be taken, or refuse it."""
        if _unreadable(previous):
            age = time.time() - os.fstat(fd).st_mtime
            if age <= self.stale_s:
                raise RunLocked(f"run directory lock {self.path} holds an unreadable record, last written {age:.0f} s "
                                f"ago; it is taken over once older than run.lock_stale_s={self.stale_s:g} s; "
                                f"if no run uses {self.run_dir}, delete {self.path} and rerun")
            self._say(f"run directory lock {self.path} holds an unreadable record, last written {age:.0f} s ago "
                      f"(more than run.lock_stale_s={self.stale_s:g} s); taking it over")
            return
        pid = previous["pid"]
        if previous["host"] == socket.gethostname():
            if pid != os.getpid() and _pid_alive(pid) and not locked:
                raise RunLocked(self._refusal(previous, live=True))
            self._say(f"run directory lock {self.path} of {_describe(previous)} is stale "
                      f"(that process is gone); taking it over")
            return
        beat = previous.get("heartbeat")  # a record without one: when the file was last written
        age = time.time() - (beat if isinstance(beat, (int, float)) else os.fstat(fd).st_mtime)
        if age <= self.stale_s:
            raise RunLocked(self._refusal(previous, live=False))
        self._say(f"run directory lock {self.path} of {_describe(previous)} is stale (no heartbeat for more "
                  f"than run.lock_stale_s={self.stale_s:g} s, flock free); taking it over")

    def _start_heartbeat(self) -> None:
        # Its own descriptor: a release closing ours never leaves the thread writing to a reused one.
        fd = os.dup(self._fd)
        self._stop.clear()
        self._beating = threading.Thread(target=self._beat, args=(fd, dict(self._record)),
                                         name="maxfp4-run-lock-heartbeat", daemon=True)
        self._beating.start()

    def _beat(self, fd: int, record: dict) -> None:
        warned = False
        try:
            while not self._stop.wait(self.heartbeat_s):
                record["heartbeat"] = time.time()
                try:
                    os.pwrite(fd, _record(record), 0)
                except OSError as e:  # a full or failing disk: the run goes on; the next beat retries
                    if not warned:
                        self._say(f"warning: run directory lock {self.path}: heartbeat not written "
                                  f"({e.strerror or e}); retrying every {self.heartbeat_s:g} s")
                        warned = True
        finally:
            os.close(fd)

    def _refusal(self, holder: dict, live: bool) -> str:
        if live:
            return (f"run directory {self.run_dir} is in use by another run ({_describe(holder)}, lock {self.path}); "
                    f"expected one run per run directory: wait for it, stop it, or choose another run.name")
        return (f"run directory {self.run_dir} is locked by {_describe(holder)} ({self.path}), which cannot be "
                f"checked from this host; it is taken over once its heartbeat is older than "
                f"run.lock_stale_s={self.stale_s:g} s; if that run is gone, delete {self.path} and rerun")

    @classmethod
    def _holder(cls, fd: int, wait_s: float = 2.0) -> dict:
        """The live holder's record. It writes it just after taking the lock, so a run refused in
        that instant waits for it (up to ``wait_s``) rather than naming nobody."""
        deadline = time.monotonic() + wait_s
        holder = cls._read(fd)
        while not holder.get("started") and time.monotonic() < deadline:
            time.sleep(0.02)
            holder = cls._read(fd)
        return holder

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            text = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            holder = json.loads(text) if text.strip() else {}
            return holder if isinstance(holder, dict) else {"host": "?", "pid": "?"}
        except (OSError, ValueError):
            return {"host": "?", "pid": "?"}  # unreadable content still counts as a holder

    def release(self) -> None:
        """Idempotent; safe from a signal-handling thread just before ``os._exit``."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._stop.set()
        if self._beating is not None and self._beating is not threading.current_thread():
            self._beating.join(timeout=2)
        self._beating = None
        try:
            # Before unlocking, so no one takes a lock on a file about to vanish; only our own
            # file (a run that took over a lock it thought stale must keep its own).
            if os.stat(self.path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_run_dir(run_dir: str, say: Callable[[str], None], stale_s: float = DEFAULT_STALE_S) -> RunLock | None:
    """Process 0 takes ``<run_dir>/run.lock``; every process learns whether it got it, so a
    refused job stops everywhere with one line instead of hanging its other processes."""
    import jax

    lock = RunLock(run_dir, say=say, stale_s=stale_s) if jax.process_index() == 0 else None
    refusal = None
    if lock is not None:
        try:
            lock.acquire()
        except RunLocked as e:
            refusal = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        took = multihost_utils.broadcast_one_to_all(np.int32(refusal is None))
        if not int(took) and refusal is None:
            raise RunLocked(f"run directory {run_dir} is in use by another run (process 0 could not lock it)")
    if refusal is not None:
        raise refusal
    return lock


def missing_directories(path: str) -> list[str]:
    """``path`` and its parents that do not exist yet, deepest first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def remove_if_empty(directories: list[str]) -> None:
    """Remove each of ``directories`` (deepest first) that holds nothing: a run that failed at
    start-up leaves no empty run directory behind, and never loses a file."""
    for directory in directories:
        try:
            os.rmdir(directory)
        except OSError:
            return


@contextmanager
def run_directory(run_dir: str, *, say: Callable[[str], None], on_exit_hooks: Callable[[Callable[[], None]], None],
                  stale_s: float = DEFAULT_STALE_S) -> Iterator[RunLock | None]:
    """The run directory, locked for the block (``on_exit_hooks`` registers the release for the
    paths that end the process with ``os._exit``). If the block fails, the directories it
    created are removed again when nothing was written into them (a failed preflight)."""
    created = missing_directories(run_dir)
    lock = lock_run_dir(run_dir, say, stale_s)
    if lock is not None:
        on_exit_hooks(lock.release)
    try:
        yield lock
    except BaseException:
        if lock is not None:
            lock.release()
        remove_if_empty(created)
        raise
    finally:
        if lock is not None:
            lock.release()
