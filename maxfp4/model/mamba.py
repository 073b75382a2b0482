"""Mamba-2 mixer (arXiv 2405.21060): in_proj -> causal depthwise conv on (x, B, C) -> SiLU ->
SSD with per-head scalar decay -> D skip -> gated RMSNorm per group -> out_proj.

Only ``in_proj`` (class ``mamba_in``) and ``out_proj`` (``mamba_out``) go through the precision
policy; the convolution, the SSD (A, dt, decays, states) and the norm compute in FP32 and store
their inputs and outputs (and those gradients) in BF16 between steps. The
convolution, the SSD with the D skip, and the gated norm run as Pallas kernels
(``maxfp4.kernels``: ``conv``, ``ssd``, ``gated_norm``) or in XLA (``causal_conv`` and ``gated_group_norm`` here,
the chunked form of ``ssd``), by ``model.mamba.kernels``.

Dimension letters: B batch, T sequence, D d_model, E inner width (expand x D), H Mamba heads,
P head dim (E = H x P), G groups, N state size, W conv kernel width, I in_proj's columns; the
stored in_proj is [D, G, I/G] (``maxfp4.model.mamba_layout``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from maxfp4.config import ModelConfig
from maxfp4.parallel.mesh import constrain, per_batch_row, per_row_and_tensor_rank, splits_batch, tensor_ranks
from maxfp4.model.layers import ACT_DTYPE, Linear, normal_init, param
from maxfp4.model.mamba_layout import columns as in_proj_columns, grouped as in_proj_grouped, in_proj_parts
from maxfp4.model.ssd import chunk_exit, entry_output, pass_states, ssd_chunked
from maxfp4.kernels.ssd_ops import segment_starts
from maxfp4.parallel.context import context_ranks, from_previous_chunk, gather_chunks, own_chunks, per_context_rank
from maxfp4.model_spec import mamba_dims as dims, mamba_splits_over_tensor as splits_over_tensor, mixer_linears
from maxfp4.kernels import conv as conv_kernel
from maxfp4.kernels import gated_norm as gated_norm_kernel
from maxfp4.kernels import conv_mosaic, gated_norm_mosaic, ssd_mosaic
from maxfp4.kernels.conv import causal_conv_silu, conv_kernel_supported
from maxfp4.kernels.gated_norm import gated_norm_fused, gated_norm_supported
from maxfp4.kernels.ssd import kernel_supported, ssd_fused
from maxfp4.kernels.epilogue import Quantize, quantize_rounded
from maxfp4.kernels.launch import kernels_on_gpu, on_gpu
from maxfp4.precision import GEMM_OUT, LayerPrecision

Params = dict[str, Any]

# The mixer's parameters in pytree order; in_proj and out_proj are its linear layers
# (maxfp4.model_spec: their classes, shapes and axes), the rest its own.
MAMBA_AXES = {
    "in_proj": None,
    "conv_w": (None, None),
    "conv_b": (None,),
    "A_log": (None,),
    "D_skip": (None,),
    "dt_bias": (None,),
    "norm": ("norm",),
    "out_proj": None,
}


def init_mamba(cfg: ModelConfig, key: jax.Array, n: int | None) -> Params:
    """``n`` stacked mixers' arrays (None: one mixer's). dt starts log-uniform in [1e-3, 1e-1]
    (through the inverse of softplus in dt_bias) and A uniform in [1, 16], as in the Mamba-2 paper."""
    d = dims(cfg)
    _, out_proj = mixer_linears(cfg, "mamba")
    lead = () if n is None else (n,)
    k = jax.random.split(key, 5)
    dt = jnp.exp(jax.random.uniform(k[2], (*lead, d["H"]), minval=math.log(1e-3), maxval=math.log(1e-1)))
    return {
        # Drawn as the former [D, I] layout was and stored group by group: the same model as then.
        "in_proj": in_proj_grouped(normal_init(k[0], (*lead, cfg.d_model, d["in"]), cfg.init_std),
                                   in_proj_parts(cfg), d["G"]),
        "conv_w": normal_init(k[1], (*lead, d["W"], d["conv"]), 1.0 / math.sqrt(d["W"])),
        "conv_b": jnp.zeros((*lead, d["conv"]), jnp.float32),
        "A_log": jnp.log(jax.random.uniform(k[3], (*lead, d["H"]), minval=1.0, maxval=16.0)),
        "D_skip": jnp.ones((*lead, d["H"]), jnp.float32),
        "dt_bias": dt + jnp.log(-jnp.expm1(-dt)),  # softplus^-1(dt)
        "norm": jnp.ones((*lead, d["E"]), jnp.float32),
        "out_proj": normal_init(k[4], (*lead, *out_proj.shape), cfg.init_std / math.sqrt(2 * cfg.n_layers)),
    }


class Mamba2Mixer(nnx.Module):
    """The mixer's parameters (``MAMBA_AXES``), ``n`` of each stacked on a leading L axis (None:
    one mixer); ``in_proj`` and ``out_proj`` are the policy's ``mamba_in`` and ``mamba_out``."""

    def __init__(self, cfg: ModelConfig, key: jax.Array, n: int | None):
        lead = () if n is None else ("layers",)
        linears = {lin.name: lin for lin in mixer_linears(cfg, "mamba")}
        for name, value in init_mamba(cfg, key, n).items():
            if name in linears:
                setattr(self, name, param(value, lead + linears[name].axes, Linear, layer_class=linears[name].layer_class))
            else:
                setattr(self, name, param(value, lead + MAMBA_AXES[name]))
        self.cfg = cfg

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array, lp: LayerPrecision) -> jax.Array:
        # One function for the whole mixer: with FP8 hooks it fuses both GEMMs with the kernels.
        p = {name: getattr(self, name)[...] for name in MAMBA_AXES}
        return mamba_mixer(x_BTD, p, segment_ids_BT, self.cfg, lp)


