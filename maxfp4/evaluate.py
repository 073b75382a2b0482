"""Held-out loss: a loss-only step over the eval batches, and the mean over all of them.

As a command, ``python -m maxfp4.evaluate RUN_OR_EXPORT --tasks ...`` scores downstream tasks
through lm-evaluation-harness instead (:mod:`maxfp4.lm_eval_cli`).

The eval step returns the summed token loss and the token count of one global batch rather than
their ratio, so the mean over several batches weighs every held-out token equally (the last eval
batch is partly padding). It runs the model exactly as training does (same precision policy and
scales) with a fixed key, so the same parameters always give the same eval loss.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from maxfp4.config import Config
from maxfp4.loop import Hook
from maxfp4.precision import PrecisionPolicy
from maxfp4.precision.state import scales_of
from maxfp4.state import TrainState
from maxfp4.step import make_loss_fn


def make_eval_step(cfg: Config, policy: PrecisionPolicy, mesh=None) -> Callable:
    """``eval_step(state, batch) -> (summed token loss, token count)``, both FP32 scalars, traced
    under ``mesh``; jit it."""
    loss_fn = make_loss_fn(cfg, policy, mesh)

    def eval_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        n_tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))
        # denom=1: the summed loss; the caller divides by all batches' tokens at once.
        loss_sum = loss_fn(state.params, scales_of(state.precision), batch, jax.random.key(0), jnp.float32(1.0))
        return loss_sum, n_tokens

    return eval_step


def mean_eval_loss(jitted_eval_step: Callable, state: TrainState, batches: Sequence[dict]) -> float:
    """Token-weighted mean loss over ``batches`` (already global arrays); NaN if they hold no token."""
    totals = [jitted_eval_step(state, batch) for batch in batches]  # dispatched before any fetch
    loss_sum = sum(float(s) for s, _ in totals)
    n_tokens = sum(float(n) for _, n in totals)
    return loss_sum / n_tokens if n_tokens else float("nan")


class EvalHook(Hook):
    """Held-out loss on the state just dispatched, on the steps its cadence names
    (``train.eval_every`` and the last: ``every(hook, n, last=True)``); ``losses`` (step -> loss)
    is read by the metrics, which log it with that step."""

    def __init__(self, eval_step: Callable, batches: Sequence[dict]):
        self.eval_step, self.batches = eval_step, batches
        self.losses: dict[int, float] = {}

    def on_due(self, loop, step: int) -> None:
        if self.batches:
            self.losses[step] = mean_eval_loss(self.eval_step, loop.state, self.batches)


if __name__ == "__main__":
    import sys

    from maxfp4.lm_eval_cli import main

    sys.exit(main())
