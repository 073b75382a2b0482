"""Goodput, measured: where a run's wall time went, in ``<run>/goodput.json``, across restarts.

Each attempt (one process start of the run) records, in seconds: ``productive_s`` (steps that
count), ``compile_s`` (the first step: tracing, compiling and running it), ``checkpoint_save_s``,
``checkpoint_restore_s``, ``evaluation_s``, ``data_wait_s`` (the loop waiting for a batch),
``lost_s`` (steps computed again: after a rollback, and after a restart the steps past the
checkpoint it resumed from), ``crash_to_resume_s`` (from the last sign of life of an attempt
that crashed or was killed to this attempt's start) and ``other_s`` (start-up, data loading,
initialisation, shutdown: the rest of the wall time). The file is rewritten every
``heartbeat_s`` while the loop runs, so a killed attempt leaves its times up to its last beat.
``goodput`` = productive / wall time, over every attempt.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any, Callable, Iterable, Iterator

from maxfp4.files import write_text_atomic
from maxfp4.loop import Hook
from maxfp4.metrics import format_duration

FILE = "goodput.json"
BUCKETS = ("productive_s", "compile_s", "checkpoint_save_s", "checkpoint_restore_s", "evaluation_s", "data_wait_s",
           "lost_s", "crash_to_resume_s", "other_s")
_MEASURED = BUCKETS[1:-1]  # timed directly; productive and other are what remains of the loop and the wall
_IN_LOOP = ("checkpoint_save_s", "evaluation_s", "data_wait_s", "lost_s")  # timed inside the loop's time


def _productive_s(attempt: dict[str, Any]) -> float:
    """The loop's time less what was timed inside it (saves, evaluation, data waits, lost steps)."""
    return max(0.0, attempt["loop_s"] - sum(attempt[b] for b in _IN_LOOP))


def _charge_lost(attempt: dict[str, Any], lost: int, per_step: float) -> None:
    """Move ``lost`` of ``attempt``'s productive steps, at ``per_step`` seconds each, to lost."""
    attempt["productive_steps"] -= lost
    attempt["lost_steps"] = attempt.get("lost_steps", 0) + lost
    attempt["lost_s"] = attempt.get("lost_s", 0.0) + lost * per_step


def read_goodput(path: str) -> dict[str, Any]:
    """A run's goodput.json (``path``: the run directory or the file); {} if there is none."""
    path = os.path.join(path, FILE) if os.path.isdir(path) else path
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def summarise(attempts: list[dict[str, Any]]) -> dict[str, Any]:
    """The buckets summed over attempts, the wall time and the goodput fraction."""
    total = {b: sum(a.get(b, 0.0) for a in attempts) for b in BUCKETS}
    total["wall_s"] = sum(a["wall_s"] for a in attempts) + total["crash_to_resume_s"]
    total["lost_steps"] = sum(a.get("lost_steps", 0) for a in attempts)
    total["productive_steps"] = sum(a.get("productive_steps", 0) for a in attempts)
    return {"goodput": total["productive_s"] / total["wall_s"] if total["wall_s"] > 0 else None,
            "attempts": len(attempts), **total}


