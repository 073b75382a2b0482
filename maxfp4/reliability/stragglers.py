"""Straggler report: every ``resilience.straggler_every`` steps each process's mean *host time per
step* is gathered from all processes, and processes slower than ``straggler_threshold`` x the
median are named with their host.

Why host time, not wall time per step: the step is one SPMD program whose collectives make every
process wait for the slowest, so wall time per step is the same everywhere and cannot say who is
late. Host time is what a process spends producing and dispatching a step (the next batch, its
transfer, the dispatch), which never includes waiting for devices or peers; a process whose
host is slow (data loading, CPU contention, a throttled or oversubscribed node, a slow
filesystem) shows a long host time while its peers show a short one and wait for it instead.
A slow *device* is masked by the collectives; ``maxfp4.reliability.preflight``'s GEMM check finds those.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import numpy as np

from maxfp4.loop import Hook

HOST_BYTES = 64
# Host times of a few milliseconds jitter by more than 20%; a straggler must also be this much
# slower than the median in absolute terms before it is named.
MIN_GAP_S = 0.01


def host_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def slow_processes(times: np.ndarray, threshold: float, min_gap_s: float = MIN_GAP_S) -> list[int]:
    """Indices whose time exceeds ``threshold`` x the median and the median + ``min_gap_s``
    (nothing to compare with one process)."""
    if len(times) < 2:
        return []
    median = float(np.median(times))
    return [int(i) for i, t in enumerate(times) if t > threshold * median and t > median + min_gap_s]


def allgather(values: np.ndarray) -> np.ndarray:
    """Stack of every process's ``values`` (one process: just its own)."""
    import jax
    if jax.process_count() == 1:
        return values[None]
    from jax.experimental import multihost_utils
    return np.asarray(multihost_utils.process_allgather(values))


class StragglerMonitor:
    """Call ``add(host_s)`` on every process after every step, and ``report()`` on every process
    at the same steps (it is a collective)."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self._times: list[float] = []
        name = host_name().encode("utf-8")[:HOST_BYTES]
        raw = np.zeros(HOST_BYTES, np.uint8)
        raw[:len(name)] = np.frombuffer(name, np.uint8)
        self.hosts = [bytes(r).rstrip(b"\0").decode("utf-8", "replace") for r in allgather(raw)]

    def add(self, host_s: float) -> None:
        self._times.append(host_s)

    def report(self) -> dict[str, Any]:
        """{"host_time_s": [per process], "median_s", "slow": [{"process", "host", "host_time_s", "ratio"}]}"""
        mine = float(np.mean(self._times)) if self._times else 0.0
        self._times.clear()
        times = allgather(np.asarray([mine], np.float64))[:, 0]
        median = float(np.median(times))
        slow = [{"process": p, "host": self.hosts[p], "host_time_s": round(float(times[p]), 4),
                 "ratio": round(float(times[p]) / median, 2) if median > 0 else None}
                for p in slow_processes(times, self.threshold)]
        return {"host_time_s": [round(float(t), 4) for t in times], "median_s": median, "slow": slow}

    @staticmethod
    def describe(report: dict[str, Any]) -> str:
        if not report["slow"]:
            return f"stragglers: none (host time per step {report['host_time_s']} s)"
        parts = [f"process {s['process']} on {s['host']} {s['host_time_s']:.3f} s ({s['ratio']}x)"
                 for s in report["slow"]]
        return f"stragglers (host time per step vs median {report['median_s']:.3f} s): " + ", ".join(parts)


class StragglerHook(Hook):
    """Times each process's host work per step (making and dispatching it, not compiling it) and
    compares the processes on the steps its cadence names (``resilience.straggler_every``; the
    same steps on every process, as the comparison is a collective); the report goes into the
    next metrics record."""

    def __init__(self, monitor: StragglerMonitor, say, *, is_writer: bool):
        self.monitor, self.say, self.is_writer = monitor, say, is_writer
        self.report: dict[str, Any] | None = None  # the newest report, until the metrics take it
        self._report_step = 0
        self._host_start = 0.0

    def before_step(self, loop, step: int) -> None:
        self._host_start = time.perf_counter()

    def after_dispatch(self, loop, step: int, metrics) -> None:
        if step > loop.start_step + 1:
            self.monitor.add(time.perf_counter() - self._host_start)

    def on_due(self, loop, step: int) -> None:
        self.report, self._report_step = self.monitor.report(), step
        if self.is_writer:
            self.say(self.monitor.describe(self.report))

    def take_report(self, step: int) -> dict[str, Any] | None:
        """The newest report, for the record of the step it was made at (or a later one)."""
        if self.report is None or step < self._report_step:
            return None
        report, self.report = self.report, None
        return report
