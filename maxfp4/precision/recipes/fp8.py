"""Per-tensor FP8: ``fp8_delayed`` (Transformer Engine DelayedScaling) and ``fp8_current``.

HYBRID formats: E4M3 for x and w, E5M2 for dY. Delayed scaling needs this step's amaxes to
update its state. A recipe cannot return them from the forward pass (dY only exists in the
backward pass), so the cotangent of ``scales`` carries them out: ``jax.grad`` with respect to the
scales yields f32[3] amaxes, which :func:`update_slot` folds into the histories (through
:mod:`maxfp4.precision.state`). The optimizer never sees them.

Dimension letters: M tokens (batch x sequence), K input features, N output features.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxfp4.kernels.launch import on_gpu
from maxfp4.parallel.mesh import gathered_weight_spec, traced_mesh
from maxfp4.precision import catalog
from maxfp4.precision import formats as F
from maxfp4.precision.catalog import FAST_ACCUMULATION_DEFAULT, LAYER_CLASS_OPTION
from maxfp4.precision.fused import FusedOperands
from maxfp4.precision.recipes.grouped import (fp8_current_grouped, fp8_delayed_grouped,
                                               fp8_delayed_grouped_with_reciprocals)
from maxfp4.precision.recipes import (COMPUTE_DTYPE, GEMM_IN, GEMM_WEIGHT, TN, Recipe, amax, delayed_scales,
                                      dtype_token, flat, power_2_scale, unflat)


# FP8 accumulation, as XLA hands it to cuBLASLt: a dot whose operand precisions are all DEFAULT
# becomes an FP8 GEMM with CUBLASLT_MATMUL_DESC_FAST_ACCUM (Hopper's fast accumulation: the
# tensor cores' partial sums are not promoted to FP32 every few K steps); any higher precision
# turns it off (IsFastAccumEnabled, XLA stream_executor/cuda/cuda_blas_lt.cc). Transformer
# Engine uses fast accumulation for fprop and the precise (split) one for dgrad and wgrad.
_ACCUMULATION_PRECISION = {True: jax.lax.Precision.DEFAULT, False: jax.lax.Precision.HIGHEST}


def fp8_gemm_tn(a_q: jax.Array, a_scale: jax.Array, b_q: jax.Array, b_scale: jax.Array,
                out_dtype=COMPUTE_DTYPE, power_2: bool = False, fast_accumulation: bool = True,
                inverses: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """``(a/sa)[M,K] @ (b/sb)[N,K]^T`` for FP8 ``a``, ``b`` with per-tensor scales;
    ``fast_accumulation`` picks cuBLASLt's accumulation on Hopper through the dot's precision
    (CPU results are the same either way). ``inverses``: ``(1/sa, 1/sb)`` as ``formats.div_rn``
    computes them, where the caller has them already (default: computed here).

    Either way it is one FP32-accumulated product scaled by ``1/(sa*sb)`` in FP32 and rounded
    once to ``out_dtype``, and XLA's GEMM rewriter turns it into a cuBLASLt FP8 GEMM on Hopper:

    - dequantize-then-dot (``power_2`` scales anywhere, and BF16 outputs on GPU): the operands
      are ``bf16(q) * bf16(1/s)`` and the dot is typed ``out_dtype``. XLA's rewriter takes each
      ``1/s`` as the GEMM's FP32 operand scale and the GEMM writes ``out_dtype`` itself, half
      the traffic of an FP32 output for BF16. With power-of-two scales ``bf16(1/s)`` is exact.
      With other scales it is exact on GPU only: the rewriter widens the scale back to FP32 and
      XLA drops that ``f32 -> bf16 -> f32`` round trip (it may keep excess precision), so the
      FP32 ``1/s`` reaches cuBLASLt. The barrier stops XLA from folding a constant ``1/s`` into
      a rounded BF16 constant first. tests/test_gpu_precision.py holds this form's bits to the
      one below on the GPU.
    - otherwise (FP32 outputs, and any scales off GPU, where nothing drops the round trip): a
      BF16 GEMM of the raw FP8 values (exact in BF16) with an FP32 result, times ``1/(sa*sb)``,
      then cast. On GPU XLA folds the factor into the GEMM but not the cast, so a BF16 output
      would be written in FP32 and cast in a pass of its own.
    """
    precision = _ACCUMULATION_PRECISION[bool(fast_accumulation)]
    inv_a, inv_b = (F.div_rn(1.0, a_scale), F.div_rn(1.0, b_scale)) if inverses is None else inverses
    if power_2 or (out_dtype != jnp.float32 and on_gpu()):
        if not power_2:
            inv_a, inv_b = jax.lax.optimization_barrier((inv_a, inv_b))
        a = a_q.astype(COMPUTE_DTYPE) * inv_a.astype(COMPUTE_DTYPE)
        b = b_q.astype(COMPUTE_DTYPE) * inv_b.astype(COMPUTE_DTYPE)
        return jax.lax.dot_general(a, b, TN, precision=precision, preferred_element_type=out_dtype)
    acc = jax.lax.dot_general(a_q.astype(COMPUTE_DTYPE), b_q.astype(COMPUTE_DTYPE), TN, precision=precision,
                              preferred_element_type=jnp.float32)
    return (acc * (inv_a * inv_b)).astype(out_dtype)


def _gathered(w_q: jax.Array, layer_class: str | None) -> jax.Array:
    """The quantized weight as its GEMM takes it where FSDP shards it: whole along every mesh
    axis but tensor, whose split stays (column-parallel layers split N, row-parallel ones K:
    ``maxfp4.parallel.mesh.gathered_weight_spec`` of ``layer_class``). The all-gather then
    moves the FP8 bytes. Left to itself, XLA placed it after the FP8 -> BF16 convert that feeds
    the GEMM, which moved twice the bytes and, worse, hid the FP8 operand from the GEMM rewriter:
    the forward GEMMs ran in BF16 (Llama-3-8B at fsdp=2, unrolled blocks). The residual stays
    the sharded weight, so the backward gathers it again rather than keeping a whole copy per
    layer. A call without a layer class under tensor parallelism (a recipe called directly)
    leaves the placement to XLA."""
    mesh = traced_mesh()
    if mesh is None or mesh.size == 1:
        return w_q
    if layer_class is not None:
        spec = gathered_weight_spec(layer_class, w_q.shape, mesh)
    elif mesh.shape.get("tensor", 1) == 1:
        spec = jax.sharding.PartitionSpec()
    else:
        return w_q
    return jax.lax.with_sharding_constraint(w_q, jax.sharding.NamedSharding(mesh, spec))


def _layer_class(options) -> str | None:
    """The layer class a call serves (``LayerPrecision`` adds it to the policy's options)."""
    return dict(options).get(LAYER_CLASS_OPTION)


def _fp8_forward(x, w, sx, sw, power_2, fast, layer_class):
    return _fp8_forward_quantized(F.quantize_fp8(x, sx, F.FP8_E4M3), sx, w, sw, power_2, fast, layer_class)


def _fp8_forward_quantized(qx, sx, w, sw, power_2, fast, layer_class, inverses=None):
    """fprop from x already in E4M3 (``qx = fp8(clip(x * sx))``, [..., K]); ``fast``: its
    accumulation (``fast_accumulation(options).forward``); ``inverses``: (1/sx, 1/sw) if known."""
    qx_MK = flat(qx)
    qw_KN = F.quantize_fp8(w, sw, F.FP8_E4M3)
    y_MN = fp8_gemm_tn(qx_MK, sx, _gathered(qw_KN, layer_class).T, sw, power_2=power_2, fast_accumulation=fast,
                       inverses=inverses)
    residuals = (checkpoint_name(qx_MK, GEMM_IN), checkpoint_name(qw_KN, GEMM_WEIGHT))
    return unflat(y_MN, qx.shape[:-1]), residuals


def _fp8_backward(dy, sdy, qx_MK, sx, qw_KN, sw, power_2, fast, layer_class):
    qdy = F.quantize_fp8(dy, sdy, F.FP8_E5M2)
    return _fp8_backward_quantized(qdy, sdy, qx_MK, sx, qw_KN, sw, power_2, fast, layer_class)


def _fp8_backward_quantized(qdy, sdy, qx_MK, sx, qw_KN, sw, power_2, fast, layer_class):
    """dgrad and wgrad from dY already in E5M2 (``qdy = fp8(clip(dY * sdy))``, [..., N]);
    ``fast``: their accumulation (``fast_accumulation(options).backward``)."""
    return _fp8_dgrad(qdy, sdy, qw_KN, sw, power_2, fast, layer_class), _fp8_wgrad(qdy, sdy, qx_MK, sx, power_2, fast)


def _fp8_dgrad(qdy, sdy, qw_KN, sw, power_2, fast, layer_class, inverses=None):
    dx_MK = fp8_gemm_tn(flat(qdy), sdy, _gathered(qw_KN, layer_class), sw, power_2=power_2,
                        fast_accumulation=fast, inverses=inverses)  # dY[M,N] . W[K,N]^T
    return unflat(dx_MK, qdy.shape[:-1])


def _fp8_wgrad(qdy, sdy, qx_MK, sx, power_2, fast, qdy_t_NM=None, qx_t_KM=None, inverses=None):
    """X^T[K,M] . dY^T[N,M]^T. cuBLASLt reads FP8 operands only contiguous along M here, so XLA
    transposes qx and qdy first, unless their producer stored them transposed already
    (``qx_t_KM``, ``qdy_t_NM``: the same values)."""
    qdy_t_NM = flat(qdy).T if qdy_t_NM is None else qdy_t_NM
    qx_t_KM = qx_MK.T if qx_t_KM is None else qx_t_KM
    return fp8_gemm_tn(qx_t_KM, sx, qdy_t_NM, sdy, jnp.float32, power_2, fast, inverses)


class Accumulation(NamedTuple):
    forward: bool  # fprop
    backward: bool  # dgrad and wgrad


def fast_accumulation(options) -> Accumulation:
    """Which FP8 GEMMs use Hopper's fast accumulation: the recipe option ``fast_accumulation``
    (the policy keeps it as sorted (key, value) pairs), else Transformer Engine's choice."""
    given = dict(dict(options).get("fast_accumulation", ()))
    return Accumulation(**{**FAST_ACCUMULATION_DEFAULT, **given})


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_delayed(x, w, options, scales, key):
    return _fp8_delayed_fwd(x, w, options, scales, key)[0]


def fp8_delayed_with_reciprocals(scales_X3: jax.Array, options) -> jax.Array:
    """[..., 3] scales -> [..., 6]: the scales, then the exact reciprocals (``formats.div_rn``)
    of the scales a step quantizes with, computed once for a whole class's [L, 3] array. A layer
    given the six reads its reciprocals instead of dividing its own three: one division of ~100
    instructions per scale and layer, which XLA gathered into multi-output fusions of thousands
    of instructions and whose compile dominated (mamba2-1p3b FP8 on an H200: 15.8k of its 62.8k
    instructions). The reciprocals carry no gradient: the scales' cotangent (this step's amaxes)
    reaches the first three only."""
    inv = F.div_rn(1.0, delayed_scales(scales_X3, options))
    return jnp.concatenate([scales_X3, jax.lax.stop_gradient(inv)], axis=-1)


def _scales_and_reciprocals(scales, options) -> tuple[jax.Array, jax.Array]:
    """``(s, 1/s)`` of a layer's three scales, given as [3] or with their reciprocals as [6]."""
    s = delayed_scales(scales, options)
    return s, (scales[3:] if scales.shape[-1] == 6 else F.div_rn(1.0, s))


def _fp8_delayed_fwd(x, w, options, scales, key):
    del key
    return fp8_delayed_forward(x, w, options, scales)


def _fp8_delayed_bwd(options, res, dy):
    return fp8_delayed_backward(options, res, dy) + (None,)


def fp8_delayed_forward(x, w, options, scales):
    """``fp8_delayed_dot``'s forward pass: ``(y, residuals)``. With the functions below it lets
    a layer next to a kernel with a VJP of its own (the Mamba-2 mixer) have that kernel store
    the layer's FP8 operand directly (x with ``fp8_delayed_forward_quantized``, dY with
    ``fp8_delayed_dy_scale`` and ``fp8_delayed_backward_quantized``), instead of BF16 that a
    separate pass reads again to cast: same values, one pass less."""
    qx = F.quantize_fp8(x, fp8_delayed_scales(options, scales)[0], F.FP8_E4M3)
    return fp8_delayed_forward_quantized(qx, amax(x), x.dtype, w, options, scales)


def fp8_delayed_scales(options, scales) -> jax.Array:
    """The (x, w, dY) scales a step quantizes with, from the layer's delayed-scaling state."""
    return delayed_scales(scales, options)


def fp8_delayed_forward_quantized(qx, amax_x, x_dtype, w, options, scales):
    """``fp8_delayed_forward`` for x already quantized with ``fp8_delayed_scales(...)[0]`` by
    its producer, which also reports ``amax_x``, the max of |x| in ``x_dtype`` (the dtype the
    BF16 path would have handed the recipe, and the dtype of dx)."""
    # The scales as used here, and their reciprocals, kept for the backward GEMMs too (given
    # with the scales by fp8_delayed_with_reciprocals, else one exact division of the three).
    s, inv = _scales_and_reciprocals(scales, options)
    y, (qx_MK, qw) = _fp8_forward_quantized(qx, s[0], w, s[1], power_2_scale(options),
                                            fast_accumulation(options).forward, _layer_class(options),
                                            (inv[0], inv[1]))
    amax_xw = jnp.stack([jnp.asarray(amax_x, jnp.float32), amax(w)])
    # The residual scales keep the width the scales came in (3 or 6), so the backward pass
    # returns their cotangent in the same shape (the reciprocals' part zero).
    return y, (qx_MK, qw, jnp.concatenate([s, inv[:scales.shape[-1] - 3]]), amax_xw, dtype_token(x_dtype), inv)


def fp8_delayed_dy_scale(residuals) -> jax.Array:
    """The scale dY is quantized with: ``qdy = fp8_e5m2(clip(dY * scale))``."""
    return residuals[2][2]


def fp8_delayed_x_scale(residuals) -> jax.Array:
    """The scale x was quantized with in the forward (``fp8_delayed_scales(...)[0]``)."""
    return residuals[2][0]


def fp8_delayed_quantize_dy(residuals, dy) -> tuple[jax.Array, jax.Array]:
    """``(qdy, amax)``: the BF16 gradient dy in E5M2 with ``fp8_delayed_dy_scale``, and max |dy|."""
    return F.quantize_fp8(dy, fp8_delayed_dy_scale(residuals), F.FP8_E5M2), amax(dy)


def fp8_delayed_backward(options, residuals, dy):
    """``(dx, dw, amaxes)`` of ``fp8_delayed_forward``'s product for the BF16 gradient dy."""
    return fp8_delayed_backward_quantized(options, residuals, *fp8_delayed_quantize_dy(residuals, dy))


def fp8_delayed_backward_quantized(options, residuals, qdy, amax_dy, qdy_t_NM=None):
    """``(dx, dw, amaxes)`` from dY already quantized with ``fp8_delayed_dy_scale`` and the amax
    of the BF16 dY it was cast from; ``amaxes`` (x, w, dY) is the scales' cotangent.
    ``qdy_t_NM``: the same dY stored transposed ([N, M]) by its producer, for the wgrad."""
    return (fp8_delayed_dgrad(options, residuals, qdy),
            *fp8_delayed_wgrad(options, residuals, qdy, amax_dy, qdy_t_NM))


def fp8_delayed_dgrad(options, residuals, qdy):
    """dx alone, from dY quantized as for ``fp8_delayed_backward_quantized``: for a producer of
    the wgrad's operands that needs dx first (the MLP's activation needs mlp_down's dx)."""
    _, qw, s, _, x_token, inv = residuals
    return _fp8_dgrad(qdy, s[2], qw, s[1], power_2_scale(options), fast_accumulation(options).backward,
                      _layer_class(options), (inv[2], inv[1])).astype(x_token.dtype)


def fp8_delayed_wgrad(options, residuals, qdy, amax_dy, qdy_t_NM=None, qx_t_KM=None):
    """``(dw, amaxes)``, the rest of ``fp8_delayed_backward_quantized``; ``qx_t_KM``: x as quantized
    in the forward, stored transposed ([K, M]) by the code that also produced it."""
    qx, _, s, amax_xw, _, inv = residuals
    dw = _fp8_wgrad(qdy, s[2], qx, s[0], power_2_scale(options), fast_accumulation(options).backward, qdy_t_NM, qx_t_KM,
                    (inv[0], inv[2]))
    # The scales' "gradient" is this step's amaxes (x, w, dY): see the module docstring; zero
    # for the reciprocals where the scales came with them.
    return dw, jnp.concatenate([amax_xw, jnp.asarray(amax_dy, jnp.float32)[None], jnp.zeros_like(s[3:])])


_fp8_delayed.defvjp(_fp8_delayed_fwd, _fp8_delayed_bwd)


def fp8_delayed_dot(x, w, options=(), scales=None, key=None):
    """Per-tensor FP8 with scales from earlier steps' amaxes (Transformer Engine DelayedScaling,
    HYBRID: E4M3 for x and w, E5M2 for dY)."""
    if scales is None:
        raise ValueError("fp8_delayed needs its scaling state (scales f32[3])")
    return _fp8_delayed(x, w, options, scales, key)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _fp8_current(x, w, power_2, accumulation, layer_class):
    return _fp8_current_fwd(x, w, power_2, accumulation, layer_class)[0]


def _fp8_current_fwd(x, w, power_2, accumulation, layer_class):
    sx = F.scale_from_amax(amax(x), F.FP8_E4M3, power_2=power_2)
    sw = F.scale_from_amax(amax(w), F.FP8_E4M3, power_2=power_2)
    y, (qx, qw) = _fp8_forward(x, w, sx, sw, power_2, accumulation.forward, layer_class)
    return y, (qx, qw, sx, sw, dtype_token(x.dtype))


def _fp8_current_bwd(power_2, accumulation, layer_class, res, dy):
    qx, qw, sx, sw, x_token = res
    sdy = F.scale_from_amax(amax(dy), F.FP8_E5M2, power_2=power_2)
    dx, dw = _fp8_backward(dy, sdy, qx, sx, qw, sw, power_2, accumulation.backward, layer_class)
    return dx.astype(x_token.dtype), dw


_fp8_current.defvjp(_fp8_current_fwd, _fp8_current_bwd)


def fp8_current_dot(x, w, options=(), scales=None, key=None):
    """Per-tensor FP8 with each scale from the tensor's own current amax (no state)."""
    del scales, key
    return _fp8_current(x, w, power_2_scale(options), fast_accumulation(options), _layer_class(options))


# ----------------------------------------------------------------------------- delayed-scaling state

# One slot per quantized layer: a scale and an amax history for each of x, w and dY, in that order.
SLOT_DTYPES = (F.FP8_E4M3, F.FP8_E4M3, F.FP8_E5M2)  # HYBRID: E4M3 forward, E5M2 backward


def init_slot(options, lead: tuple[int, ...]) -> dict[str, jax.Array]:
    """``{"scale": f32[*lead, 3], "amax_history": f32[*lead, 3, amax_history]}``: scale 1 at
    the first step, as Transformer Engine starts."""
    h = int(dict(options)["amax_history"])
    return {"scale": jnp.ones((*lead, 3), jnp.float32), "amax_history": jnp.zeros((*lead, 3, h), jnp.float32)}


def _next_slot(slot: dict[str, jax.Array], amax_new: jax.Array, margin: int, algo: str,
               power_2: bool) -> dict[str, jax.Array]:
    """Roll this step's amax into the history (newest at index 0) and compute the next scales
    ``(fp8_max / amax_h) / 2**margin`` (rounded down to a power of two with ``power_2``); a zero
    or non-finite amax_h keeps the old scale."""
    history = jnp.roll(slot["amax_history"], 1, axis=-1).at[..., 0].set(amax_new)
    amax_h = jnp.max(history, axis=-1) if algo == "max" else history[..., 0]
    # One exact division for the whole [L, 3] array, each slot with its format's max.
    scales = F.scale_from_amax(amax_h, SLOT_DTYPES, margin, slot["scale"], power_2)
    return {"scale": scales, "amax_history": history}


def update_slot(slot: dict[str, jax.Array], amax_new: jax.Array, options) -> dict[str, jax.Array]:
    """The slot after a step whose amaxes (x, w, dY) were ``amax_new``, with the recipe's options."""
    opts = dict(options)
    return _next_slot(slot, amax_new, int(opts["margin"]), str(opts["amax_algo"]), bool(opts["power_2_scale"]))


# The hooks through which a layer stores FP8 delayed-scaling operands from its own kernels.
FP8_DELAYED_FUSED = FusedOperands(
    recipe="fp8_delayed", x_format=F.FP8_E4M3, dy_format=F.FP8_E5M2, forward=fp8_delayed_forward,
    scales_of=fp8_delayed_scales, forward_quantized=fp8_delayed_forward_quantized, dy_scale=fp8_delayed_dy_scale,
    x_scale=fp8_delayed_x_scale, quantize_dy=fp8_delayed_quantize_dy, backward=fp8_delayed_backward,
    backward_quantized=fp8_delayed_backward_quantized, dgrad=fp8_delayed_dgrad, wgrad=fp8_delayed_wgrad)

FP8_DELAYED = Recipe(catalog.FP8_DELAYED, fp8_delayed_dot, fused=FP8_DELAYED_FUSED, init_state=init_slot,
                     update_state=update_slot, grouped=fp8_delayed_grouped,
                     with_reciprocals=fp8_delayed_with_reciprocals,
                     grouped_with_reciprocals=fp8_delayed_grouped_with_reciprocals)
FP8_CURRENT = Recipe(catalog.FP8_CURRENT, fp8_current_dot, grouped=fp8_current_grouped)
