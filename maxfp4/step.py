"""The one pure train step: ``train_step(state, batch) -> (state, metrics)``.

Gradient accumulation runs inside the step as a scan over microbatches, and the loss is the
mean over every valid token of the global batch, so M microbatches give the same update as one
batch of the same size (up to summation order).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from maxfp4.config import Config
from maxfp4.model.decoder import forward, token_losses
from maxfp4.precision import PrecisionPolicy
from maxfp4.state import TrainState

Batch = dict[str, jax.Array]
BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")


def make_loss_fn(cfg: Config, policy: PrecisionPolicy, constrain: Callable) -> Callable:
    def loss_fn(params: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
        """Summed token loss and the number of valid tokens (FP32)."""
        logits_BTV = forward(params, batch["inputs"], batch["positions"], batch["segment_ids"],
                             cfg=cfg.model, policy=policy, remat=cfg.train.remat, constrain=constrain)
        mask_BT = batch["loss_mask"].astype(jnp.float32)
        return jnp.sum(token_losses(logits_BTV, batch["targets"]) * mask_BT), jnp.sum(mask_BT)
    return loss_fn


def _split_microbatches(batch: Batch, m: int, constrain: Callable) -> Batch:
    """[B, T] -> [M, B/M, T], taking every M-th row so each microbatch spans all devices of the
    batch-sharded input instead of living on a few of them."""
    def split(x):
        b = x.shape[0]
        x = x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None, "batch", "seq"))
    return {k: split(v) for k, v in batch.items()}


def make_train_step(cfg: Config, policy: PrecisionPolicy, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, constrain: Callable = lambda x, axes: x) -> Callable:
    loss_fn = make_loss_fn(cfg, policy, constrain)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    m = cfg.train.microbatches

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        if m == 1:
            (loss_sum, n_tokens), grads = grad_fn(state.params, batch)
        else:
            def accumulate(carry, micro):
                loss_acc, n_acc, grads_acc = carry
                (loss_sum, n), grads = grad_fn(state.params, micro)
                return (loss_acc + loss_sum, n_acc + n, jax.tree.map(jnp.add, grads_acc, grads)), None

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
            (loss_sum, n_tokens, grads), _ = jax.lax.scan(
                accumulate, init, _split_microbatches(batch, m, constrain))
        denom = jnp.maximum(n_tokens, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss_sum / denom,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "tokens": n_tokens,
        }
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return train_step


def make_eval_loss(cfg: Config, policy: PrecisionPolicy, constrain: Callable = lambda x, axes: x) -> Callable:
    loss_fn = make_loss_fn(cfg, policy, constrain)

    def eval_loss(params: Any, batch: Batch) -> jax.Array:
        loss_sum, n = loss_fn(params, batch)
        return loss_sum / jnp.maximum(n, 1.0)
    return eval_loss
