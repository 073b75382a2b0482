"""Llama-style decoder: embed -> scanned blocks (RMSNorm, GQA attention with RoPE, RMSNorm,
SwiGLU) -> RMSNorm -> untied LM head, as Flax NNX modules.

Parameters are FP32 master weights. Block weights are stacked on a leading L axis; the forward
pass scans each run of consecutive blocks that share a precision recipe
(:meth:`PrecisionPolicy.block_groups`), so compile time does not grow with depth and the layout
of the parameters does not depend on the precision policy.

Dimension letters: B batch, T sequence, D d_model, N query heads, K kv heads, G = N/K, H head
dim, F MLP hidden, V vocabulary, L blocks.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from flax import nnx

from maxfp4.config import ModelConfig
from maxfp4.parallel.mesh import constrain, residual_axes
from maxfp4.model import lm
from maxfp4.model.attention import Attention, resolve_implementation
from maxfp4.model.layers import norm_scale, stacked
from maxfp4.model.layer_loop import run_layers, skippable
from maxfp4.model.mlp import MLP
from maxfp4.model.remat import remat_body
from maxfp4.precision import LayerPrecision, PrecisionPolicy, class_keys

Params = dict[str, Any]

class DecoderBlock(Attention, MLP):
    """RMSNorm -> attention -> residual, RMSNorm -> SwiGLU -> residual. The block is both mixers
    (it inherits their weights) rather than holding them, so its parameters keep their flat
    names beside the norms: ``attn_norm w_qkv w_o mlp_norm w_up w_down``.

    Residual-branch outputs (w_o, w_down) start smaller by 1/sqrt(2L) so the residual stream's
    variance does not grow with depth (GPT-2 practice)."""

    def __init__(self, cfg: ModelConfig, keys: jax.Array, n: int | None):
        """``keys``: four keys (w_qkv, w_o, w_up, w_down); ``n`` blocks stacked (None: one)."""
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        Attention.__init__(self, cfg, keys[0], keys[1], n, std=std, out_std=out_std)
        MLP.__init__(self, cfg, keys[2], keys[3], n, std=std, out_std=out_std)
        self.attn_norm = norm_scale(*stacked(n, (cfg.d_model,), ("norm",)))
        self.mlp_norm = norm_scale(*stacked(n, (cfg.d_model,), ("norm",)))
        self.cfg = cfg

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
                 lp: LayerPrecision, attn_impl: str, runs_per_row: int | None) -> jax.Array:
        cfg = self.cfg
        h = self.attn_norm(x_BTD, cfg.norm_eps)
        x_BTD = x_BTD + Attention.__call__(
            self, h, positions_BT, segment_ids_BT, lp, rope_theta=cfg.rope_theta, implementation=attn_impl,
            max_segments=cfg.attention_max_segments, runs_per_row=runs_per_row)
        h = self.mlp_norm(x_BTD, cfg.norm_eps)
        return x_BTD + MLP.__call__(self, h, lp, smooth=cfg.smooth_swiglu)


class DenseLM(lm.LanguageModel):
    """``embed``, ``blocks`` (a :class:`DecoderBlock` of L stacked blocks), ``final_norm``,
    ``lm_head``; ``key`` initialises them exactly as the parameter pytree always was."""

    def __init__(self, cfg: ModelConfig, key: jax.Array):
        keys = jax.random.split(key, 6)
        super().__init__(cfg, keys[0], keys[5])
        self.blocks = DecoderBlock(cfg, keys[1:5], cfg.n_layers)

    def from_embedded(self, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
                      *, policy: PrecisionPolicy, scales: dict | None = None, key: jax.Array | None = None,
                      remat: str = "none", scan_layers: bool = True,
                      logits: bool = True, runs_per_row: int | None = None,
                      active_L: jax.Array | None = None, sequence_parallel: bool = False) -> jax.Array:
        """The model after the embedding lookup. ``scales``: the delayed-scaling scales
        (:func:`maxfp4.precision.state.scales_of`); ``key`` seeds stochastic rounding;
        activations are pinned to their logical axes under the mesh the step is traced in
        (:func:`maxfp4.parallel.mesh.constrain`); ``runs_per_row``: a bound on
        the segment runs of every row, when the data gives one
        (:func:`maxfp4.model.attention.attend`). ``logits=False`` returns the last block's
        output [B, T, D] instead of the logits [B, T, V]. ``active_L`` (bool [L], traced): the
        blocks to run, the others pass their input through (a pipeline stage's empty slots,
        :mod:`maxfp4.parallel.pipeline_stages`). ``sequence_parallel``: the residual stream
        between blocks split over tensor along the sequence (mesh.sequence_parallel)."""
        cfg = self.cfg
        attn_impl = resolve_implementation(cfg.attention)
        scales = scales or {}
        key = jax.random.key(0) if key is None else key
        x_BTD = constrain(x_BTD, residual_axes(sequence_parallel))
        # The scan runs over the stack's arrays; each step merges its slice into one block.
        block_def, blocks = nnx.split(self.blocks)
        blocks = nnx.to_pure_dict(blocks)
        for start, end in policy.block_groups():
            # One scan per run of blocks with identical recipes: the recipe is static inside it.
            whole = (start, end) == (0, cfg.n_layers)
            group = blocks if whole else jax.tree.map(lambda a: a[start:end], blocks)
            group_scales = scales.get("blocks", {})
            if not whole:
                group_scales = jax.tree.map(lambda a: a[start:end], group_scales)
            group_keys = jax.random.split(jax.random.fold_in(key, start), end - start)
            keys = (group_keys, class_keys(group_keys))
            xs = (group, group_scales, keys) + (() if active_L is None else (active_L[start:end],))

            def body(x, xs, start=start):
                p, s, (k, k_classes) = xs[:3]
                lp = LayerPrecision(policy, start, s, k, k_classes)

                def block(x):
                    y = nnx.merge(block_def, p)(x, positions_BT, segment_ids_BT, lp, attn_impl, runs_per_row)
                    return constrain(y, residual_axes(sequence_parallel))

                return (block(x) if active_L is None else skippable(block, xs[3], x)), None

            body = remat_body(body, remat, scanned=scan_layers)
            x_BTD = run_layers(body, x_BTD, xs, end - start, scan=scan_layers)
        if not logits:  # the last block's output, for a loss that applies the head itself
            return x_BTD
        return self.logits(x_BTD, policy=policy, scales=scales, key=key)


def init_params(cfg: ModelConfig, key: jax.Array) -> Params:
    """FP32 master weights as a pure pytree: :class:`DenseLM`'s state."""
    return lm.init_params(DenseLM, cfg, key)


def param_axes(cfg: ModelConfig) -> Params:
    """Logical axis names of every parameter (from the modules' metadata); maxfp4.parallel.mesh maps them."""
    return lm.param_axes(DenseLM, cfg)


def forward(params: Params, inputs_BT: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
            *, cfg: ModelConfig, **options) -> jax.Array:
    """Logits [B, T, V] in BF16 from the parameter pytree (options: :meth:`DenseLM.from_embedded`)."""
    return lm.apply(DenseLM, params, cfg)(inputs_BT, positions_BT, segment_ids_BT, **options)


def forward_embedded(params: Params, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
                     *, cfg: ModelConfig, **options) -> jax.Array:
    """The model after the embedding lookup (separate so tests can differentiate by position)."""
    return lm.apply(DenseLM, params, cfg).from_embedded(x_BTD, positions_BT, segment_ids_BT, **options)
