"""When each dispatched training step finished on the devices.

The loop reads step n's metrics only after dispatching step n + 1, so the moment the host reads
them is not the moment the step ended: when a dispatch blocks (XLA's launch of a large program
waits for the previous step with several processes; a slow host sleeps before it), the read of
step n comes late by that time, and fetch-to-fetch differences move it from the last step, which
nothing follows, to the second. (A two-process Llama-3-8B run reported its last step at 112.8%
MFU that way.) A :class:`StepClock` stamps each step's end from a thread of its own that waits
for the step's outputs in dispatch order, so a step's time is the time between its end and the
previous step's end, whatever the host did meanwhile.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from typing import Any

import jax


class StepClock:
    """``watch(outputs)`` when a step is dispatched; ``ended_at(ticket)`` the ``time.perf_counter()``
    at which its outputs were ready (waits for the stamp)."""

    def __init__(self):
        self._pending: queue.Queue = queue.Queue()
        self._stamps: dict[int, float] = {}
        self._abandoned: set[int] = set()
        self._stamped = threading.Condition()
        self._tickets = itertools.count()
        self._thread = threading.Thread(target=self._stamp_in_order, name="maxfp4-step-clock", daemon=True)
        self._thread.start()

    def watch(self, outputs: Any) -> int:
        """A ticket for the step whose ``outputs`` (arrays of the jitted step) were just dispatched."""
        ticket = next(self._tickets)
        self._pending.put((ticket, outputs))
        return ticket

    def ended_at(self, ticket: int) -> float:
        with self._stamped:
            self._stamped.wait_for(lambda: ticket in self._stamps)
            return self._stamps.pop(ticket)

    def abandon(self, tickets) -> None:
        """Nothing will read these steps' stamps (a rollback abandoned the steps)."""
        with self._stamped:
            self._abandoned.update(tickets)
            for ticket in self._abandoned & self._stamps.keys():
                del self._stamps[ticket]

    def close(self) -> None:
        self._pending.put(None)
        self._thread.join(timeout=5)

    def _stamp_in_order(self) -> None:
        while (item := self._pending.get()) is not None:
            ticket, outputs = item
            try:
                jax.block_until_ready(outputs)
            except Exception:  # noqa: BLE001 - the main thread reads the same outputs and reports it
                pass
            ended = time.perf_counter()
            with self._stamped:
                if ticket in self._abandoned:
                    self._abandoned.discard(ticket)
                else:
                    self._stamps[ticket] = ended
                self._stamped.notify_all()
