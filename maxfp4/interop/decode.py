"""One token at a time through a trained model, with a cache: the keys and values of every
attention block, and the convolution window and SSM state of every Mamba-2 block.

Written against the parameter pytree (``init_params``' names) and the model's own helpers
(``rms_norm``, ``split_heads`` with RoPE, ``mlp_block``, ``gated_group_norm``, ``output_logits``), so
a step computes what the full forward pass computes at that position, up to rounding: the
forward's chunked SSD is the recurrence below summed in another order (in BF16 matmuls with
``model.mamba.ssd_matmul: bf16``), and attention reads the cache instead of the whole row.

Every linear layer runs the BF16 recipe, whatever the run trained with: sampling reads the FP32
master weights, and a quantized recipe's scaling state belongs to training.

Dimension letters: B batch, S cache length, D d_model, N query heads, K kv heads, H attention head
dim, V vocabulary, L blocks; Mamba-2: I in_proj width, E inner width, C conv channels, W conv
width, R Mamba heads, P Mamba head dim, G groups, Z state size.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from maxfp4.config import ModelConfig, PrecisionConfig
from maxfp4.model.attention import split_heads
from maxfp4.model.layers import ACT_DTYPE, mlp_block, output_logits, rms_norm
from maxfp4.model_spec import mamba_dims, model_spec
from maxfp4.model.mamba import gated_group_norm
from maxfp4.model.mamba_layout import columns as in_proj_columns, in_proj_parts
from maxfp4.model.moe import apply_moe
from maxfp4.model.router_state import BIAS  # the run's router bias, when the sampler read it
from maxfp4.precision import LayerPrecision, PrecisionPolicy, resolve_policy

Cache = dict[str, Any]


def bf16_policy(cfg: ModelConfig) -> PrecisionPolicy:
    """Every layer class in BF16 (the policy's default recipe with no rules)."""
    return resolve_policy(PrecisionConfig(default="bf16"), cfg.n_layers)


def init_cache(cfg: ModelConfig, batch: int, length: int) -> Cache:
    """An empty cache for ``batch`` rows of up to ``length`` positions."""
    h, k = cfg.resolved_head_dim, cfg.n_kv_heads

    def kv(n: int) -> dict[str, jax.Array]:
        return {name: jnp.zeros((n, batch, length, k, h), ACT_DTYPE) for name in ("k", "v")}

    spec = model_spec(cfg)
    cache: Cache = {}
    attention_blocks = len(spec.blocks_with("attention"))
    if attention_blocks:
        cache["attention"] = kv(attention_blocks)
    mamba_blocks = len(spec.blocks_with("mamba"))
    if mamba_blocks:
        d = mamba_dims(cfg)
        # The window keeps the last W-1 in_proj outputs the convolution reads (BF16, as the
        # GEMM wrote them); the SSM state is FP32 like the SSD's.
        cache["mamba"] = {"conv": jnp.zeros((mamba_blocks, batch, d["W"] - 1, d["conv"]), ACT_DTYPE),
                          "ssm": jnp.zeros((mamba_blocks, batch, d["H"], d["P"], d["N"]), jnp.float32)}
    return cache


def attention_step(x_B1D: jax.Array, w_qkv_DKGH: jax.Array, w_o_ND: jax.Array, k_BSKH: jax.Array,
                   v_BSKH: jax.Array, position: jax.Array, rope_theta: float | None,
                   lp: LayerPrecision) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention block's output for the token at ``position`` and the cache with its key and
    value written in; positions after it are masked out."""
    b, _, d = x_B1D.shape
    _, k, g2, h = w_qkv_DKGH.shape
    qkv = lp.dot(x_B1D, w_qkv_DKGH.reshape(d, k * g2 * h), "attn_qkv").reshape(b, 1, k, g2, h)
    positions_B1 = jnp.full((b, 1), position, jnp.int32)
    q_B1NH, k_B1KH, v_B1KH = split_heads(qkv, positions_B1, rope_theta)
    k_BSKH = jax.lax.dynamic_update_slice(k_BSKH, k_B1KH.astype(k_BSKH.dtype), (0, position, 0, 0))
    v_BSKH = jax.lax.dynamic_update_slice(v_BSKH, v_B1KH.astype(v_BSKH.dtype), (0, position, 0, 0))
    seen_S = jnp.arange(k_BSKH.shape[1]) <= position
    # The forward's XLA attention (the CPU path and the GPU tests' reference): same score and
    # softmax precision, one query row.
    out_B1NH = jax.nn.dot_product_attention(q_B1NH, k_BSKH, v_BSKH, mask=seen_S[None, None, None, :],
                                            implementation="xla")
    return lp.dot(out_B1NH.reshape(b, 1, -1), w_o_ND, "attn_out"), k_BSKH, v_BSKH


def mamba_step(x_B1D: jax.Array, p: dict, conv_BWC: jax.Array, ssm_BRPZ: jax.Array, cfg: ModelConfig,
               lp: LayerPrecision) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Mamba-2 mixer for one token: in_proj, the convolution over the cached window, the SSD
    recurrence ``h = exp(dt A) h + dt x B^T``, ``y = h C + D x``, the gated norm, out_proj."""
    d = mamba_dims(cfg)
    e, c, r, pd, g, z = d["E"], d["conv"], d["H"], d["P"], d["G"], d["N"]
    b = x_B1D.shape[0]
    zxbcdt_BI = lp.dot(x_B1D, in_proj_columns(p["in_proj"], in_proj_parts(cfg)), "mamba_in")[:, 0]
    z_B1E = zxbcdt_BI[:, None, :e]
    window_BWC = jnp.concatenate([conv_BWC, zxbcdt_BI[:, None, e:e + c]], axis=1)
    width = window_BWC.shape[1]
    # The forward's causal_conv, term for term in its order: the newest input first.
    conv_BC = window_BWC[:, width - 1].astype(jnp.float32) * p["conv_w"][width - 1]
    for lag in range(1, width):
        conv_BC = conv_BC + window_BWC[:, width - 1 - lag].astype(jnp.float32) * p["conv_w"][width - 1 - lag]
    xbc_BC = jax.nn.silu(conv_BC + p["conv_b"]).astype(zxbcdt_BI.dtype)
    dt_BR = jax.nn.softplus(zxbcdt_BI[:, e + c:].astype(jnp.float32) + p["dt_bias"])
    x_BRP = xbc_BC[:, :e].reshape(b, r, pd)
    # Head i reads group i // (R / G), as the SSD's [G, R/G] split of the heads does.
    B_BRZ = jnp.repeat(xbc_BC[:, e:e + g * z].reshape(b, g, z), r // g, axis=1).astype(jnp.float32)
    C_BRZ = jnp.repeat(xbc_BC[:, e + g * z:].reshape(b, g, z), r // g, axis=1).astype(jnp.float32)
    A_R = -jnp.exp(p["A_log"])
    x32_BRP = x_BRP.astype(jnp.float32)
    ssm_BRPZ = (jnp.exp(dt_BR * A_R)[..., None, None] * ssm_BRPZ
                + (dt_BR[..., None] * x32_BRP)[..., None] * B_BRZ[:, :, None, :])
    y_BRP = jnp.einsum("brpz,brz->brp", ssm_BRPZ, C_BRZ, precision=jax.lax.Precision.HIGHEST)
    u_BRP = y_BRP.astype(x_BRP.dtype) + p["D_skip"][:, None] * x_BRP  # the SSD returns x's dtype
    y_B1E = gated_group_norm(u_BRP.reshape(b, 1, e), z_B1E, p["norm"], g, cfg.norm_eps)
    out_B1D = lp.dot(y_B1E.astype(ACT_DTYPE), p["out_proj"], "mamba_out")
    return out_B1D, window_BWC[:, 1:], ssm_BRPZ


def _dense_blocks(params: dict, cache: Cache, x_B1D: jax.Array, position: jax.Array, cfg: ModelConfig,
                  policy: PrecisionPolicy) -> tuple[jax.Array, Cache]:
    lp = LayerPrecision(policy, 0)  # every block is BF16: one scan body serves them all

    def body(x, xs):
        p, k_BSKH, v_BSKH = xs
        h = rms_norm(x, p["attn_norm"], cfg.norm_eps)
        y, k_BSKH, v_BSKH = attention_step(h, p["w_qkv"], p["w_o"], k_BSKH, v_BSKH, position,
                                           cfg.rope_theta, lp)
        x = x + y
        h = rms_norm(x, p["mlp_norm"], cfg.norm_eps)
        return x + mlp_block(h, p["w_up"], p["w_down"], lp, smooth=cfg.smooth_swiglu), (k_BSKH, v_BSKH)

    kv = cache["attention"]
    x_B1D, (k_LBSKH, v_LBSKH) = jax.lax.scan(body, x_B1D, (params["blocks"], kv["k"], kv["v"]))
    return x_B1D, {"attention": {"k": k_LBSKH, "v": v_LBSKH}}


def _hybrid_blocks(params: dict, cache: Cache, x_B1D: jax.Array, position: jax.Array, cfg: ModelConfig,
                   policy: PrecisionPolicy) -> tuple[jax.Array, Cache]:
    # Unrolled over the pattern: each block reads its own kind's stacked weights and cache rows.
    lp = LayerPrecision(policy, 0)
    seen = {t: 0 for t in model_spec(cfg).types}
    new = {"k": [], "v": [], "conv": [], "ssm": []}
    for index, block in enumerate(model_spec(cfg).blocks):
        kind = block.type
        i = seen[kind]
        seen[kind] += 1
        p = jax.tree.map(lambda a, i=i: a[i], params[kind])
        h = rms_norm(x_B1D, p["pre_norm"], cfg.norm_eps)
        if kind == "attention":
            kv = cache["attention"]
            y, k_BSKH, v_BSKH = attention_step(h, p["w_qkv"], p["w_o"], kv["k"][i], kv["v"][i], position,
                                               cfg.rope_theta if cfg.rope else None, lp)
            new["k"].append(k_BSKH)
            new["v"].append(v_BSKH)
        elif kind == "mamba":
            state = cache["mamba"]
            y, conv_BWC, ssm_BRPZ = mamba_step(h, p, state["conv"][i], state["ssm"][i], cfg, lp)
            new["conv"].append(conv_BWC)
            new["ssm"].append(ssm_BRPZ)
        elif kind == "moe":  # with the run's aux-loss-free bias when the sampler read it
            bias = {BIAS: params[BIAS][index]} if BIAS in params else None
            y = apply_moe(p, h, LayerPrecision(policy, 0, bias), cfg)
        else:
            y = mlp_block(h, p["w_up"], p["w_down"], lp, kind=cfg.mlp, smooth=cfg.smooth_swiglu)
        x_B1D = x_B1D + y.astype(x_B1D.dtype)
    out: Cache = {}
    if new["k"]:
        out["attention"] = {"k": jnp.stack(new["k"]), "v": jnp.stack(new["v"])}
    if new["conv"]:
        out["mamba"] = {"conv": jnp.stack(new["conv"]), "ssm": jnp.stack(new["ssm"])}
    return x_B1D, out


def decode_step(params: dict, cache: Cache, tokens_B: jax.Array, position: jax.Array, *,
                cfg: ModelConfig, policy: PrecisionPolicy) -> tuple[jax.Array, Cache]:
    """(FP32 logits [B, V] of the next token, the cache) after reading ``tokens_B`` at
    ``position`` (the same position in every row); jit with ``cfg`` and ``policy`` static."""
    x_B1D = jnp.take(params["embed"], tokens_B[:, None], axis=0).astype(ACT_DTYPE)
    blocks = _hybrid_blocks if cfg.kind == "hybrid" else _dense_blocks
    x_B1D, cache = blocks(params, cache, x_B1D, position, cfg, policy)
    logits_B1V = output_logits(params, x_B1D, cfg=cfg, policy=policy, scales={}, key=jax.random.key(0))
    return logits_B1V[:, 0].astype(jnp.float32), cache


def pick_tokens(logits_BV: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """Greedy (argmax) where ``temperature`` is 0; otherwise a draw from the softmax of
    ``logits / temperature`` restricted to the smallest set of most likely tokens whose
    probability reaches ``top_p`` (nucleus sampling; 1 keeps every token)."""
    greedy_B = jnp.argmax(logits_BV, axis=-1)
    probs_BV = jax.nn.softmax(logits_BV / jnp.maximum(temperature, 1e-6), axis=-1)
    sorted_BV = jnp.sort(probs_BV, axis=-1)[:, ::-1]
    # A token stays if the tokens more likely than it hold less than top_p (the first always does).
    before_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV
    kept_BV = jnp.where(before_BV < top_p, sorted_BV, 0.0)
    threshold_B1 = jnp.min(jnp.where(kept_BV > 0, kept_BV, jnp.inf), axis=-1, keepdims=True)
    masked_BV = jnp.where(probs_BV >= threshold_B1, jnp.log(probs_BV), -jnp.inf)
    drawn_B = jax.random.categorical(key, masked_BV, axis=-1)
    return jnp.where(temperature > 0, drawn_B, greedy_B).astype(jnp.int32)


def generate(params: dict, prompt_ids: list[int], *, cfg: ModelConfig, max_tokens: int, length: int,
             temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, stop_id: int | None = None,
             step_fn=None) -> list[int]:
    """The tokens that follow ``prompt_ids`` (one row), at most ``max_tokens`` and no further than
    position ``length - 1``, ending early after ``stop_id``. The prompt is read one token a step
    through the same compiled step as the generation (prefill costs a step per prompt token)."""
    if not prompt_ids or len(prompt_ids) >= length:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens: expected 1 to {length - 1}")
    step = step_fn or make_step(cfg)
    pick = jax.jit(pick_tokens)
    cache = init_cache(cfg, 1, length)
    key = jax.random.key(seed)
    temperature_, top_p_ = jnp.float32(temperature), jnp.float32(top_p)
    for position, token in enumerate(prompt_ids[:-1]):
        _, cache = step(params, cache, jnp.asarray([token], jnp.int32), jnp.int32(position))
    out: list[int] = []
    token, position = prompt_ids[-1], len(prompt_ids) - 1
    while len(out) < max_tokens and position < length:
        logits_BV, cache = step(params, cache, jnp.asarray([token], jnp.int32), jnp.int32(position))
        token = int(pick(logits_BV, jax.random.fold_in(key, position), temperature_, top_p_)[0])
        out.append(token)
        position += 1
        if token == stop_id:
            break
    return out


def make_step(cfg: ModelConfig):
    """``decode_step`` jitted once for this model (BF16 GEMMs), the cache donated to its successor."""
    policy = bf16_policy(cfg)
    return jax.jit(lambda params, cache, tokens_B, position: decode_step(
        params, cache, tokens_B, position, cfg=cfg, policy=policy), donate_argnums=1)
