"""Llama-style decoder: embed -> scanned blocks (RMSNorm, GQA attention with RoPE, RMSNorm,
SwiGLU) -> RMSNorm -> untied LM head.

Parameters are a plain pytree of FP32 master weights. Block weights are stacked on a leading L
axis; the forward pass scans each run of consecutive blocks that share a precision recipe
(:meth:`PrecisionPolicy.block_groups`), so compile time does not grow with depth and the layout
of the parameters does not depend on the precision policy.

Dimension letters: B batch, T sequence, D d_model, N query heads, K kv heads, G = N/K, H head
dim, F MLP hidden, V vocabulary, L blocks.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from maxfp4.config import ModelConfig
from maxfp4.model.attention import attention_block, resolve_implementation
from maxfp4.model.layers import ACT_DTYPE, normal_init, output_logits, rms_norm, swiglu_mlp
from maxfp4.model.layer_loop import run_layers
from maxfp4.model.remat import remat_body
from maxfp4.precision import LayerPrecision, PrecisionPolicy

Params = dict[str, Any]

# The layer classes of a block of this model (precision policy classes).
BLOCK_LAYER_CLASSES = ("attn_qkv", "attn_out", "mlp_up", "mlp_down")

# Logical axis names of every parameter; mesh.py maps them to mesh axes.
BLOCK_AXES = {
    "attn_norm": ("layers", "norm"),
    "w_qkv": ("layers", "embed", "kv_heads", None, "head_dim"),
    "w_o": ("layers", "heads", "embed"),
    "mlp_norm": ("layers", "norm"),
    "w_up": ("layers", "embed", "mlp", None),
    "w_down": ("layers", "mlp", "embed"),
}


def param_axes(cfg: ModelConfig) -> Params:
    del cfg
    return {
        "embed": ("vocab", "embed"),
        "blocks": dict(BLOCK_AXES),
        "final_norm": ("norm",),
        "lm_head": ("embed", "vocab"),
    }


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """FP32 master weights. Residual-branch outputs (w_o, w_down) start smaller by 1/sqrt(2L) so
    the residual stream's variance does not grow with depth (GPT-2 practice)."""
    d, L, f, v = cfg.d_model, cfg.n_layers, cfg.d_ff, cfg.vocab_size
    h, n, k = cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads
    g = n // k
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * L)
    keys = jax.random.split(key, 6)
    return {
        "embed": normal_init(keys[0], (v, d), std),
        "blocks": {
            "attn_norm": jnp.ones((L, d), jnp.float32),
            "w_qkv": normal_init(keys[1], (L, d, k, g + 2, h), std),
            "w_o": normal_init(keys[2], (L, n * h, d), out_std),
            "mlp_norm": jnp.ones((L, d), jnp.float32),
            "w_up": normal_init(keys[3], (L, d, f, 2), std),
            "w_down": normal_init(keys[4], (L, f, d), out_std),
        },
        "final_norm": jnp.ones((d,), jnp.float32),
        "lm_head": normal_init(keys[5], (d, v), std),
    }


def _block(x_BTD: jax.Array, p: Params, positions_BT: jax.Array, segment_ids_BT: jax.Array,
           cfg: ModelConfig, lp: LayerPrecision, attn_impl: str, runs_per_row: int | None) -> jax.Array:
    h = rms_norm(x_BTD, p["attn_norm"], cfg.norm_eps)
    x_BTD = x_BTD + attention_block(
        h, p["w_qkv"], p["w_o"], positions_BT, segment_ids_BT, rope_theta=cfg.rope_theta,
        implementation=attn_impl, lp=lp, max_segments=cfg.attention_max_segments, runs_per_row=runs_per_row)
    h = rms_norm(x_BTD, p["mlp_norm"], cfg.norm_eps)
    return x_BTD + swiglu_mlp(h, p["w_up"], p["w_down"], lp, smooth=cfg.smooth_swiglu)


def forward(params: Params, inputs_BT: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
            *, cfg: ModelConfig, policy: PrecisionPolicy, scales: dict | None = None,
            key: jax.Array | None = None, remat: str = "none", scan_layers: bool = True,
            constrain=lambda x, axes: x, logits: bool = True, runs_per_row: int | None = None) -> jax.Array:
    """Logits [B, T, V] in BF16.

    ``scales``: the delayed-scaling scales (:func:`maxfp4.precision.state.scales_of`); ``key``
    seeds stochastic rounding; ``constrain(x, logical_axes)`` pins activation shardings;
    ``runs_per_row``: a bound on the segment runs of every row, when the data gives one
    (:func:`maxfp4.model.attention.attend`).
    """
    x_BTD = jnp.take(params["embed"], inputs_BT, axis=0).astype(ACT_DTYPE)
    return forward_embedded(params, x_BTD, positions_BT, segment_ids_BT, cfg=cfg, policy=policy,
                            scales=scales, key=key, remat=remat, scan_layers=scan_layers, constrain=constrain,
                            logits=logits, runs_per_row=runs_per_row)


