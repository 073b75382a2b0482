"""Hang watchdog: a daemon thread that ends a process in which no training step has completed for
``resilience.hang_timeout_s`` seconds.

A hung collective (a peer died, a NIC went down) or a stuck filesystem blocks the loop forever
without raising anything, and the job burns its allocation. The watchdog writes what an operator
needs to find the cause, ``<run_dir>/hang_<process>.txt`` (the last step and metrics, then every
thread's Python stack from ``faulthandler``), prints one line, and leaves with ``os._exit``
(``EXIT_CODE`` = 124, as coreutils ``timeout``), so the scheduler can requeue the job and the
rerun resumes from the last checkpoint. ``os._exit`` because the main thread is the one that is
stuck: an exception or ``sys.exit`` from this thread would never reach it.

The clock arms at the first ``beat`` (the first step completing), so compilation never counts.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from typing import Any, Callable

from maxfp4.loop import Hook

EXIT_CODE = 124


class HangWatchdog(Hook):
    def __init__(self, run_dir: str, timeout_s: float, process_index: int = 0,
                 on_exit: Callable[[], None] = lambda: None):
        self.on_exit = on_exit  # runs just before os._exit (releases the run-directory lock)
        self.path = os.path.join(run_dir, f"hang_{process_index}.txt")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._last_beat: float | None = None  # None: not armed yet
        self._step: int | None = None
        self._metrics: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="maxfp4-hang-watchdog", daemon=True)
            self._thread.start()

    def beat(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        """A step completed (its metrics reached the host)."""
        with self._lock:
            self._last_beat = time.monotonic()
            self._step = step
            if metrics is not None:
                self._metrics = metrics

    def after_step(self, loop, step: int, values: dict[str, float], final: bool) -> None:
        self.beat(step, values)

    def on_rewind(self, loop, step: int) -> None:
        self.beat(step)

    def _watch(self) -> None:
        poll = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(poll):
            with self._lock:
                last, step, metrics = self._last_beat, self._step, self._metrics
            if last is not None and time.monotonic() - last > self.timeout_s:
                self._fire(step, metrics)

    def _fire(self, step: int | None, metrics: dict[str, Any] | None) -> None:
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "w", encoding="utf-8") as fh:
                fh.write(f"no training step completed for {self.timeout_s:g} s "
                         f"(resilience.hang_timeout_s); last completed step {step}\n")
                fh.write(f"time {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, pid {os.getpid()}\n")
                fh.write("last metrics: " + json.dumps(metrics, default=str) + "\n\n")
                fh.flush()
                faulthandler.dump_traceback(file=fh, all_threads=True)
            where = self.path
        except OSError as e:  # still exit: a hung job that cannot write is still hung
            where = f"(could not write {self.path}: {e})"
        print(f"hang watchdog: no step completed for {self.timeout_s:g} s after step {step}; "
              f"stacks in {where}; exiting with code {EXIT_CODE}", file=sys.stderr, flush=True)
        try:
            self.on_exit()
        finally:
            os._exit(EXIT_CODE)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
