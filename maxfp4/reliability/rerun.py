"""Re-running a skipped step once, to tell a faulty device from a real divergence
(``resilience.rerun_skipped``).

When the guard (maxfp4.reliability.guard) skips a step, the step evaluates its loss and gradients
a second time from the same parameters, batch, precision scales and random key, and compares the
two results bit for bit. ``run.deterministic`` (required with this) makes healthy hardware give
the same bits twice, so:

- the same result: the step really is bad (the model diverged, or the batch is bad); the skip,
  and any rollback a streak of them brings, is the right response;
- a different result: the first evaluation was corrupted in flight, a transient hardware fault
  (silent data corruption); the step is still skipped (which of the two results is right is
  unknown), and the device is counted: ``rerun_drain_after`` of them in one run and the log says
  to drain it.

Why inside the jitted step: the host learns of a skip one step late, when the state the step
started from has already been donated to the next step, so a re-run from the host would need a
copy of every step's state and batch. Inside the step that state is still there: the step's
evaluation is the body of a loop that runs once, or twice when the guard judges the first
result bad (:func:`evaluate_with_rerun`). One body, compiled once, so a healthy device computes
the same bits both times; a good step runs once and pays the loop (its condition read by the
host, ~1-2 ms a step on a GPU), a skipped step one more forward and backward pass. The loop
changes how XLA fuses the step, so a run with re-runs on is reproducible among its own kind
(``run.deterministic``) but not bit-identical to one with them off.

What it cannot tell: the comparison is of the step's global results (the loss and the gradients
summed over every device), so with several devices it cannot say which one differed; the lines
then name all of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from maxfp4.loop import Hook
from maxfp4.reliability.stragglers import host_name

NOT_RERUN, REPRODUCED, DIFFERED = 0, 1, 2  # the metric ``rerun_verdict``


def same_bits(a: Any, b: Any) -> jax.Array:
    """True when every leaf of ``a`` equals ``b``'s bit for bit (a NaN equals the same NaN)."""
    def equal(x, y):
        as_uint = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
        return jnp.all(jax.lax.bitcast_convert_type(x, as_uint) == jax.lax.bitcast_convert_type(y, as_uint))
    return jnp.all(jnp.stack([equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]))


def evaluate_with_rerun(evaluate: Callable[[jax.Array], Any], is_bad: Callable[[Any], jax.Array]) -> tuple[Any, jax.Array]:
    """``(results, verdict)``: ``evaluate(i)`` (the step's loss, gradients and amaxes; ``i`` the
    evaluation, 0 or 1) run once, and once more when ``is_bad(results)``; the verdict (int32) is
    NOT_RERUN, or REPRODUCED / DIFFERED as the second run's loss and gradients equal the first's
    bit for bit or not.

    Both runs are the same loop body, compiled once: two copies of the computation (a second
    one under a cond) were fused differently and rounded differently, so on a GPU every re-run
    of a healthy step "differed" (H200, 2026-11-28). The loop's condition is read by the host
    between the runs, as a cond's would be."""
    shapes = jax.eval_shape(evaluate, jnp.int32(0))
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

    def body(carry):
        i, runs, first, verdict = carry
        results = evaluate(i)
        runs = jnp.where(i == 0, 1 + is_bad(results).astype(jnp.int32), runs)
        same = same_bits(_compared(first), _compared(results))
        verdict = jnp.where(i == 1, jnp.where(same, REPRODUCED, DIFFERED), verdict).astype(jnp.int32)
        first = jax.tree.map(lambda new, old: jnp.where(i == 0, new, old), results, first)
        return i + 1, runs, first, verdict

    carry = (jnp.int32(0), jnp.int32(1), zeros, jnp.int32(NOT_RERUN))
    _, _, results, verdict = jax.lax.while_loop(lambda c: c[0] < c[1], body, carry)
    return results, verdict


def _compared(results: Any) -> tuple:
    """What a re-run compares: the loss and the gradients (the amaxes follow from them)."""
    loss, grads, _ = results
    return (loss, *jax.tree.leaves(grads))


