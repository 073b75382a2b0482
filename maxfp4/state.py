"""The training state: one pytree that the train step consumes and returns."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps taken
    params: Any  # FP32 master weights: the model's nnx state as a pure pytree (maxfp4.model.lm)
    opt_state: Any  # optimizer moments (FP32); never sees precision state
    rng: jax.Array  # base key; each step folds in its step number
    precision: Any  # FP8 delayed-scaling state (maxfp4.precision.state); {} when unused
    guard: Any  # non-finite / spike guard statistics and skip counters (maxfp4.reliability.guard)

    def replace(self, **changes: Any) -> "TrainState":
        return dataclasses.replace(self, **changes)
