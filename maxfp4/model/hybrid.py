"""Hybrid Mamba-2 / attention / MLP stack (Nemotron-H style) from a one-character-a-block pattern:
``M`` Mamba-2, ``*`` attention, ``-`` MLP; each block is RMSNorm -> mixer -> residual.

Parameters are stacked per block type ([n_type, ...]), so their layout depends only on the
pattern. The forward pass covers the pattern with as few scans as it can: a scan repeats a unit
of up to four blocks (``"M-"``, ``"M*-"`` ...) whose blocks also repeat their precision recipes,
so a 52-block Nemotron-H pattern compiles a handful of scan bodies, not 52 blocks.

Dimension letters: B batch, T sequence, D d_model, V vocabulary.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp

from maxfp4.config import ModelConfig
from maxfp4.model.attention import attention_block, resolve_implementation
from maxfp4.model.layers import ACT_DTYPE, mlp_block, normal_init, output_logits, rms_norm
from maxfp4.model.mamba import MAMBA_AXES, init_mamba, mamba_mixer
from maxfp4.model.layer_loop import run_layers
from maxfp4.model.remat import remat_body
from maxfp4.precision import LayerPrecision, PrecisionPolicy

Params = dict[str, Any]
TYPES = {"M": "mamba", "*": "attention", "-": "mlp"}
TYPE_CLASSES = {"mamba": ("mamba_in", "mamba_out"), "attention": ("attn_qkv", "attn_out"),
                "mlp": ("mlp_up", "mlp_down")}
MAX_UNIT = 4


def block_layer_classes(cfg: ModelConfig) -> tuple[str, ...]:
    present = {TYPES[c] for c in cfg.pattern}
    return tuple(c for t in ("attention", "mlp", "mamba") if t in present for c in TYPE_CLASSES[t])


def _counts(pattern: str) -> dict[str, int]:
    return {t: sum(TYPES[c] == t for c in pattern) for t in TYPES.values()}


def param_axes(cfg: ModelConfig) -> Params:
    counts = _counts(cfg.pattern)
    axes: Params = {"embed": ("vocab", "embed"), "final_norm": ("norm",), "lm_head": ("embed", "vocab")}
    if counts["mamba"]:
        axes["mamba"] = {k: ("layers",) + v for k, v in MAMBA_AXES.items()} | {"pre_norm": ("layers", "norm")}
    if counts["attention"]:
        axes["attention"] = {"pre_norm": ("layers", "norm"),
                             "w_qkv": ("layers", "embed", "kv_heads", None, "head_dim"),
                             "w_o": ("layers", "heads", "embed")}
    if counts["mlp"]:
        axes["mlp"] = {"pre_norm": ("layers", "norm"), "w_up": ("layers", "embed", "mlp", None),
                       "w_down": ("layers", "mlp", "embed")}
    return axes


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    counts = _counts(cfg.pattern)
    d, v, std = cfg.d_model, cfg.vocab_size, cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    h, n, k = cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads
    keys = jax.random.split(key, 8)
    params: Params = {
        "embed": normal_init(keys[0], (v, d), std),
        "final_norm": jnp.ones((d,), jnp.float32),
        "lm_head": normal_init(keys[1], (d, v), std),
    }
    if counts["mamba"]:
        m = counts["mamba"]
        params["mamba"] = init_mamba(cfg, keys[2], m) | {"pre_norm": jnp.ones((m, d), jnp.float32)}
    if counts["attention"]:
        a = counts["attention"]
        params["attention"] = {"pre_norm": jnp.ones((a, d), jnp.float32),
                               "w_qkv": normal_init(keys[3], (a, d, k, n // k + 2, h), std),
                               "w_o": normal_init(keys[4], (a, n * h, d), out_std)}
    if counts["mlp"]:
        f, gates = cfg.d_ff, (2 if cfg.mlp == "swiglu" else 1)
        c = counts["mlp"]
        params["mlp"] = {"pre_norm": jnp.ones((c, d), jnp.float32),
                         "w_up": normal_init(keys[5], (c, d, f, gates), std),
                         "w_down": normal_init(keys[6], (c, f, d), out_std)}
    return params


@lru_cache(maxsize=64)
def scan_groups(pattern: str, recipe_rows: tuple) -> tuple[tuple[int, str, int], ...]:
    """Cover ``pattern`` with the fewest (start, unit, repeats) groups such that the group's
    blocks are ``unit`` repeated and block i and i + len(unit) share their recipes."""
    n = len(pattern)
    best: list[tuple[int, tuple]] = [(0, ())] + [(n + 1, ())] * n
    for i in range(n):
        cost, groups = best[i]
        for u in range(1, MAX_UNIT + 1):
            unit = pattern[i:i + u]
            if len(unit) < u:
                break
            reps = 1
            while True:
                end = i + u * reps
                if best[end][0] > cost + 1:
                    best[end] = (cost + 1, groups + ((i, unit, reps),))
                nxt = i + u * (reps + 1)
                if nxt > n or pattern[end:nxt] != unit or any(
                        recipe_rows[end + j] != recipe_rows[end + j - u] for j in range(u)):
                    break
                reps += 1
    return best[n][1]


def _block(ch: str, x_BTD, p, positions_BT, segment_ids_BT, cfg: ModelConfig, lp: LayerPrecision, attn_impl,
           constrain, runs_per_row: int | None):
    h = rms_norm(x_BTD, p["pre_norm"], cfg.norm_eps)
    if ch == "M":
        y = mamba_mixer(h, p, segment_ids_BT, cfg, lp, constrain)
    elif ch == "*":
        y = attention_block(h, p["w_qkv"], p["w_o"], positions_BT, segment_ids_BT,
                            rope_theta=cfg.rope_theta if cfg.rope else None, implementation=attn_impl, lp=lp,
                            max_segments=cfg.attention_max_segments, runs_per_row=runs_per_row)
    else:
        y = mlp_block(h, p["w_up"], p["w_down"], lp, kind=cfg.mlp, smooth=cfg.smooth_swiglu)
    return x_BTD + y.astype(x_BTD.dtype)


def forward(params: Params, inputs_BT: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
            *, cfg: ModelConfig, policy: PrecisionPolicy, scales: dict | None = None,
            key: jax.Array | None = None, remat: str = "none", scan_layers: bool = True,
            constrain=lambda x, axes: x, logits: bool = True, runs_per_row: int | None = None) -> jax.Array:
    x_BTD = jnp.take(params["embed"], inputs_BT, axis=0).astype(ACT_DTYPE)
    return forward_embedded(params, x_BTD, positions_BT, segment_ids_BT, cfg=cfg, policy=policy,
                            scales=scales, key=key, remat=remat, scan_layers=scan_layers, constrain=constrain,
                            logits=logits, runs_per_row=runs_per_row)


def forward_embedded(params: Params, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
                     *, cfg: ModelConfig, policy: PrecisionPolicy, scales: dict | None = None,
                     key: jax.Array | None = None, remat: str = "none", scan_layers: bool = True,
                     constrain=lambda x, axes: x, logits: bool = True, runs_per_row: int | None = None) -> jax.Array:
    attn_impl = resolve_implementation(cfg.attention)
    scales = scales or {}
    block_scales = scales.get("blocks", {})
    key = jax.random.key(0) if key is None else key
    x_BTD = constrain(x_BTD, ("batch", "seq", "embed"))
    offsets = {t: 0 for t in TYPES.values()}
    for start, unit, reps in scan_groups(cfg.pattern, policy.block_table):
        u = len(unit)
        xs: dict[str, Any] = {}
        for t in set(TYPES[c] for c in unit):
            per_unit = sum(TYPES[c] == t for c in unit)
            lo = offsets[t]
            xs[t] = jax.tree.map(lambda a: a[lo:lo + reps * per_unit].reshape(reps, per_unit, *a.shape[1:]),
                                 params[t])
            offsets[t] += reps * per_unit
        xs["scales"] = {c: s[start:start + reps * u].reshape(reps, u, *s.shape[1:]) for c, s in block_scales.items()}
        xs["keys"] = jax.random.split(jax.random.fold_in(key, start), reps)

        def body(x, xs, start=start, unit=unit):
            seen = {t: 0 for t in TYPES.values()}
            for j, ch in enumerate(unit):
                t = TYPES[ch]
                p = jax.tree.map(lambda a: a[seen[t]], xs[t])
                seen[t] += 1
                lp = LayerPrecision(policy, start + j, {c: s[j] for c, s in xs["scales"].items()},
                                    jax.random.fold_in(xs["keys"], j))
                x = constrain(_block(ch, x, p, positions_BT, segment_ids_BT, cfg, lp, attn_impl, constrain,
                                     runs_per_row),
                              ("batch", "seq", "embed"))
            return x, None

        body = remat_body(body, remat, scanned=scan_layers)
        x_BTD = run_layers(body, x_BTD, xs, reps, scan=scan_layers)
    if not logits:  # the last block's output, for a loss that applies the head itself
        return x_BTD
    return output_logits(params, x_BTD, cfg=cfg, policy=policy, scales=scales, key=key, constrain=constrain)
