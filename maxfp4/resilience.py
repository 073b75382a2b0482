"""Graceful preemption: SIGTERM (Slurm preemption, ``scancel``) or SIGINT (Ctrl-C) lets the
current step finish, then the loop writes a checkpoint of it, waits for the save to complete
and exits with 128 + the signal number, so a requeued job resumes from exactly that step.

With several processes every process must stop at the same step: JAX's coordination service
already catches SIGTERM for that (its preemption notifier), and
``multihost_utils.reached_preemption_sync_point`` tells all processes together.
"""

from __future__ import annotations

import signal
import threading

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
