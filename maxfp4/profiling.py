"""``train.profile_steps: [first, last]``: a JAX profiler trace of those steps in ``<run>/profile``.

The trace starts before step ``first`` is dispatched and stops once step ``last`` has finished
on the device, so it holds exactly those steps (open it with TensorBoard's profile plugin, or
its ``perfetto_trace.json.gz`` with ui.perfetto.dev; ``python benchmarks/profile_summary.py
RUN_DIR/profile`` prints the device time per kernel). Only the metrics writer (process 0) traces.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from maxfp4.loop import Hook


class StepProfiler(Hook):
    def __init__(self, steps: Sequence[int], directory: str, *, enabled: bool = True):
        self.first, self.last = (steps[0], steps[1]) if steps and enabled else (None, None)
        self.directory = directory
        self.active = False

    def before_step(self, loop, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = True

    def after_dispatch(self, loop, step: int, metrics: Any) -> None:
        if self.active and step == self.last:
            jax.block_until_ready(metrics)
            self.close()
            # Writing the trace holds the host for seconds while the device idles: the steps
            # fetched next finished before it ended, and timed across it they read as nonsense.
            loop.host_paused(step)

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
