"""AdamW with linear warmup and cosine decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from maxfp4.config import Config

# Norm scales, biases and the Mamba-2 decay (A_log), skip (D_skip) and dt bias take no decay.
NO_DECAY_MARKERS = ("norm", "bias", "A_log", "D_skip")


def make_schedule(cfg: Config) -> optax.Schedule:
    """Warmup from 0 to lr, cosine to lr*min_lr_ratio at ``schedule_steps`` (0: train.steps),
    then flat. A fixed horizon lets a run stop early and resume on the same curve."""
    o = cfg.optim
    horizon = o.schedule_steps or cfg.train.steps
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(horizon, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)
    # Step s uses the rate at s+1, so the first update is not wasted at lr 0.
    return lambda step: base(step + 1)


def decay_mask(params: Any) -> Any:
    """True for weights that take weight decay: everything but norm scales and biases."""
    def keep(path, _leaf) -> bool:
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        return not any(marker in n for n in names for marker in NO_DECAY_MARKERS)
    return jax.tree_util.tree_map_with_path(keep, params)


def global_norm(tree: Any) -> jax.Array:
    """The L2 norm of all leaves together (``optax.tree.norm``'s value, summed in another order).

    A leaf of three or more dims is a stack of blocks' weights, [L, ...], and is summed block by
    block. With unrolled blocks, XLA forms such a gradient by concatenating the blocks' own
    gradients, and a reduction over the concatenation ran at ~1.2 TB/s on an H200 (6.3 ms for
    Llama-3-8B's ``w_gate_up`` a step and GPU, 2026-11-26): each
    element's source had to be found among the 32 operands. A block's slice of the
    concatenation is that block's own buffer, reduced at bandwidth."""
    def sum_of_squares(x: jax.Array) -> jax.Array:
        x = x.astype(jnp.float32)
        if x.ndim < 3:
            return jnp.sum(jnp.square(x))
        return sum(jnp.sum(jnp.square(x[i])) for i in range(x.shape[0]))

    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(sum_of_squares(x) for x in leaves)) if leaves else jnp.zeros((), jnp.float32)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` with the norm of ``global_norm``: updates scaled by
    max_norm / norm when the norm reaches max_norm, in optax's formula."""
    def update_fn(updates, state, params=None):
        del params
        g_norm = global_norm(updates)
        trigger = g_norm < max_norm
        updates = jax.tree.map(
            lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), updates)
        return updates, state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optim
    parts = []
    if o.clip > 0:
        parts.append(clip_by_global_norm(o.clip))
    parts.append(optax.adamw(make_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                             weight_decay=o.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
