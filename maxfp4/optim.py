"""AdamW with linear warmup and cosine decay, global-norm clipping and a weight-decay mask."""

from __future__ import annotations

from typing import Any

import jax
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


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    o = cfg.optim
    parts = []
    if o.clip > 0:
        parts.append(optax.clip_by_global_norm(o.clip))
    parts.append(optax.adamw(make_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                             weight_decay=o.weight_decay, mask=decay_mask))
    return optax.chain(*parts)
