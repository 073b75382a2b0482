"""Mixture-of-experts block: an FP32 router picks top_k of X experts per token; the experts run
as grouped GEMMs over the tokens sorted by expert; optional shared experts see every token.

Routing (DeepSeek-V3 / Nemotron 3 with ``model.moe.score=sigmoid``, Mixtral / Qwen3-MoE with
softmax): scores from the router's logits, the top_k of ``scores + bias`` chosen (the bias of
aux-loss-free balancing moves the choice only), the chosen scores normalised to sum to 1 as the
combine weights. Dropless unless ``model.moe.capacity_factor`` is set: then each expert takes at
most ``ceil(factor x tokens x top_k / X)`` assignments, first come first served in token order,
and the rest are dropped (weight 0) and counted. The choice is made over all tokens of the
batch, so it is the same whatever the mesh; :mod:`maxfp4.parallel.expert` then runs the experts
on each device's tokens, exchanging them over ``mesh.expert`` when the experts are split.

Dimension letters: B batch, T sequence, D d_model, F expert hidden, X experts, N tokens (B x T),
k top_k, S statistics (X + 3), M token-expert rows sorted by expert, G experts on a device.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from maxfp4.config import ModelConfig
from maxfp4.kernels import grouped_gemm
from maxfp4.model.activations import relu2, swiglu_product
from maxfp4.model.layers import ACT_DTYPE, linear, mlp_block
from maxfp4.model.router_state import AUX_WEIGHT, BIAS, PROBE
from maxfp4.model_spec import mixer_linears
from maxfp4.parallel.expert import run_experts
from maxfp4.parallel.mesh import tensor_ranks
from maxfp4.precision import LayerPrecision
from maxfp4.precision.recipes import flat, unflat


class MoE(nnx.Module):
    """``router`` [D, X], ``w_up`` [X, D, F, gates], ``w_down`` [X, F, D] and, with shared
    experts, ``shared_up`` / ``shared_down`` (an MLP of width shared_experts x F); ``n`` of each
    stacked on a leading axis (None: one block)."""

    def __init__(self, cfg: ModelConfig, key: jax.Array, n: int | None, *, std: float, out_std: float):
        specs = {s.name: s for s in mixer_linears(cfg, "moe")}
        keys = jax.random.split(key, 5)
        self.router = linear(keys[0], specs["router"], n, std=std)
        self.w_up = linear(keys[1], specs["w_up"], n, std=std)
        self.w_down = linear(keys[2], specs["w_down"], n, std=out_std)
        if cfg.moe.shared_experts:
            self.shared_up = linear(keys[3], specs["shared_up"], n, std=std)
            self.shared_down = linear(keys[4], specs["shared_down"], n, std=out_std)
        self.cfg = cfg

    def __call__(self, x_BTD: jax.Array, lp: LayerPrecision) -> jax.Array:
        weights = {name: getattr(self, name)[...] for name in WEIGHTS if hasattr(self, name)}
        return apply_moe(weights, x_BTD, lp, self.cfg)


WEIGHTS = ("router", "w_up", "w_down", "shared_up", "shared_down")


def apply_moe(weights: dict[str, jax.Array], x_BTD: jax.Array, lp: LayerPrecision, cfg: ModelConfig) -> jax.Array:
    """The block's output from its weights (:data:`WEIGHTS`, one block's slices): what the module
    computes, and what one-token decoding (maxfp4.interop.decode) calls on the parameter pytree.
    ``lp.scales`` may carry the router's bias and statistics probe (maxfp4.model.router_state)."""
    moe = cfg.moe
    b, t, d = x_BTD.shape
    # The tokens as rows, a context rank's contiguous (maxfp4.precision.recipes.flat): each rank
    # routes and runs its own tokens. The capacity's first-come order stays the batch's.
    x_ND = flat(x_BTD)
    scales = lp.scales or {}
    logits_NX = lp.dot(x_ND, weights["router"], "router")
    route = choose_experts(logits_NX, scales.get(BIAS), moe.top_k, moe.score, moe.capacity_factor,
                           token_order=(lambda a: unflat(a, (b, t)).reshape(b * t, -1),
                                        lambda a: flat(a.reshape(b, t, -1))))
    gemm = grouped_gemm_kernels(cfg)
    y_ND = run_experts(x_ND, route.experts_Nk, route.weights_Nk, weights["w_up"], weights["w_down"], lp,
                       partial(expert_ffn, gemm=gemm), cfg.mlp, slack=moe.exchange_slack,
                       expert_tensor=moe.expert_tensor_parallel)
    if moe.shared_experts:
        y_ND = y_ND + mlp_block(x_ND[None], weights["shared_up"], weights["shared_down"], lp, kind=cfg.mlp)[0]
    if PROBE in scales:
        y_ND = report(y_ND, scales[PROBE], route.stats_S, route.aux_loss,
                      scales.get(AUX_WEIGHT, jnp.zeros((), jnp.float32)))
    return unflat(y_ND.astype(ACT_DTYPE), (b, t))


def grouped_gemm_kernels(cfg: ModelConfig) -> str:
    """``model.moe.grouped_gemm`` resolved: ``auto`` takes the Mosaic GPU kernels on a Hopper GPU
    when the expert shapes tile (maxfp4.kernels.grouped_gemm), XLA's ragged_dot elsewhere; a
    forced ``mosaic`` was checked at start-up (maxfp4.kernels.support.check_grouped_gemm)."""
    if cfg.moe.grouped_gemm != "auto":
        return cfg.moe.grouped_gemm
    return "mosaic" if grouped_gemm.experts_tile(cfg, tensor_ranks()) and grouped_gemm.available() else "xla"