def forward_embedded(params: Params, x_BTD: jax.Array, positions_BT: jax.Array,
                     segment_ids_BT: jax.Array, *, cfg: ModelConfig, policy: PrecisionPolicy,
                     scales: dict | None = None, key: jax.Array | None = None,
                     remat: str = "none", scan_layers: bool = True, constrain=lambda x, axes: x,
                     logits: bool = True, runs_per_row: int | None = None) -> jax.Array:
    """The model after the embedding lookup (separate so tests can differentiate by position).
    ``logits=False`` returns the last block's output [B, T, D] instead of the logits."""
    attn_impl = resolve_implementation(cfg.attention)
    scales = scales or {}
    key = jax.random.key(0) if key is None else key
    x_BTD = constrain(x_BTD, ("batch", "seq", "embed"))
    for start, end in policy.block_groups():
        # One scan per run of blocks with identical recipes: the recipe is static inside it.
        whole = (start, end) == (0, cfg.n_layers)
        group = params["blocks"] if whole else jax.tree.map(lambda a: a[start:end], params["blocks"])
        group_scales = scales.get("blocks", {})
        if not whole:
            group_scales = jax.tree.map(lambda a: a[start:end], group_scales)
        group_keys = jax.random.split(jax.random.fold_in(key, start), end - start)

        def body(x, xs, start=start):
            p, s, k = xs
            lp = LayerPrecision(policy, start, s, k)
            y = _block(x, p, positions_BT, segment_ids_BT, cfg, lp, attn_impl, runs_per_row)
            return constrain(y, ("batch", "seq", "embed")), None

        body = remat_body(body, remat, scanned=scan_layers)
        x_BTD = run_layers(body, x_BTD, (group, group_scales, group_keys), end - start, scan=scan_layers)
    if not logits:  # the last block's output, for a loss that applies the head itself
        return x_BTD
    return output_logits(params, x_BTD, cfg=cfg, policy=policy, scales=scales, key=key, constrain=constrain)


@jax.custom_vjp
def token_losses(logits_BTV: jax.Array, targets_BT: jax.Array) -> jax.Array:
    """Per-token cross entropy in FP32.

    Hand-written VJP: the gradient ``(softmax - onehot) * g`` is computed from the BF16 logits
    and written once in their dtype. Autodiff wrote it in FP32 over the whole [B, T, V] and
    converted it to BF16 in a second pass (a 128K vocabulary: 8.4 GB and 4 ms a step at 2048 x 8).
    """
    return _token_losses_fwd(logits_BTV, targets_BT)[0]


def _token_losses_fwd(logits_BTV, targets_BT):
    logits = logits_BTV.astype(jnp.float32)
    logz_BT = jax.nn.logsumexp(logits, axis=-1)
    picked_BT = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
    return logz_BT - picked_BT, (logits_BTV, targets_BT, logz_BT)


def _token_losses_bwd(res, g_BT):
    logits_BTV, targets_BT, logz_BT = res
    p = jnp.exp(logits_BTV.astype(jnp.float32) - logz_BT[..., None])
    onehot = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, logits_BTV.ndim - 1) == targets_BT[..., None]
    dlogits = (p - onehot.astype(jnp.float32)) * g_BT[..., None]
    return dlogits.astype(logits_BTV.dtype), None


token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


def chunked_loss_sum(params: Params, x_BTD: jax.Array, targets_BT: jax.Array, mask_BT: jax.Array,
                     chunks: int, *, cfg: ModelConfig, policy: PrecisionPolicy, scales: dict,
                     key: jax.Array, constrain=lambda x, axes: x) -> jax.Array:
    """``sum(token_losses(output_logits(x)) * mask)`` over ``chunks`` slices of the sequence at
    a time (``train.loss_chunks``): one slice's [B, T/chunks, V] logits live at once, and the
    backward pass recomputes each slice's LM head instead of keeping the logits, which costs a
    third more LM-head FLOPs. The head must be BF16 (``check_loss_chunks``): a quantized head's
    scales and amaxes span the whole tensor."""
    b, t = x_BTD.shape[:2]
    tc = t // chunks

    def per_chunk(x_BcD, targets_Bc, mask_Bc):
        x_BcD = constrain(x_BcD, ("batch", "seq", "embed"))
        logits = output_logits(params, x_BcD, cfg=cfg, policy=policy, scales=scales, key=key,
                               constrain=constrain)
        return jnp.sum(token_losses(logits, targets_Bc) * mask_Bc)

    per_chunk = jax.checkpoint(per_chunk, prevent_cse=False)  # inside the scan: no barrier needed

    def body(total, xs):
        return total + per_chunk(*xs), None

    def split(a):  # [B, T, ...] -> [chunks, B, T / chunks, ...], still sharded over B
        a = jnp.swapaxes(a.reshape(b, chunks, tc, *a.shape[2:]), 0, 1)
        return constrain(a, (None, "batch", "seq", "embed")[:a.ndim])

    total, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (split(x_BTD), split(targets_BT), split(mask_BT)))
    return total
