"""Graceful preemption: SIGTERM (Slurm preemption, ``scancel``) or SIGINT (Ctrl-C) lets the
current step finish, then the loop writes a checkpoint of it, waits for the save to complete
and exits with 128 + the signal number, so a requeued job resumes from exactly that step.

With several processes every process must stop at the same step: JAX's coordination service
already catches SIGTERM for that (its preemption notifier), and
``multihost_utils.reached_preemption_sync_point`` tells all processes together.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from typing import Any

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
    """Remembers a stop request; restores the previous handlers on ``close``."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}
        self._multi = jax.process_count() > 1
        # Handlers can only be installed from the main thread (an embedding program may not be).
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                if self._multi and s == signal.SIGTERM:
                    continue  # the coordination service's notifier owns SIGTERM
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        del frame
        self.signum = signum

    def should_stop(self, step: int) -> bool:
        if self._multi:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = self.signum or signal.SIGTERM
                return True
            return False
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 0 if self.signum is None else 128 + int(self.signum)

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


class InjectedFault(RuntimeError):
    """The failure ``resilience.fault.exception_at_step`` asked for."""


def write_crash_report(run_dir: str, error: BaseException, *, step: int | None, config: dict[str, Any],
                       last_metrics: dict[str, Any] | None) -> str:
    """``<run_dir>/crash.json`` next to the metrics: what failed, where, at which step, with
    which config and the last metrics, so the operator need not dig through scheduler logs."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "crash.json")
    report = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "error": f"{type(error).__name__}: {error}",
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
        "step": step,
        "last_metrics": last_metrics,
        "config": config,
    }
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(report, fh, indent=1, default=str)
    os.replace(tmp, path)
    return path
