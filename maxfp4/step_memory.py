"""The train step compiled on its first call and held to the device's memory before it runs.

XLA's buffer assignment of the compiled step (arguments + outputs - what donation aliases +
temporaries) is the memory the step holds at its peak as XLA planned it. On one H200 it came
within 5% of every measured peak of docs/PERFORMANCE.md's one-GPU rows (docs/PLANNING.md,
"Memory"), where the planner's model, which the start-up preflight must use before anything
compiles, is 17% off at worst. So the preflight refuses only what the model puts well past the
device (:data:`maxfp4.reliability.preflight.PLANNER_MEMORY_OVER`), and this check, at the first
call, refuses a step XLA planned over the device's memory in one line, before it runs out of
memory in the middle of its first step.

The step is compiled once, as jit would on that call (same lowering, same compilation cache),
and the compiled executable runs every step; it takes the same arguments every step (the state
and a batch of fixed shapes).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from maxfp4.errors import UserError

GIB = 2**30


class StepDoesNotFit(UserError):
    """The compiled step needs more memory a device than the device has."""


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def memory_remedy(remat: str) -> str:
    """What to change when a step does not fit a device (the preflight's line and this one's)."""
    return ("shard more (mesh.fsdp), lower data.global_batch or raise train.microbatches"
            + ("" if remat == "full" else ", or set train.remat=full"))


def planned_bytes(analysis: Any) -> int:
    """Bytes a device the compiled step holds at its peak by XLA's buffer assignment
    (``Compiled.memory_analysis()``)."""
    return (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
            + analysis.temp_size_in_bytes)


def device_limit_bytes(device) -> int | None:
    """What JAX's allocator may use on ``device`` (None where it does not say: CPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("bytes_limit") or None


class CheckedStep:
    """``step(state, batch)``: ``jitted`` compiled on the first call, its plan checked against
    ``limit_bytes`` (None: no check), then run. ``planned`` holds the plan's bytes a device once
    compiled; ``say`` gets one line with them; ``remedy`` (:func:`memory_remedy`) ends a refusal."""

    def __init__(self, jitted: Callable, limit_bytes: int | None, say: Callable[[str], None] = lambda m: None,
                 remedy: str = memory_remedy("none")):
        self._jitted = jitted
        self._limit = limit_bytes
        self._say = say
        self._remedy = remedy
        self._compiled = None
        self.planned: int | None = None
        # Host seconds of the first call's two phases: jax's tracing and lowering, then XLA's
        # compile (or the persistent cache's load); empty until then.
        self.phases: dict[str, float] = {}

    def __call__(self, state, batch):
        if self._compiled is None:
            start = time.perf_counter()
            lowered = self._jitted.lower(state, batch)
            lowered_at = time.perf_counter()
            compiled = lowered.compile()
            self.phases = {"lower_s": lowered_at - start, "xla_compile_s": time.perf_counter() - lowered_at}
            self.planned = planned_bytes(compiled.memory_analysis())
            if self._limit and self.planned > self._limit:
                raise StepDoesNotFit(
                    f"the compiled train step needs {_size(self.planned)} a device by XLA's buffer assignment, "
                    f"over the device's {_size(self._limit)}; {self._remedy}; nothing was trained")
            of = f" of the device's {_size(self._limit)}" if self._limit else ""
            self._say(f"train step compiled: {_size(self.planned)} a device by XLA's buffer assignment{of}")
            self._compiled = compiled
        return self._compiled(state, batch)