# ----------------------------------------------------------------------------- the host side


def describe_devices(devices: Sequence[jax.Device], process_index: int, process_count: int, host: str) -> str:
    """Who computed the step, as the log names them: one device exactly, several as a group."""
    names = [f"{d.platform}:{d.id}" for d in devices]
    if len(names) == 1:
        return f"device {names[0]} of process {process_index} (host {host})"
    if process_count == 1:
        return f"one of the {len(names)} devices {', '.join(names)} of process {process_index} (host {host})"
    return f"one of the {len(names)} devices of processes 0..{process_count - 1}"


@dataclasses.dataclass(frozen=True)
class Rerun:
    """One skipped step's re-run, as metrics.jsonl's ``rerun_verdict`` and crash.json's ``reruns`` say."""

    step: int
    skip: str  # "non-finite" or "spike"
    verdict: str  # "reproduced" (a divergence) or "differed" (a transient hardware fault)
    devices: str


class RerunHook(Hook):
    """Reads each step's ``rerun_verdict``: one line per re-run step, and once ``drain_after``
    re-runs in this process's lifetime gave different results on the same devices, one line
    saying to drain them. Only ``is_writer`` prints (every process sees the same global verdict)."""

    def __init__(self, devices: str, *, single_device: bool, drain_after: int, say: Callable[[str], None],
                 is_writer: bool):
        self.devices, self.single_device, self.drain_after = devices, single_device, drain_after
        self.say = say if is_writer else (lambda line: None)
        self.reruns: list[Rerun] = []

    def after_step(self, loop, step: int, values: dict[str, float], final: bool) -> None:
        code = int(values.get("rerun_verdict", NOT_RERUN))
        if code == NOT_RERUN:
            return
        finite = math.isfinite(values["loss"]) and math.isfinite(values["grad_norm"])
        rerun = Rerun(step, "spike" if finite else "non-finite", "reproduced" if code == REPRODUCED else "differed",
                      self.devices)
        self.reruns.append(rerun)
        if rerun.verdict == "reproduced":
            self.say(f"rerun: step {step} skipped ({rerun.skip}); its re-run reproduced it bit for bit: a divergence "
                     f"or bad data, not a hardware fault ({self.devices})")
            return
        faults = [r.step for r in self.reruns if r.verdict == "differed" and r.devices == self.devices]
        self.say(f"rerun: step {step} skipped ({rerun.skip}); its re-run gave a different result: a transient "
                 f"hardware fault (silent data corruption) on {self.devices}, {len(faults)} in this run")
        if len(faults) == self.drain_after:
            steps = ", ".join(map(str, faults))
            if self.single_device:
                self.say(f"rerun: {self.devices} gave different results on {len(faults)} re-runs (steps {steps}): "
                         f"drain it")
            else:
                self.say(f"rerun: {len(faults)} re-runs (steps {steps}) gave different results on {self.devices}: "
                         f"one of them is faulty, and a re-run, which compares results summed over every device, "
                         f"cannot tell which; test them one at a time (a one-device run of this config) and drain it")

    def crash_record(self) -> list[dict[str, Any]]:
        return [dataclasses.asdict(r) for r in self.reruns]


def rerun_hook(resilience, mesh, say: Callable[[str], None], *, is_writer: bool) -> RerunHook | None:
    """The run's :class:`RerunHook` for ``resilience.rerun_skipped`` (None when off), naming the
    mesh's devices as this process sees them."""
    if not resilience.rerun_skipped:
        return None
    devices = list(mesh.devices.flat)
    who = describe_devices(devices, jax.process_index(), jax.process_count(), host_name())
    return RerunHook(who, single_device=len(devices) == 1, drain_after=resilience.rerun_drain_after, say=say,
                     is_writer=is_writer)


def reruns_of(hooks: Sequence[Hook]) -> list[dict[str, Any]] | None:
    """The re-runs recorded by the run's :class:`RerunHook`, for crash.json (None: the feature is off)."""
    return next((hook.crash_record() for hook in hooks if isinstance(hook, RerunHook)), None)