class Goodput:
    """This attempt's timings, and the earlier attempts' read from the run directory. Disabled
    (``enabled=False``, processes other than 0) it times nothing and writes nothing."""

    def __init__(self, run_dir: str, *, started_at: float, enabled: bool = True, say: Callable[[str], None] = print,
                 heartbeat_s: float = 10.0, clock: Callable[[], float] = time.time):
        self.path, self.enabled, self.say = os.path.join(run_dir, FILE), enabled, say
        self.heartbeat_s, self.clock = heartbeat_s, clock
        self.earlier: list[dict[str, Any]] = read_goodput(self.path).get("runs", []) if enabled else []
        self.now = {b: 0.0 for b in _MEASURED} | {"started_at": started_at, "last_alive": started_at, "ended": None,
                                                   "start_step": None, "last_step": None, "lost_steps": 0,
                                                   "productive_steps": 0, "loop_s": 0.0}
        previous = self.earlier[-1] if self.earlier else None
        if previous is not None and previous["ended"] in (None, "crashed"):
            self.now["crash_to_resume_s"] = max(0.0, started_at - previous["last_alive"])
        self._last_write = 0.0

    @contextlib.contextmanager
    def timing(self, bucket: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.now[bucket] += time.perf_counter() - start

    def timed_batches(self, batches: Iterable[Any]) -> Iterator[Any]:
        """``batches``, the time spent waiting for each counted as data wait."""
        iterator = iter(batches)
        while True:
            with self.timing("data_wait_s"):
                try:
                    batch = next(iterator)
                except StopIteration:
                    return
            yield batch

    def timed(self, hook, bucket: str):
        """``hook`` (or ``(hook, Every)``) with every call's time counted in ``bucket``."""
        if isinstance(hook, tuple):
            return (_TimedHook(hook[0], self, bucket), hook[1])
        return _TimedHook(hook, self, bucket) if hook is not None else None

    def record(self) -> dict[str, Any]:
        """This attempt as stored: the buckets, productive time and the rest of the wall."""
        a = dict(self.now)
        a["wall_s"] = a["last_alive"] - a["started_at"]
        a["productive_s"] = _productive_s(a)
        del a["loop_s"]
        timed = sum(a[b] for b in _MEASURED if b != "crash_to_resume_s")  # the gap lies before this attempt
        a["other_s"] = max(0.0, a["wall_s"] - a["productive_s"] - timed)
        return a

    def write(self, ended: str | None = None) -> dict[str, Any]:
        self.now["last_alive"] = self.clock()
        if ended is not None:
            self.now["ended"] = ended
        runs = self.earlier + [self.record()]
        summary = summarise(runs)
        if self.enabled:
            write_text_atomic(self.path, json.dumps({**summary, "runs": runs}, indent=1) + "\n")
        self._last_write = time.perf_counter()
        return summary

    def beat(self) -> None:
        """Rewrite the file when ``heartbeat_s`` have passed since the last write: a killed
        attempt leaves its times up to here, and its last sign of life."""
        if time.perf_counter() - self._last_write >= self.heartbeat_s:
            self.write()

    def resumed_at(self, step: int) -> None:
        """The loop starts after ``step``: the previous attempt's steps past it are computed again,
        charged as lost to that attempt at its own mean step time."""
        self.now["start_step"] = step
        previous = self.earlier[-1] if self.earlier else None
        if previous is None or previous.get("last_step") is None or previous["last_step"] <= step:
            return
        lost = min(previous["last_step"] - step, previous.get("productive_steps", 0))
        per_step = previous["productive_s"] / previous["productive_steps"] if previous.get("productive_steps") else 0.0
        _charge_lost(previous, lost, per_step)
        previous["productive_s"] -= lost * per_step  # stored with the record; this attempt's is derived

    def line(self, summary: dict[str, Any]) -> str:
        parts = [f"{name} {_duration(summary[b])}" for name, b in (
            ("steps", "productive_s"), ("compile", "compile_s"), ("checkpoint save", "checkpoint_save_s"),
            ("restore", "checkpoint_restore_s"), ("evaluation", "evaluation_s"), ("data waits", "data_wait_s"),
            ("lost", "lost_s"), ("crash to resume", "crash_to_resume_s"), ("other", "other_s"))]
        share = f"{100 * summary['goodput']:.1f}%" if summary["goodput"] is not None else "unknown"
        return (f"goodput {share} of {_duration(summary['wall_s'])} wall over {summary['attempts']} "
                f"attempt(s): {', '.join(parts)} ({self.path})")


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 60 else format_duration(seconds)


class GoodputHook(Hook):
    """Times the loop for :class:`Goodput`: the first step (compile), the steps after it, the
    steps a rollback abandons; beats into goodput.json; writes it and one line at the end."""

    def __init__(self, goodput: Goodput):
        self.g = goodput
        self._first_started: float | None = None
        self._loop_from: float | None = None  # when the first step had finished
        self._wait_at_first = 0.0
        self._finished: str | None = None

    def before_step(self, loop, step: int) -> None:
        if self._first_started is None:
            self._first_started = time.perf_counter()
            self._wait_at_first = self.g.now["data_wait_s"]
            self.g.resumed_at(loop.start_step)

    def after_dispatch(self, loop, step: int, metrics) -> None:
        if self._loop_from is None:  # after the metrics hook, which waited for the first step
            import jax

            jax.block_until_ready(metrics)
            self._loop_from = time.perf_counter()
            first_wait = self.g.now["data_wait_s"] - self._wait_at_first
            self.g.now["compile_s"] += self._loop_from - self._first_started - first_wait

    def after_step(self, loop, step: int, values, final: bool) -> None:
        n = self.g.now
        if self._loop_from is not None and step > loop.start_step + 1:
            n["productive_steps"] += 1
        n["last_step"] = step if n["last_step"] is None else max(n["last_step"], step)
        self._update_loop_time()
        self.g.beat()

    def on_rewind(self, loop, step: int) -> None:
        n = self.g.now
        self._update_loop_time()
        if n["last_step"] is not None and n["last_step"] > step and n["productive_steps"]:
            lost = min(n["last_step"] - step, n["productive_steps"])
            _charge_lost(n, lost, _productive_s(n) / n["productive_steps"])
            n["last_step"] = step

    def end_step(self, loop, step: int) -> None:
        self._update_loop_time()

    def on_finish(self, loop) -> None:
        self._update_loop_time()
        self._finished = "finished" if loop.step >= loop.total_steps else "stopped"

    def _update_loop_time(self) -> None:
        if self._loop_from is not None:
            self.g.now["loop_s"] = time.perf_counter() - self._loop_from

    def close(self) -> None:
        if self._finished is None:  # a crash: the loop ran until now
            self._update_loop_time()
        summary = self.g.write(ended=self._finished or "crashed")
        if self.g.enabled:
            self.g.say(self.g.line(summary))


class _TimedHook(Hook):
    """A hook whose calls are timed into one of :class:`Goodput`'s buckets."""

    def __init__(self, hook: Hook, goodput: Goodput, bucket: str):
        self.hook, self.goodput, self.bucket = hook, goodput, bucket

    def __getattr__(self, name: str):
        return getattr(self.hook, name)


def _timed_method(name: str):
    def method(self, *args, **kwargs):
        with self.goodput.timing(self.bucket):
            return getattr(self.hook, name)(*args, **kwargs)
    method.__name__ = name
    return method


for _name in ("before_step", "after_dispatch", "after_step", "on_due", "end_step", "on_rewind", "on_host_pause",
              "on_loop_end", "on_finish", "close"):
    setattr(_TimedHook, _name, _timed_method(_name))
