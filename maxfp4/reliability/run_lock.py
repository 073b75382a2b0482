"""One run at a time in a run directory: ``<run_dir>/run.lock``.

Two jobs with the same ``run.name`` would otherwise write one checkpoint directory and one
``metrics.jsonl`` together. The lock is taken before anything else is written to the run
directory and released on every way out (a normal end, an error, a signal; ``os._exit`` paths
call :meth:`RunLock.release` first).

How it is held: the file is created (exclusively, never through a symbolic link: a ``run.lock``
that is a link or not a regular file is refused, its target untouched) and ``flock``-ed, and
holds JSON naming its holder (host, pid, start time, heartbeat). The holder rewrites the record
every ``beat_s`` (at most a minute), so the file's modification time says when it was last
alive. A live holder keeps the flock, so a second run on the same host (or on a file system with
working ``flock``) is refused with one line naming the holder. A lock file left by a process that
died (kill -9, a lost node) has no flock any more: on the same host its pid is checked and, dead,
the lock is taken over with one line saying so; written by another host (a job requeued
elsewhere) or unreadable, it is taken over once its heartbeat is older than ``run.lock_stale_s``
(one line naming the old holder), and refused before that, saying when it will count as stale.

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
MAX_BEAT_S = 60.0  # the holder rewrites its record at least this often


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


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return f"host {holder.get('host', '?')} pid {holder.get('pid', '?')} started {when}"


class RunLock:
    """``with RunLock(run_dir, say=print):`` or ``acquire()`` / ``release()``. ``stale_s``: how
    old a heartbeat of a holder this host cannot check must be to take its lock over."""

    def __init__(self, run_dir: str, say: Callable[[str], None] = print, *, stale_s: float = 300.0,
                 beat_s: float | None = None):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self._say = say
        self.stale_s = stale_s
        self.beat_s = beat_s if beat_s is not None else min(MAX_BEAT_S, stale_s / 4)
        self._fd: int | None = None
        self._record: dict = {}
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._beater: threading.Thread | None = None

    def acquire(self) -> None:
        try:
            os.makedirs(self.run_dir, exist_ok=True)
            fd = self._open()
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunLocked(f"run directory lock {self.path} is a symbolic link; expected a regular file "
                                f"(a lock is never written through a link: delete it and rerun)") from None
            if e.errno == errno.EISDIR:
                raise RunLocked(f"run directory lock {self.path} is not a regular file; expected a regular file "
                                f"(delete it and rerun)") from None
            raise RunDirNotWritable(f"run directory {self.run_dir}: cannot be written ({e.strerror or e}); "
                                    f"expected a writable run.output_dir") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RunLocked(f"run directory lock {self.path} is not a regular file; expected a regular file "
                                f"(delete it and rerun)")
            self._take(fd)
        except BaseException:
            os.close(fd)
            raise
        self._beater = threading.Thread(target=self._beat, name="maxfp4-run-lock-heartbeat", daemon=True)
        self._beater.start()

    def _open(self) -> int:
        """A new lock file exclusively, or the existing one; never through a symbolic link."""
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return os.open(self.path, os.O_RDWR | os.O_NOFOLLOW)

    def _take(self, fd: int) -> None:
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLocked(self._refusal(self._holder(fd), live=True)) from None
        except OSError as e:  # no flock on this file system: the pid check below decides alone
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            locked = False
        if os.fstat(fd).st_ino != os.stat(self.path).st_ino:
            # The holder released (unlinked) it between our open and flock: a fresh file now.
            os.close(fd)
            return self.acquire()
        previous = self._read(fd)
        if previous:
            same_host = previous.get("host") == socket.gethostname()
            pid = previous.get("pid")
            if not same_host or not isinstance(pid, int):
                # Another host's (a requeued job) or unreadable: its heartbeat decides. The file's
                # modification time is the heartbeat, as the file system's clock keeps it.
                age = time.time() - os.fstat(fd).st_mtime
                if age <= self.stale_s:
                    raise RunLocked(self._refusal(previous, live=False, age=age))
                what = (f"of {_describe(previous)}" if previous.get("host") not in (None, "?")
                        else "holding an unreadable record")
                self._say(f"run directory lock {self.path} {what} has had no heartbeat for {age:.0f} s "
                          f"(run.lock_stale_s={self.stale_s:g}); taking it over")
            else:
                if pid != os.getpid() and _pid_alive(pid) and not locked:
                    raise RunLocked(self._refusal(previous, live=True))
                self._say(f"run directory lock {self.path} of {_describe(previous)} is stale "
                          f"(that process is gone); taking it over")
        now = time.time()
        self._record = {"host": socket.gethostname(), "pid": os.getpid(), "started": now, "heartbeat": now}
        self._fd = fd
        self._write(fsync=True)

    def _write(self, fsync: bool = False) -> None:
        with self._write_lock:
            if self._fd is None:
                return
            data = json.dumps(self._record).encode()
            os.pwrite(self._fd, data, 0)
            os.ftruncate(self._fd, len(data))
            if fsync:
                os.fsync(self._fd)

    def _beat(self) -> None:
        """The heartbeat: the record rewritten every ``beat_s`` until the lock is released. A
        failing write (a full disk) is not this thread's to report: the run's own writes say so."""
        while not self._stop.wait(self.beat_s):
            self._record["heartbeat"] = time.time()
            try:
                self._write()
            except OSError:
                pass

    def _refusal(self, holder: dict, live: bool, age: float = 0.0) -> str:
        if live:
            return (f"run directory {self.run_dir} is in use by another run ({_describe(holder)}, lock {self.path}); "
                    f"expected one run per run directory: wait for it, stop it, or choose another run.name")
        return (f"run directory {self.run_dir} is locked by {_describe(holder)} ({self.path}), which cannot be "
                f"checked from this host; its last heartbeat was {age:.0f} s ago, and the lock is taken over "
                f"once that exceeds run.lock_stale_s={self.stale_s:g}")

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
        self._stop.set()
        with self._write_lock:
            fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)  # before unlocking, so no one takes a lock on a file about to vanish
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


def lock_run_dir(run_dir: str, say: Callable[[str], None], stale_s: float = 300.0) -> RunLock | None:
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
def run_directory(run_dir: str, *, say: Callable[[str], None],
                  on_exit_hooks: Callable[[Callable[[], None]], None], stale_s: float = 300.0) -> Iterator[RunLock | None]:
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
