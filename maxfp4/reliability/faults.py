"""Injected faults (``resilience.fault.*``), so the resilience machinery is tested against the
real failure path rather than a mock of it. All are off by default and cost nothing when off."""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from maxfp4.loop import Hook


def poison_gradients(grads: Any, step: jax.Array, steps: Sequence[int]) -> Any:
    """NaN gradients when ``step`` (1-based, traced) is one of ``steps``. The comparison runs on
    the device, so the same compiled step serves every step and the guard sees a genuine NaN."""
    hit = jnp.any(step == jnp.asarray(tuple(steps), jnp.int32))
    return jax.tree.map(lambda g: jnp.where(hit, jnp.asarray(jnp.nan, g.dtype), g), grads)


def poison_first_evaluation(grads: Any, step: jax.Array, steps: Sequence[int]) -> Any:
    """A transient fault: NaN gradients in the step's first evaluation only, when ``step``
    (1-based, traced) is one of ``steps``. The caller applies it after the evaluation that a
    re-run repeats (maxfp4.reliability.rerun), so the re-run computes clean gradients, as after a
    bit flipped in flight; :func:`poison_gradients` is the persistent fault, which re-runs reproduce."""
    return poison_gradients(grads, step, steps)


def loss_scale(step: jax.Array, from_step: int, factor: float) -> jax.Array:
    """``factor`` from ``step`` ``from_step`` on (1-based, traced), else 1. The step divides its
    loss normaliser by it, so the loss and every gradient of the backward pass (FP8 amaxes
    included) grow by ``factor`` for good: a lasting level shift, as a data-mixture change makes."""
    return jnp.where(step >= from_step, jnp.float32(factor), jnp.float32(1.0))


def hang_forever() -> None:
    """What a deadlocked collective or a stuck filesystem looks like from the loop: no progress,
    no exception. Only the hang watchdog (or a signal) ends it."""
    threading.Event().wait()


def maybe_slow_down(process_index: int, slow_process: int, seconds: float) -> None:
    """A straggling host: this process loses ``seconds`` of host time every step."""
    if process_index == slow_process and seconds > 0:
        time.sleep(seconds)


class FaultHook(Hook):
    """The host-side faults of ``resilience.fault``: a hang before a step, a slow host, an
    exception after a step (the jitted step injects NaN gradients and loss scaling itself)."""

    def __init__(self, fault, process_index: int):
        self.fault, self.process_index = fault, process_index

    def before_step(self, loop, step: int) -> None:
        if step == self.fault.hang_at_step:
            hang_forever()
        maybe_slow_down(self.process_index, self.fault.slow_process, self.fault.slow_seconds)

    def end_step(self, loop, step: int) -> None:
        from maxfp4.reliability.preemption import InjectedFault
        if step == self.fault.exception_at_step:
            raise InjectedFault(f"resilience.fault.exception_at_step={self.fault.exception_at_step}")
