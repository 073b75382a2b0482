"""Hybrid Mamba-2 / attention / MLP / mixture-of-experts stack (Nemotron-H and Nemotron 3 style)
from a one-character-a-block pattern: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` mixture of
experts; each block is RMSNorm -> mixer -> residual.

Parameters are stacked per block type ([n_type, ...]), so their layout depends only on the
pattern. The forward pass covers the pattern with as few scans as it can: a scan repeats a unit
of up to four blocks (``"M-"``, ``"M*-"`` ...) whose blocks also repeat their precision recipes,
so a 52-block Nemotron-H pattern compiles a handful of scan bodies, not 52 blocks. Blocks are
Flax NNX modules (``MambaBlock``, ``AttentionBlock``, ``MLPBlock``): each is its mixer with a
pre-norm, its parameters named ``pre_norm`` beside the mixer's.

Dimension letters: B batch, T sequence, D d_model, V vocabulary.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import jax
from flax import nnx

from maxfp4.config import ModelConfig
from maxfp4.model_spec import PATTERN_CHARS
from maxfp4.parallel.mesh import constrain, residual_axes
from maxfp4.model import lm
from maxfp4.model.attention import Attention, resolve_implementation
from maxfp4.model.layers import norm_scale, stacked
from maxfp4.model.layer_loop import run_layers, skippable
from maxfp4.model.mamba import Mamba2Mixer
from maxfp4.model.mlp import MLP
from maxfp4.model.moe import MoE
from maxfp4.model.remat import remat_body
from maxfp4.precision import LayerPrecision, PrecisionPolicy, class_keys, fold_in_each

Params = dict[str, Any]
TYPES = PATTERN_CHARS  # model.pattern's characters -> block types
MAX_UNIT = 4


def _counts(pattern: str) -> dict[str, int]:
    return {t: sum(TYPES[c] == t for c in pattern) for t in TYPES.values()}


class MambaBlock(Mamba2Mixer):
    """RMSNorm -> Mamba-2 mixer -> residual."""

    def __init__(self, cfg: ModelConfig, key: jax.Array, n: int | None):
        super().__init__(cfg, key, n)
        self.pre_norm = norm_scale(*stacked(n, (cfg.d_model,), ("norm",)))

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, lp: LayerPrecision, attn_impl: str,
                 runs_per_row: int | None):
        y = super().__call__(self.pre_norm(x_BTD, self.cfg.norm_eps), segment_ids_BT, lp)
        return x_BTD + y.astype(x_BTD.dtype)


class AttentionBlock(Attention):
    """RMSNorm -> attention (RoPE when ``model.rope``) -> residual."""

    def __init__(self, cfg: ModelConfig, key_qkv: jax.Array, key_o: jax.Array, n: int | None):
        super().__init__(cfg, key_qkv, key_o, n, std=cfg.init_std, out_std=_out_std(cfg))
        self.pre_norm = norm_scale(*stacked(n, (cfg.d_model,), ("norm",)))
        self.cfg = cfg

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, lp: LayerPrecision, attn_impl: str,
                 runs_per_row: int | None):
        cfg = self.cfg
        y = super().__call__(self.pre_norm(x_BTD, cfg.norm_eps), positions_BT, segment_ids_BT, lp,
                             rope_theta=cfg.rope_theta if cfg.rope else None, implementation=attn_impl,
                             max_segments=cfg.attention_max_segments, runs_per_row=runs_per_row)
        return x_BTD + y.astype(x_BTD.dtype)


class MLPBlock(MLP):
    """RMSNorm -> MLP (``model.mlp``: swiglu or relu2) -> residual."""

    def __init__(self, cfg: ModelConfig, key_up: jax.Array, key_down: jax.Array, n: int | None):
        super().__init__(cfg, key_up, key_down, n, std=cfg.init_std, out_std=_out_std(cfg))
        self.pre_norm = norm_scale(*stacked(n, (cfg.d_model,), ("norm",)))
        self.cfg = cfg

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, lp: LayerPrecision, attn_impl: str,
                 runs_per_row: int | None):
        cfg = self.cfg
        y = super().__call__(self.pre_norm(x_BTD, cfg.norm_eps), lp, kind=cfg.mlp, smooth=cfg.smooth_swiglu)
        return x_BTD + y.astype(x_BTD.dtype)


class MoEBlock(MoE):
    """RMSNorm -> mixture of experts (maxfp4.model.moe) -> residual."""

    def __init__(self, cfg: ModelConfig, key: jax.Array, n: int | None):
        super().__init__(cfg, key, n, std=cfg.init_std, out_std=_out_std(cfg))
        self.pre_norm = norm_scale(*stacked(n, (cfg.d_model,), ("norm",)))

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, lp: LayerPrecision, attn_impl: str,
                 runs_per_row: int | None):
        y = super().__call__(self.pre_norm(x_BTD, self.cfg.norm_eps), lp)
        return x_BTD + y.astype(x_BTD.dtype)


def _out_std(cfg: ModelConfig) -> float:
    """Residual-branch outputs start smaller by 1/sqrt(2L) (GPT-2 practice)."""
    return cfg.init_std / math.sqrt(2 * cfg.n_layers)


class HybridLM(lm.LanguageModel):
    """``embed``, one stack per block type present in the pattern (``mamba``, ``attention``,
    ``mlp``: [n_type, ...] each), ``final_norm``, ``lm_head``; ``key`` initialises them exactly as
    the parameter pytree always was."""

    def __init__(self, cfg: ModelConfig, key: jax.Array):
        counts = _counts(cfg.pattern)
        keys = jax.random.split(key, 8)
        super().__init__(cfg, keys[0], keys[1])
        if counts["mamba"]:
            self.mamba = MambaBlock(cfg, keys[2], counts["mamba"])
        if counts["attention"]:
            self.attention = AttentionBlock(cfg, keys[3], keys[4], counts["attention"])
        if counts["mlp"]:
            self.mlp = MLPBlock(cfg, keys[5], keys[6], counts["mlp"])
        if counts["moe"]:
            self.moe = MoEBlock(cfg, keys[7], counts["moe"])

    def from_embedded(self, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
                      *, policy: PrecisionPolicy, scales: dict | None = None, key: jax.Array | None = None,
                      remat: str = "none", scan_layers: bool = True,
                      logits: bool = True, runs_per_row: int | None = None,
                      active_L: jax.Array | None = None, sequence_parallel: bool = False) -> jax.Array:
        """As :meth:`maxfp4.model.decoder.DenseLM.from_embedded`."""
        cfg = self.cfg
        attn_impl = resolve_implementation(cfg.attention)
        scales = scales or {}
        block_scales = scales.get("blocks", {})
        key = jax.random.key(0) if key is None else key
        x_BTD = constrain(x_BTD, residual_axes(sequence_parallel))
        # Each scan runs over slices of the stacks' arrays; each block merges its slice into a module.
        defs, stacks = {}, {}
        for t in TYPES.values():
            if hasattr(self, t):
                defs[t], state = nnx.split(getattr(self, t))
                stacks[t] = nnx.to_pure_dict(state)
        offsets = {t: 0 for t in TYPES.values()}
        for start, unit, reps in scan_groups(cfg.pattern, policy.recipe_rows):
            u = len(unit)
            xs: dict[str, Any] = {}
            # In the unit's order: a set's order follows the process's string hash seed, and so
            # did the traced program's, so processes and restarts lowered different programs.
            for t in dict.fromkeys(TYPES[c] for c in unit):
                per_unit = sum(TYPES[c] == t for c in unit)
                lo = offsets[t]
                xs[t] = jax.tree.map(lambda a: a[lo:lo + reps * per_unit].reshape(reps, per_unit, *a.shape[1:]),
                                     stacks[t])
                offsets[t] += reps * per_unit
            xs["scales"] = {c: s[start:start + reps * u].reshape(reps, u, *s.shape[1:])
                            for c, s in block_scales.items()}
            rep_keys = jax.random.split(jax.random.fold_in(key, start), reps)
            block_keys = fold_in_each(rep_keys, u)  # [reps, u]: fold_in(rep key, j)
            xs["keys"] = (block_keys, class_keys(block_keys))
            if active_L is not None:
                xs["active"] = active_L[start:start + reps * u].reshape(reps, u)

            def body(x, xs, start=start, unit=unit):
                seen = {t: 0 for t in TYPES.values()}
                for j, ch in enumerate(unit):
                    t = TYPES[ch]
                    weights = jax.tree.map(lambda a: a[seen[t]], xs[t])
                    seen[t] += 1
                    lp = LayerPrecision(policy, start + j, {c: s[j] for c, s in xs["scales"].items()},
                                        xs["keys"][0][j], xs["keys"][1][j])

                    def block(x, t=t, weights=weights, lp=lp):
                        y = nnx.merge(defs[t], weights)(x, positions_BT, segment_ids_BT, lp, attn_impl, runs_per_row)
                        return constrain(y, residual_axes(sequence_parallel))

                    x = block(x) if active_L is None else skippable(block, xs["active"][j], x)
                return x, None

            body = remat_body(body, remat, scanned=scan_layers)
            x_BTD = run_layers(body, x_BTD, xs, reps, scan=scan_layers)
        if not logits:  # the last block's output, for a loss that applies the head itself
            return x_BTD
        return self.logits(x_BTD, policy=policy, scales=scales, key=key)


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """FP32 master weights as a pure pytree: :class:`HybridLM`'s state."""
    return lm.init_params(HybridLM, cfg, key)


def param_axes(cfg: ModelConfig) -> Params:
    """Logical axis names of every parameter (from the modules' metadata); maxfp4.parallel.mesh maps them."""
    return lm.param_axes(HybridLM, cfg)


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


def forward(params: Params, inputs_BT: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
            *, cfg: ModelConfig, **options) -> jax.Array:
    """Logits [B, T, V] in BF16 from the parameter pytree (options: :meth:`HybridLM.from_embedded`)."""
    return lm.apply(HybridLM, params, cfg)(inputs_BT, positions_BT, segment_ids_BT, **options)


def forward_embedded(params: Params, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
                     *, cfg: ModelConfig, **options) -> jax.Array:
    """The model after the embedding lookup (separate so tests can differentiate by position)."""
    return lm.apply(HybridLM, params, cfg).from_embedded(x_BTD, positions_BT, segment_ids_BT, **options)