class Routing(NamedTuple):
    """The router's decision for N tokens: each token's top_k experts (X: dropped), their
    combine weights (0 where dropped), the statistics and the load-balancing loss."""

    experts_Nk: jax.Array
    weights_Nk: jax.Array
    stats_S: jax.Array
    aux_loss: jax.Array


def choose_experts(logits_NX: jax.Array, bias_X: jax.Array | None, top_k: int, score: str,
                   capacity_factor: float, token_order: tuple[Callable, Callable] | None = None) -> Routing:
    """Top-k routing in FP32 (module docstring). The load-balancing loss is Switch's
    ``X * sum_e f_e P_e`` (f_e: share of assignments to e, no gradient; P_e: mean normalised
    score of e), the form Megatron and DeepSeek use. ``token_order``: (rows -> the batch's token
    order, and back) for [N, k] arrays, where the rows are in another order (a context split's):
    the capacity serves the tokens in the batch's order whatever the mesh."""
    logits_NX = logits_NX.astype(jnp.float32)
    n, x = logits_NX.shape
    scores_NX = jax.nn.sigmoid(logits_NX) if score == "sigmoid" else jax.nn.softmax(logits_NX, axis=-1)
    pick_NX = jax.lax.stop_gradient(scores_NX) + (0.0 if bias_X is None else bias_X)
    _, experts_Nk = jax.lax.top_k(pick_NX, top_k)
    chosen_Nk = jnp.take_along_axis(scores_NX, experts_Nk, axis=-1)
    weights_Nk = chosen_Nk / jnp.maximum(jnp.sum(chosen_Nk, axis=-1, keepdims=True), 1e-20)
    keep_Nk = jnp.ones(experts_Nk.shape, bool)
    if capacity_factor:
        capacity = math.ceil(capacity_factor * n * top_k / x)
        to_tokens, to_rows = token_order or (lambda a: a, lambda a: a)
        onehot_AX = jax.nn.one_hot(to_tokens(experts_Nk).reshape(-1), x, dtype=jnp.int32)
        position_A = jnp.sum((jnp.cumsum(onehot_AX, axis=0) - 1) * onehot_AX, axis=-1)
        keep_Nk = to_rows((position_A < capacity).reshape(experts_Nk.shape))
    experts_Nk = jnp.where(keep_Nk, experts_Nk, x)
    weights_Nk = jnp.where(keep_Nk, weights_Nk, 0.0)
    counts_X = jnp.sum(jax.nn.one_hot(experts_Nk.reshape(-1), x, dtype=jnp.float32), axis=0)
    share_X = jax.lax.stop_gradient(counts_X) / (n * top_k)
    prob_X = jnp.mean(scores_NX / jnp.sum(scores_NX, axis=-1, keepdims=True), axis=0)
    aux_loss = x * jnp.sum(share_X * prob_X)
    dropped = jnp.sum(~keep_Nk).astype(jnp.float32)
    stats_S = jnp.concatenate([counts_X, jnp.stack([dropped, jax.lax.stop_gradient(aux_loss), jnp.float32(n)])])
    return Routing(experts_Nk, weights_Nk, stats_S, aux_loss)


def expert_ffn(sorted_MD: jax.Array, sizes_G: jax.Array, w_up_GDFg: jax.Array, w_down_GFD: jax.Array,
               lp: LayerPrecision, kind: str, gemm: str = "xla") -> jax.Array:
    """Rows sorted by expert (``sizes_G`` of them for each of the G experts here, in order; rows
    past the groups are skipped, whatever their output) through their expert's MLP: two grouped
    GEMMs with the activation between. maxfp4.parallel.expert sorts them and puts them back."""
    g, d = w_up_GDFg.shape[:2]
    h_MK = lp.grouped_dot(sorted_MD.astype(ACT_DTYPE), w_up_GDFg.reshape(g, d, -1), sizes_G, "expert_up", gemm)
    if kind == "swiglu":
        a_MF = swiglu_product(h_MK.reshape(h_MK.shape[0], -1, 2))
    else:
        a_MF = relu2(h_MK)
    return lp.grouped_dot(a_MF.astype(ACT_DTYPE), w_down_GFD, sizes_G, "expert_down", gemm)


@jax.custom_vjp
def report(y_ND, probe_S, stats_S, aux_loss, aux_weight):
    """``y`` unchanged; its backward pass hands ``stats_S`` out as ``probe_S``'s cotangent and
    gives ``aux_loss`` the gradient ``aux_weight``: the load-balancing loss joins the training
    loss without the model returning it (Megatron's MoEAuxLossAutoScaler does the same)."""
    return y_ND


def _report_fwd(y_ND, probe_S, stats_S, aux_loss, aux_weight):
    return y_ND, (stats_S, aux_weight)


def _report_bwd(res, dy_ND):
    stats_S, aux_weight = res
    return dy_ND, stats_S, jnp.zeros_like(stats_S), aux_weight.astype(jnp.float32), jnp.zeros_like(aux_weight)


report.defvjp(_report_fwd, _report_bwd)
