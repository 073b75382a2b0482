"""The routers' state and statistics: what mixture-of-experts blocks keep between steps and report.

The state is the per-expert bias of DeepSeek-V3's aux-loss-free balancing, f32[L, X] (a row per
block; rows of blocks without experts stay 0). It lives in ``TrainState.precision["router"]``
beside the FP8 scaling state, so the optimizer never sees it, the guard keeps it on a skipped
step and checkpoints hold it. The model reads it, and a zero "probe" f32[L, S], among the
per-block inputs ``scales["blocks"]`` (:func:`router_inputs`); each block hands its statistics
back as the probe's cotangent (:func:`maxfp4.model.moe.report`), as FP8 amaxes come back as
the scales' cotangents. Statistics of a block, S = X + 3: tokens routed to each expert, dropped
token-expert assignments, the load-balancing loss, and the tokens seen.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

BIAS, PROBE, AUX_WEIGHT = "router_bias", "router_stats", "router_aux_weight"
STATE_KEY = "router"
EXTRA_STATS = 3  # dropped, aux loss, tokens


def init_router_state(model_cfg: Any) -> dict[str, Any] | None:
    """``{"bias": f32[L, X]}`` for a model with E blocks, else None."""
    if "E" not in model_cfg.pattern:
        return None
    return {"bias": jnp.zeros((len(model_cfg.pattern), model_cfg.moe.experts), jnp.float32)}


def router_inputs(router: dict[str, Any]) -> dict[str, jax.Array]:
    """What the blocks read from ``scales["blocks"]``: the bias and a zero statistics probe."""
    bias_LX = router["bias"]
    return {BIAS: bias_LX, PROBE: jnp.zeros((bias_LX.shape[0], bias_LX.shape[1] + EXTRA_STATS), jnp.float32)}


def with_aux_weight(scales: dict[str, Any], weight: float) -> dict[str, Any]:
    """``scales`` with the weight of the load-balancing loss in the loss being differentiated
    (coefficient / microbatches, as each microbatch's loss is a share of the step's mean)."""
    blocks = scales.get("blocks", {})
    if PROBE not in blocks:
        return scales
    n_blocks = blocks[PROBE].shape[0]
    return {**scales, "blocks": {**blocks, AUX_WEIGHT: jnp.full((n_blocks,), weight, jnp.float32)}}


def combine_cotangents(acc: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """Two microbatches' scale cotangents: amaxes by max, router statistics (counts) by sum."""
    out = jax.tree.map(jnp.maximum, acc, new)
    if PROBE in acc.get("blocks", {}):
        out["blocks"][PROBE] = acc["blocks"][PROBE] + new["blocks"][PROBE]
    return out


def update_router_state(precision: dict[str, Any], cotangents: dict[str, Any], rate: float) -> dict[str, Any]:
    """DeepSeek-V3's update: ``bias += rate * sign(mean load - load)`` per block, from this
    step's token counts. Blocks without experts count nothing and keep their zero row."""
    if STATE_KEY not in precision or rate == 0:
        return precision
    counts_LX = expert_counts(cotangents["blocks"][PROBE])
    error_LX = jnp.mean(counts_LX, axis=-1, keepdims=True) - counts_LX
    bias = precision[STATE_KEY]["bias"] + rate * jnp.sign(error_LX)
    return {**precision, STATE_KEY: {**precision[STATE_KEY], "bias": bias}}


def expert_counts(stats_LS: jax.Array) -> jax.Array:
    return stats_LS[..., :-EXTRA_STATS]


def router_metrics(cotangents: dict[str, Any], moe_blocks: tuple[int, ...], microbatches: int) -> dict[str, jax.Array]:
    """Scalars for metrics.jsonl and TensorBoard: each expert's share of the routed tokens
    (mean over the E blocks; 1/X each when balanced), the largest expert load over the mean
    (the worst block), dropped token-expert assignments, and the load-balancing loss."""
    if not moe_blocks or PROBE not in cotangents.get("blocks", {}):
        return {}
    stats = cotangents["blocks"][PROBE][jnp.asarray(moe_blocks)]
    counts = expert_counts(stats)
    share = counts / jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1.0)
    mean_share = jnp.mean(share, axis=0)
    out = {f"moe_load/e{i:03d}": mean_share[i] for i in range(counts.shape[-1])}
    out["moe_max_over_mean_load"] = jnp.max(jnp.max(counts, -1) / jnp.maximum(jnp.mean(counts, -1), 1e-9))
    out["moe_dropped"] = jnp.sum(stats[:, -3])
    out["moe_aux_loss"] = jnp.mean(stats[:, -2]) / microbatches
    return out