def causal_conv(x_BTC: jax.Array, w_WC: jax.Array, b_C: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
    """Depthwise causal convolution that never reaches into an earlier document of a packed row."""
    width = w_WC.shape[0]
    out = x_BTC * w_WC[width - 1]
    for lag in range(1, width):
        shifted = jnp.pad(x_BTC, ((0, 0), (lag, 0), (0, 0)))[:, :-lag]
        same = jnp.pad(segment_ids_BT, ((0, 0), (lag, 0)), constant_values=-1)[:, :-lag] == segment_ids_BT
        out = out + jnp.where(same[..., None], shifted, 0.0) * w_WC[width - 1 - lag]
    return out + b_C


def gated_group_norm(y_BTE: jax.Array, z_BTE: jax.Array, scale_E: jax.Array, groups: int, eps: float) -> jax.Array:
    """RMSNorm of y * silu(z) within each of the G groups (Mamba-2's norm after gating)."""
    b, t, e = y_BTE.shape
    g = (y_BTE * jax.nn.silu(z_BTE)).reshape(b, t, groups, e // groups)
    g = g * jax.lax.rsqrt(jnp.mean(g * g, axis=-1, keepdims=True) + eps)
    return g.reshape(b, t, e) * scale_E


def use_ssd_kernel(cfg: ModelConfig) -> bool:
    """model.mamba.kernels resolved for the SSD: auto takes the Pallas kernel on GPU when it can
    tile the shapes (see ``kernel_supported``), XLA's chunked form otherwise."""
    mb = cfg.mamba
    if mb.kernels != "auto":
        return mb.kernels == "pallas"
    return kernels_on_gpu() and kernel_supported(mb.chunk_size, mb.head_dim, mb.d_state)


def use_conv_kernel(cfg: ModelConfig, t: int, channels: int) -> bool:
    """model.mamba.kernels resolved for the convolution of a length-t input: the kernel when
    asked for (pallas) or on GPU (auto), and only if it can tile t and the channels (the config
    check makes pallas tile the training length; another length falls back to XLA)."""
    if cfg.mamba.kernels == "xla" or not conv_kernel_supported(t, channels):
        return False
    return cfg.mamba.kernels == "pallas" or kernels_on_gpu()


def use_norm_kernel(cfg: ModelConfig, t: int, e: int) -> bool:
    """model.mamba.kernels resolved for the gated norm epilogue, as for the convolution."""
    if cfg.mamba.kernels == "xla" or not gated_norm_supported(t, e, cfg.mamba.n_groups):
        return False
    return cfg.mamba.kernels == "pallas" or kernels_on_gpu()


def mamba_mixer(x_BTD: jax.Array, p: Params, segment_ids_BT: jax.Array, cfg: ModelConfig,
                lp: LayerPrecision) -> jax.Array:
    """in_proj -> the per-row core (``_mixer_core``) -> out_proj. Under a mesh the core runs on
    each device's rows of the batch (``maxfp4.parallel.mesh.per_batch_row``): its kernels cannot be
    partitioned by XLA."""
    # Activations between the kernels are stored in BF16 (the GEMM's output dtype), as Mamba-2's
    # own kernels store them; each kernel computes in FP32 inside. FP32 storage doubled every
    # kernel's traffic and added converts: mamba2-1p3b 523 -> 451 ms a step on an H200 with
    # BF16 storage here and in the SSD (2026-11-25).
    core_params = {k: p[k] for k in ("conv_w", "conv_b", "A_log", "D_skip", "dt_bias", "norm")}
    t = tensor_ranks()
    if t > 1 and splits_over_tensor(cfg, t):
        return _tensor_parallel_mixer(x_BTD, p, core_params, segment_ids_BT, cfg, lp, t)
    w_in_DI = in_proj_columns(p["in_proj"], in_proj_parts(cfg))
    if _fp8_in_kernels(x_BTD, cfg, lp):
        return _fused_mixer(x_BTD, w_in_DI, lp.scales["mamba_in"], core_params, p["out_proj"],
                            lp.scales["mamba_out"], segment_ids_BT, cfg, lp.options("mamba_in"), lp.options("mamba_out"),
                            lp.fused("mamba_in"))
    zxbcdt_BTI = lp.dot(x_BTD, w_in_DI, "mamba_in")
    if context_ranks() > 1:
        y_BTE = per_context_rank(functools.partial(_context_core, cfg=cfg), (zxbcdt_BTI, segment_ids_BT),
                                 (core_params,))
    else:
        core = functools.partial(_mixer_core, cfg=cfg)
        y_BTE = per_batch_row(core, (zxbcdt_BTI, segment_ids_BT), (core_params,))
    return lp.dot(y_BTE.astype(ACT_DTYPE), p["out_proj"], "mamba_out")


# Tensor parallelism (Megatron's split of Mamba-2): tensor rank r holds heads [r H/t, (r+1) H/t)
# and, with them, groups [r G/t, (r+1) G/t) and the same blocks of z, x, B, C, dt, the
# convolution's channels and the norm. in_proj is stored group by group ([D, G, P], G split over
# tensor: maxfp4.model.mamba_layout), so rank r already holds its groups' columns; it orders them
# z, x, B, C, dt in place (nothing when it holds one group) and the GEMM's output is split over
# tensor: each rank gets the in_proj output of a mixer t times narrower, runs the core on it, and
# out_proj is row-parallel (its input split over tensor, its output summed). The layout does not
# depend on the mesh (checkpoints and exports neither). Without whole groups per rank
# (``splits_over_tensor``) in_proj stays whole on each tensor rank and the mixer runs whole there,
# as the mixer of a mesh without a tensor axis does.

def tensor_note(cfg: ModelConfig, t: int) -> str | None:
    """One line for start-up when a tensor axis of ``t`` leaves a model's Mamba-2 mixers whole."""
    if t == 1 or "M" not in (cfg.pattern or "") or splits_over_tensor(cfg, t):
        return None
    return (f"note: mesh.tensor={t} does not split the Mamba-2 mixers (model.mamba.n_groups="
            f"{cfg.mamba.n_groups} and model.d_model={cfg.d_model} must be multiples of {t}): each tensor "
            f"device runs their in_proj, convolution and SSD whole on its rows")


def _rank_config(cfg: ModelConfig, t: int) -> ModelConfig:
    """The mixer one of ``t`` tensor ranks runs: d_model (so E and H) and the groups divided by t."""
    return dataclasses.replace(cfg, d_model=cfg.d_model // t,
                               mamba=dataclasses.replace(cfg.mamba, n_groups=cfg.mamba.n_groups // t))


def _rank_core_params(p: Params, cfg: ModelConfig, t: int, r) -> Params:
    """Tensor rank ``r``'s block of the core's parameters (whole on every rank)."""
    d = dims(cfg)
    e, gn, h = d["E"], d["G"] * d["N"], d["H"]

    def block(x, start, n):  # rank r's n / t of the n entries from ``start`` on the last axis
        return jax.lax.dynamic_slice_in_dim(x, start + r * (n // t), n // t, axis=-1)

    def conv_channels(x):  # x, B and C's channels
        return jnp.concatenate([block(x, 0, e), block(x, e, gn), block(x, e + gn, gn)], axis=-1)

    return {"conv_w": conv_channels(p["conv_w"]), "conv_b": conv_channels(p["conv_b"]),
            "A_log": block(p["A_log"], 0, h), "D_skip": block(p["D_skip"], 0, h),
            "dt_bias": block(p["dt_bias"], 0, h), "norm": block(p["norm"], 0, e)}


def _tensor_parallel_mixer(x_BTD, p: Params, core_params: Params, segment_ids_BT, cfg: ModelConfig,
                           lp: LayerPrecision, t: int) -> jax.Array:
    # Pinned to in_proj's own split (fsdp rows, tensor columns), so each device reorders the
    # columns it holds and FSDP gathers rows for the GEMM as for any column-parallel weight.
    w_in_DI = constrain(in_proj_columns(p["in_proj"], in_proj_parts(cfg), t), ("embed", "ssm_groups"))
    zxbcdt_BTI = lp.dot(x_BTD, w_in_DI, "mamba_in")

    # Under a context split each rank's chunks, states passed between the ranks of the same
    # tensor rank (below), as without one.
    split_sequence = context_ranks() > 1
    rank_core = _context_core if split_sequence else _mixer_core

    def core(zxbcdt_local, segment_ids, params):
        rank = jax.lax.axis_index("tensor")
        return rank_core(zxbcdt_local, segment_ids, _rank_core_params(params, cfg, t, rank), cfg=_rank_config(cfg, t))

    if split_sequence:
        y_BTE = per_context_rank(core, (zxbcdt_BTI, segment_ids_BT), (core_params,), tensor=True)
    else:
        y_BTE = per_row_and_tensor_rank(core, (zxbcdt_BTI, segment_ids_BT), (core_params,))
    return lp.dot(y_BTE.astype(ACT_DTYPE), p["out_proj"], "mamba_out")


def _fp8_in_kernels(x_BTD: jax.Array, cfg: ModelConfig, lp: LayerPrecision) -> bool:
    """Whether the mixer runs as ``_fused_mixer``: in_proj and out_proj share a recipe that offers
    operand hooks (``LayerPrecision.fused``: FP8 delayed scaling), the core runs as the kernel core, and one device holds the whole batch (split over
    devices, the kernels run per device under ``per_batch_row``, and this fused form does not:
    it falls back to the recipes' own casts there, as with any other pair of recipes)."""
    ops = lp.fused("mamba_in")
    if not cfg.mamba.fp8_in_kernels or ops is None or lp.fused("mamba_out") != ops:
        return False
    if splits_batch(x_BTD.shape[0]) or context_ranks() > 1:
        return False
    d = dims(cfg)
    t = x_BTD.shape[1]
    return (use_conv_kernel(cfg, t, d["conv"]) and use_norm_kernel(cfg, t, d["E"])
            and conv_kernel.into_columns_supported(d["conv"], d["E"]))


def _ssd_kernels(cfg: ModelConfig) -> str:
    """``ssd_fused``'s forward and backward choice: triton, or auto (Mosaic GPU where it fits)."""
    return "triton" if cfg.mamba.kernel_backend == "triton" else "auto"


def _takes_mosaic(cfg: ModelConfig, tiles: bool, lowers) -> bool:
    """Whether a kernel's Mosaic GPU form runs instead of its Triton one, where it ``tiles`` the
    shapes: under ``model.mamba.kernel_backend=mosaic``, off a GPU under Mosaic GPU's
    interpreter (as the other kernels run interpreted there) and on a GPU where it is Hopper and
    ``lowers()`` (this jax lowers it there); under ``auto``, on such a GPU (off a GPU, as
    ``ssd_fused``'s auto, Triton's interpreted), except the convolution (``_conv_kernels``).
    Every Mosaic form measured faster than its Triton one on an H200 at mamba2-1p3b's shapes,
    each alone, and whole steps with them faster too, the last (the norm's backward) by ~0.3%
    (docs/PERFORMANCE.md, "Kernels on Mosaic GPU")."""
    backend = cfg.mamba.kernel_backend
    if not tiles or backend == "triton" or (backend == "auto" and not on_gpu()):
        return False
    return not on_gpu() or (ssd_mosaic.available() and lowers())


def _conv_kernels(cfg: ModelConfig, x_BTC: jax.Array, w_WC: jax.Array, b_C: jax.Array, fp8: bool = False) -> str:
    """The convolution's kernels for its input x [B, T, C]: "mosaic" (``maxfp4.kernels.conv_mosaic``)
    where ``_takes_mosaic``, else "triton". ``fp8``: the layer's input gradient is stored in FP8
    (the same for its forward and backward, which must take the same kernels).

    ``auto`` keeps the convolution on Triton on a GPU: in tests/test_gpu_pipeline.py's hybrid
    (d_model 256, two H200s) the one run whose fsdp=2 side took Mosaic's convolution, by these
    selection rules the only kernel it ran differently from the other runs, gave gradients ~10%
    from the pipelined side, which matched fsdp=2 on Triton's to 3.4e-3. Mosaic's matches
    Triton's at mamba2-1p3b's shapes on one GPU; tests/test_gpu_mamba_kernels.py compares the
    two at that hybrid's shapes and under ``shard_map`` to find where they part."""
    if cfg.mamba.kernel_backend == "auto" and on_gpu():
        return "triton"
    d = dims(cfg)
    (b, t, c), width = x_BTC.shape, w_WC.shape[0]
    tiles = conv_mosaic.supported(t, c) and d["E"] % conv_mosaic.COLUMNS == 0
    take = _takes_mosaic(cfg, tiles, lambda: conv_mosaic.lowers_at(b, t, c, width, x_BTC.dtype, w_WC.dtype,
                                                                   b_C.dtype, d["in"], d["E"], fp8))
    return "mosaic" if take else "triton"


def _norm_kernels(cfg: ModelConfig, u_BTE: jax.Array, zxbcdt_BTI: jax.Array, scale_E: jax.Array,
                  direction: str = "forward", fp8: bool = False):
    """The gated norm's kernel module for its operands and ``direction`` ("forward" or
    "backward"; the two take the same residuals), storing FP8 with ``fp8``:
    ``maxfp4.kernels.gated_norm_mosaic`` where ``_takes_mosaic``, else
    ``maxfp4.kernels.gated_norm`` (Triton)."""
    (b, t, e), groups, in_columns = u_BTE.shape, dims(cfg)["G"], zxbcdt_BTI.shape[-1]
    take = _takes_mosaic(cfg, gated_norm_mosaic.supported(t, e, groups, in_columns),
                         lambda: gated_norm_mosaic.lowers_at(b, t, e, groups, in_columns, u_BTE.dtype, scale_E.dtype,
                                                             direction, fp8))
    return gated_norm_mosaic if take else gated_norm_kernel


def _mixer_core(zxbcdt_BTI: jax.Array, segment_ids_BT: jax.Array, p: Params, *, cfg: ModelConfig) -> jax.Array:
    """conv -> SiLU -> SSD -> D skip -> gated norm, from the in_proj output to out_proj's input;
    each batch row on its own."""
    d = dims(cfg)
    t = zxbcdt_BTI.shape[1]
    if (use_conv_kernel(cfg, t, d["conv"]) and use_norm_kernel(cfg, t, d["E"])
            and conv_kernel.into_columns_supported(d["conv"], d["E"])):
        return _kernel_core(zxbcdt_BTI, segment_ids_BT, p, cfg)
    return _composed_core(zxbcdt_BTI, segment_ids_BT, p, cfg)


def _composed_core(zxbcdt_BTI: jax.Array, segment_ids_BT: jax.Array, p: Params, cfg: ModelConfig) -> jax.Array:
    """The core as a composition of its pieces, each differentiated on its own."""
    d = dims(cfg)
    t = zxbcdt_BTI.shape[1]
    e = d["E"]
    z_BTE = zxbcdt_BTI[..., :e]
    xbc_BTC = zxbcdt_BTI[..., e:e + d["conv"]]
    dt_BTH = _dt(zxbcdt_BTI[..., e + d["conv"]:], p["dt_bias"])
    if use_conv_kernel(cfg, t, d["conv"]):
        xbc_BTC = causal_conv_silu(xbc_BTC, p["conv_w"], p["conv_b"], segment_ids_BT, not on_gpu())
    else:
        conv_BTC = causal_conv(xbc_BTC.astype(jnp.float32), p["conv_w"], p["conv_b"], segment_ids_BT)
        xbc_BTC = jax.nn.silu(conv_BTC).astype(xbc_BTC.dtype)
    u_BTE = _ssd_with_skip(xbc_BTC, dt_BTH, p["A_log"], p["D_skip"], segment_ids_BT, cfg)
    if use_norm_kernel(cfg, t, e):
        # z is read in place from the GEMM output.
        return gated_norm_fused(u_BTE, zxbcdt_BTI, p["norm"], d["G"], cfg.norm_eps, ACT_DTYPE,
                                not on_gpu())
    return gated_group_norm(u_BTE, z_BTE, p["norm"], d["G"], cfg.norm_eps)


def _context_core(zxbcdt_BTI: jax.Array, segment_ids_BT: jax.Array, p: Params, *, cfg: ModelConfig) -> jax.Array:
    """The core on one context rank's tokens (inside ``per_context_rank``): two chunks of S tokens
    that are not neighbours in the sequence (maxfp4.parallel.context). Each chunk is a row of its
    own: its convolution window reaches into the previous chunk's last W-1 tokens, its SSD runs
    from a zero state (the Pallas kernel where it applies), and the state entering it, carried
    over all earlier chunks from their exit states, adds its part to the outputs."""
    d = dims(cfg)
    b, t, _ = zxbcdt_BTI.shape
    s, e, c, w = t // 2, d["E"], d["conv"], d["W"]
    h, pd, g, n = d["H"], d["P"], d["G"], d["N"]

    def rows(x):  # [B, 2S, ...] -> [2B, S, ...]: each chunk a row
        return x.reshape(b * 2, s, *x.shape[2:])

    seg_B2S = segment_ids_BT.reshape(b, 2, s)
    xbc_B2SC = zxbcdt_BTI[..., e:e + c].reshape(b, 2, s, c)
    # The previous chunk's last W-1 tokens (segment -1 before the first chunk: never equal).
    halo_B2WC = from_previous_chunk(xbc_B2SC[:, :, s - (w - 1):], 0)
    halo_seg_B2W = from_previous_chunk(seg_B2S[:, :, s - (w - 1):], -1)
    conv_in = jnp.concatenate([halo_B2WC, xbc_B2SC], axis=2).reshape(b * 2, s + w - 1, c)
    conv_seg = jnp.concatenate([halo_seg_B2W, seg_B2S], axis=2).reshape(b * 2, s + w - 1)
    conv_RSC = causal_conv(conv_in.astype(jnp.float32), p["conv_w"], p["conv_b"], conv_seg)[:, w - 1:]
    xbc_RSC = jax.nn.silu(conv_RSC).astype(zxbcdt_BTI.dtype)
    dt_RSH = _dt(rows(zxbcdt_BTI[..., e + c:]), p["dt_bias"])
    seg_RS = rows(segment_ids_BT)
    u_RSE = _ssd_with_skip(xbc_RSC, dt_RSH, p["A_log"], p["D_skip"], seg_RS, cfg)

    # The state entering each chunk, from every chunk's exit state and decay (all-gathered:
    # [2C, B, G, R, P, N], small next to the activations).
    previous_seg_R = from_previous_chunk(seg_B2S[:, :, -1], -1).reshape(b * 2)
    start_RS = segment_starts(seg_RS).at[:, 0].set(previous_seg_R != seg_RS[:, 0])
    A_H = -jnp.exp(p["A_log"])
    x_RSHP = xbc_RSC[..., :e].reshape(b * 2, s, h, pd)
    B_RSGN = xbc_RSC[..., e:e + g * n].reshape(b * 2, s, g, n)
    C_RSGN = xbc_RSC[..., e + g * n:].reshape(b * 2, s, g, n)
    matmul_dtype = _ssd_matmul_dtype(cfg)
    state_RGRPN, decay_RGR = chunk_exit(x_RSHP, dt_RSH, A_H, B_RSGN, start_RS, matmul_dtype)

    def per_rank_chunks(x):  # [2B, ...] -> [B, 2, ...]
        return x.reshape(b, 2, *x.shape[1:])

    entry_JBGRPN = pass_states(gather_chunks(per_rank_chunks(state_RGRPN)), gather_chunks(per_rank_chunks(decay_RGR)))
    entry_RGRPN = own_chunks(entry_JBGRPN).reshape(b * 2, *entry_JBGRPN.shape[2:])
    y_entry_RSHP = entry_output(C_RSGN, dt_RSH, A_H, start_RS, entry_RGRPN, matmul_dtype)
    u_RSE = (u_RSE.astype(jnp.float32) + y_entry_RSHP.reshape(b * 2, s, e)).astype(u_RSE.dtype)
    u_BTE = u_RSE.reshape(b, t, e)
    if use_norm_kernel(cfg, t, e):
        return gated_norm_fused(u_BTE, zxbcdt_BTI, p["norm"], d["G"], cfg.norm_eps, ACT_DTYPE, not on_gpu())
    return gated_group_norm(u_BTE, zxbcdt_BTI[..., :e], p["norm"], d["G"], cfg.norm_eps)


def _ssd_matmul_dtype(cfg: ModelConfig):
    """The operand dtype of the SSD's token-length matmuls (model.mamba.ssd_matmul), None for FP32."""
    return jnp.bfloat16 if cfg.mamba.ssd_matmul == "bf16" else None


def _dt(dt_raw_BTH: jax.Array, dt_bias_H: jax.Array) -> jax.Array:
    return jax.nn.softplus(dt_raw_BTH.astype(jnp.float32) + dt_bias_H)


def _ssd_with_skip(xbc_BTC: jax.Array, dt_BTH: jax.Array, A_log_H: jax.Array, D_H: jax.Array,
                   segment_ids_BT: jax.Array, cfg: ModelConfig) -> jax.Array:
    """SSD + D skip from the convolution output (x, B, C side by side), [B, T, E]."""
    d = dims(cfg)
    b, t, _ = xbc_BTC.shape
    e, h, pd, g, n = d["E"], d["H"], d["P"], d["G"], d["N"]
    x_BTHP = xbc_BTC[..., :e].reshape(b, t, h, pd)
    B_BTGN = xbc_BTC[..., e:e + g * n].reshape(b, t, g, n)
    C_BTGN = xbc_BTC[..., e + g * n:].reshape(b, t, g, n)
    A_H = -jnp.exp(A_log_H)
    matmul_dtype = _ssd_matmul_dtype(cfg)
    if use_ssd_kernel(cfg):
        # The kernel adds the D skip itself, where it holds x anyway, and reads x in place from
        # the convolution output (a sliced copy cost a [B, T, E] pass a layer).
        u_BTHP = ssd_fused(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, segment_ids_BT, cfg.mamba.chunk_size,
                           matmul_dtype=matmul_dtype, D_H=D_H, x_within_BTC=xbc_BTC,
                           forward=_ssd_kernels(cfg), backward=_ssd_kernels(cfg))
    else:
        y_BTHP = ssd_chunked(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, segment_ids_BT, cfg.mamba.chunk_size,
                             matmul_dtype=matmul_dtype)
        u_BTHP = y_BTHP + D_H[:, None] * x_BTHP
    return u_BTHP.reshape(b, t, e)


# The core with the convolution and norm kernels, under one VJP. Differentiated piece by piece,
# the in_proj output's gradient was the sum of three zero-padded pieces (z's from the norm,
# x/B/C's from the convolution, dt's), one more pass over a [B, T, I] array a layer (8.3 ms a
# step for mamba2-1p3b on an H200, 2026-11-25). Here the norm's backward kernel writes
# z's columns of that array, dt's are set in place, and the convolution's backward kernel writes
# x/B/C's columns into it (its output aliases the array). The values are those of the pieces.

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel_core(zxbcdt_BTI: jax.Array, segment_ids_BT: jax.Array, p: Params, cfg: ModelConfig) -> jax.Array:
    return _kernel_core_fwd(zxbcdt_BTI, segment_ids_BT, p, cfg)[0]


def _kernel_core_fwd(zxbcdt_BTI, segment_ids_BT, p, cfg, quantize: Quantize | None = None):
    """(the core's output, the residuals). With ``quantize`` the gated norm's kernel stores the
    output in FP8, and it comes back as (values, max |value| as rounded to BF16)."""
    d = dims(cfg)
    e, c = d["E"], d["conv"]
    interpret = not on_gpu()
    dt_BTH, dt_pull = jax.vjp(_dt, zxbcdt_BTI[..., e + c:], p["dt_bias"])
    xbc_in_BTC = zxbcdt_BTI[..., e:e + c]
    xbc_BTC, conv_res = conv_kernel.conv_forward(xbc_in_BTC, p["conv_w"], p["conv_b"], segment_ids_BT, interpret,
                                                 kernel=_conv_kernels(cfg, xbc_in_BTC, p["conv_w"], p["conv_b"],
                                                                      quantize is not None),
                                                 source_BTI=zxbcdt_BTI, source_offset=e)
    u_BTE, ssd_pull = jax.vjp(
        lambda xbc, dt, A_log, D: _ssd_with_skip(xbc, dt, A_log, D, segment_ids_BT, cfg),
        xbc_BTC, dt_BTH, p["A_log"], p["D_skip"])
    norm = _norm_kernels(cfg, u_BTE, zxbcdt_BTI, p["norm"], "forward", quantize is not None)
    out_BTE, norm_res = norm.gated_norm_forward(u_BTE, zxbcdt_BTI, p["norm"], d["G"], cfg.norm_eps, ACT_DTYPE,
                                                interpret, quantize)
    return out_BTE, (dt_pull, conv_res, ssd_pull, norm_res)


def _kernel_core_bwd(cfg, residuals, dout_BTE):
    dzxbcdt_BTI, grads = _core_backward(cfg, residuals, dout_BTE)
    return dzxbcdt_BTI, None, grads


def _core_backward(cfg, residuals, dout_BTE, quantize: Quantize | None = None):
    """(the in_proj output's gradient [B, T, I], the core parameters' gradients), assembled in
    place. With ``quantize`` the gradient is stored in FP8 by the kernels that write it and a
    third value comes back: the max of its |values| as rounded to BF16 before the cast."""
    dt_pull, conv_res, ssd_pull, norm_res = residuals
    d = dims(cfg)
    e, c = d["E"], d["conv"]
    interpret = not on_gpu()
    du_BTE, dzxbcdt_BTI, dnorm, *amax_z = _norm_kernels(cfg, *norm_res, "backward", quantize is not None).gated_norm_backward(
        norm_res, dout_BTE, d["G"], cfg.norm_eps, interpret, quantize=quantize)
    dxbc_BTC, ddt_BTH, dA_log, dD = ssd_pull(du_BTE)
    ddt_raw_BTH, ddt_bias = dt_pull(ddt_BTH)
    if quantize is None:
        dzxbcdt_BTI = dzxbcdt_BTI.at[..., e + c:].set(ddt_raw_BTH.astype(dzxbcdt_BTI.dtype))
        amax_dt = []
    else:
        q_dt, amax_dt = quantize_rounded(ddt_raw_BTH, ACT_DTYPE, quantize)
        dzxbcdt_BTI, amax_dt = dzxbcdt_BTI.at[..., e + c:].set(q_dt), [amax_dt]
    dzxbcdt_BTI, dconv_w, dconv_b, *amax_xbc = conv_kernel.conv_backward(
        conv_res, dxbc_BTC, interpret, into_BTI=dzxbcdt_BTI, column_offset=e, quantize=quantize,
        kernel=_conv_kernels(cfg, dxbc_BTC, conv_res[1], conv_res[2], quantize is not None), source_offset=e)
    grads = {"conv_w": dconv_w, "conv_b": dconv_b, "A_log": dA_log, "D_skip": dD, "dt_bias": ddt_bias,
             "norm": dnorm}
    if quantize is None:
        return dzxbcdt_BTI, grads
    return dzxbcdt_BTI, grads, jnp.max(jnp.stack(amax_z + amax_dt + amax_xbc))


_kernel_core.defvjp(_kernel_core_fwd, _kernel_core_bwd)


# in_proj, the kernel core and out_proj under one VJP, both layers with FP8 delayed scaling. The
# kernels that assemble in_proj's output gradient store it in E5M2 with the recipe's dY scale,
# and the gated norm's forward kernel stores out_proj's input in E4M3 with its x scale; the
# recipes' GEMMs read those directly. Otherwise each was written in BF16 and read back by a cast
# of its own, one pass more a layer each (hybrid-1b, H200, 2026-11-26). Same values as lp.dot,
# _kernel_core, lp.dot: bit for bit on the CPU (tests/test_hybrid.py); compiled, within the
# bounds tests/test_gpu_mamba_kernels.py states (GEMM accumulation order, and XLA may skip the
# recipe path's BF16 rounding of dt's columns).

# options_in and options_out: the same recipe's options, each with its own layer class.
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _fused_mixer(x_BTD, w_in_DI, scales_in, core_params, w_out_ED, scales_out, segment_ids_BT, cfg: ModelConfig,
                 options_in, options_out, ops):
    return _fused_mixer_fwd(x_BTD, w_in_DI, scales_in, core_params, w_out_ED, scales_out, segment_ids_BT, cfg,
                            options_in, options_out, ops)[0]


def _fused_mixer_fwd(x_BTD, w_in_DI, scales_in, core_params, w_out_ED, scales_out, segment_ids_BT, cfg, options_in,
                     options_out, ops):
    zxbcdt_BTI, in_res = ops.forward(x_BTD, w_in_DI, options_in, scales_in)
    sx_out = ops.scales_of(options_out, scales_out)[0]
    (qy_BTE, amax_y), core_res = _kernel_core_fwd(checkpoint_name(zxbcdt_BTI, GEMM_OUT), segment_ids_BT,
                                                  core_params, cfg, Quantize(sx_out, ops.x_format))
    out_BTD, out_res = ops.forward_quantized(qy_BTE, amax_y, ACT_DTYPE, w_out_ED, options_out, scales_out)
    return checkpoint_name(out_BTD, GEMM_OUT), (in_res, core_res, out_res)


def _fused_mixer_bwd(cfg, options_in, options_out, ops, residuals, dout_BTD):
    in_res, core_res, out_res = residuals
    dy_BTE, dw_out, amaxes_out = ops.backward(options_out, out_res, dout_BTD)
    quantize = Quantize(ops.dy_scale(in_res), ops.dy_format)
    qdzxbcdt_BTI, grads, amax_dz = _core_backward(cfg, core_res, dy_BTE, quantize)
    dx_BTD, dw_in, amaxes_in = ops.backward_quantized(options_in, in_res, qdzxbcdt_BTI, amax_dz)
    return dx_BTD, dw_in, amaxes_in, grads, dw_out, amaxes_out, None


_fused_mixer.defvjp(_fused_mixer_fwd, _fused_mixer_bwd)
