"""Linear-layer recipes: how the operands of ``Y = X W`` and of its two gradient GEMMs are quantized.

Every linear layer makes three GEMMs: fprop ``Y = X W``, dgrad ``dX = dY W^T`` and wgrad
``dW = X^T dY``. A recipe is a ``jax.custom_vjp`` that decides each operand's format. Master
weights arrive in FP32; the weight gradient leaves in FP32; activations travel in BF16.

Signature of a recipe: ``fn(x[..., K], w[K, N], options, scales, key) -> y[..., N]`` where
``options`` is a hashable tuple of (name, value) pairs, ``scales`` is the FP8 delayed-scaling
state of this layer (f32[3]: x, w, dY) or None, and ``key`` a PRNG key for stochastic rounding.

Delayed scaling needs this step's amaxes to update its state. A recipe cannot return them from
the forward pass (dY only exists in the backward pass), so the cotangent of ``scales`` carries
them out: ``jax.grad`` with respect to the scales yields f32[3] amaxes, which
:mod:`maxfp4.precision.state` folds into the histories. The optimizer never sees them.

Dimension letters: M tokens (batch x sequence), K input features, N output features.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxfp4.mesh import batch_split, split_size, splits_only
from maxfp4.kernels.launch import on_gpu
from maxfp4.precision import formats as F
from maxfp4.precision.fused import FusedOperands
from maxfp4.kernels.rht import hadamard_block_dequantize_nvfp4_columns, rht_columns_supported

COMPUTE_DTYPE = jnp.bfloat16
TN = (((1,), (1,)), ((), ()))  # contract dim 1 of both operands: the fast cuBLASLt FP8 layout
# The name of each recipe's activation operand as its backward pass keeps it (FP8 for the FP8
# recipes, BF16 for the others), so a remat policy can keep it rather than recompute the norm,
# activation and cast that made it (train.remat=save_gemm_io, maxfp4.model.remat).
GEMM_IN = "gemm_in"
# The name of each recipe's weight operand as its backward pass keeps it: cast (BF16) or
# quantized (E4M3, NVFP4 tiles), still sharded as the parameter is, before any all-gather. A remat
# policy keeps it for unrolled blocks, whose FP32 weights are slices of the stacked parameters
# that XLA would otherwise copy for the backward pass to cast again (maxfp4.model.remat).
GEMM_WEIGHT = "gemm_weight"


def _flat(x: jax.Array) -> jax.Array:
    return x.reshape(-1, x.shape[-1])


def _dtype_token(dtype) -> jax.Array:
    """A zero-size array that carries a dtype (of x, whose gradient takes it) through the
    residuals: dtypes are not JAX types."""
    return jnp.zeros((0,), dtype)


def _amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


# ----------------------------------------------------------------------------- BF16


@jax.custom_vjp
def _bf16(x, w):
    return _bf16_fwd(x, w)[0]


def _bf16_fwd(x, w):
    x_MK, w_KN = _flat(x).astype(COMPUTE_DTYPE), w.astype(COMPUTE_DTYPE)
    y = jnp.dot(x_MK, w_KN, preferred_element_type=COMPUTE_DTYPE)
    return y.reshape(*x.shape[:-1], w.shape[1]), (checkpoint_name(x_MK, GEMM_IN), checkpoint_name(w_KN, GEMM_WEIGHT),
                                                  _dtype_token(x.dtype))


def _bf16_bwd(res, dy):
    x_MK, w_KN, x_token = res
    dy_MN = _flat(dy).astype(COMPUTE_DTYPE)
    # Written out so that both gradient GEMMs are BF16 x BF16: plain autodiff of a dot with an
    # FP32 result feeds an FP32 cotangent into them and runs them as FP32 GEMMs.
    dx = jax.lax.dot_general(dy_MN, w_KN, TN, preferred_element_type=COMPUTE_DTYPE)
    dw = jax.lax.dot_general(x_MK, dy_MN, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return dx.reshape(*dy.shape[:-1], x_MK.shape[1]).astype(x_token.dtype), dw


_bf16.defvjp(_bf16_fwd, _bf16_bwd)


def bf16_dot(x, w, options=(), scales=None, key=None):
    """BF16 operands, FP32 accumulation; BF16 output and input gradient, FP32 weight gradient."""
    del options, scales, key
    return _bf16(x, w)


# ----------------------------------------------------------------------------- FP8


# FP8 accumulation, as XLA hands it to cuBLASLt: a dot whose operand precisions are all DEFAULT
# becomes an FP8 GEMM with CUBLASLT_MATMUL_DESC_FAST_ACCUM (Hopper's fast accumulation: the
# tensor cores' partial sums are not promoted to FP32 every few K steps); any higher precision
# turns it off (IsFastAccumEnabled, XLA stream_executor/cuda/cuda_blas_lt.cc). Transformer
# Engine uses fast accumulation for fprop and the precise (split) one for dgrad and wgrad.
_ACCUMULATION_PRECISION = {True: jax.lax.Precision.DEFAULT, False: jax.lax.Precision.HIGHEST}


def fp8_gemm_tn(a_q: jax.Array, a_scale: jax.Array, b_q: jax.Array, b_scale: jax.Array,
                out_dtype=COMPUTE_DTYPE, power_2: bool = False, fast_accumulation: bool = True) -> jax.Array:
    """``(a/sa)[M,K] @ (b/sb)[N,K]^T`` for FP8 ``a``, ``b`` with per-tensor scales;
    ``fast_accumulation`` picks cuBLASLt's accumulation on Hopper through the dot's precision
    (CPU results are the same either way).

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
    inv_a, inv_b = F.div_rn(1.0, a_scale), F.div_rn(1.0, b_scale)
    if power_2 or (out_dtype != jnp.float32 and on_gpu()):
        if not power_2:
            inv_a, inv_b = jax.lax.optimization_barrier((inv_a, inv_b))
        a = a_q.astype(COMPUTE_DTYPE) * inv_a.astype(COMPUTE_DTYPE)
        b = b_q.astype(COMPUTE_DTYPE) * inv_b.astype(COMPUTE_DTYPE)
        return jax.lax.dot_general(a, b, TN, precision=precision, preferred_element_type=out_dtype)
    acc = jax.lax.dot_general(a_q.astype(COMPUTE_DTYPE), b_q.astype(COMPUTE_DTYPE), TN, precision=precision,
                              preferred_element_type=jnp.float32)
    return (acc * (inv_a * inv_b)).astype(out_dtype)


def _gathered(w_q: jax.Array) -> jax.Array:
    """The quantized weight whole on every device, where FSDP shards it (a mesh without tensor
    parallelism): the all-gather then moves the FP8 bytes. Left to itself, XLA placed it after
    the FP8 -> BF16 convert that feeds the GEMM when the blocks were unrolled, which moved twice
    the bytes and, worse, hid the FP8 operand from the GEMM rewriter: the forward GEMMs ran in
    BF16 (Llama-3-8B at fsdp=2). The residual stays the sharded weight, so the backward gathers
    it again rather than keeping a whole copy per layer."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.shape.get("tensor", 1) > 1 or mesh.size == 1:
        return w_q
    return jax.lax.with_sharding_constraint(w_q, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _fp8_forward(x, w, sx, sw, power_2, fast):
    return _fp8_forward_quantized(F.quantize_fp8(x, sx, F.FP8_E4M3), sx, w, sw, power_2, fast)


def _fp8_forward_quantized(qx, sx, w, sw, power_2, fast):
    """fprop from x already in E4M3 (``qx = fp8(clip(x * sx))``, [..., K]); ``fast``: its
    accumulation (``fast_accumulation(options).forward``)."""
    qx_MK = _flat(qx)
    qw_KN = F.quantize_fp8(w, sw, F.FP8_E4M3)
    y_MN = fp8_gemm_tn(qx_MK, sx, _gathered(qw_KN).T, sw, power_2=power_2, fast_accumulation=fast)
    residuals = (checkpoint_name(qx_MK, GEMM_IN), checkpoint_name(qw_KN, GEMM_WEIGHT))
    return y_MN.reshape(*qx.shape[:-1], w.shape[1]), residuals


def _fp8_backward(dy, sdy, qx_MK, sx, qw_KN, sw, power_2, fast):
    qdy = F.quantize_fp8(dy, sdy, F.FP8_E5M2)
    return _fp8_backward_quantized(qdy, sdy, qx_MK, sx, qw_KN, sw, power_2, fast)


def _fp8_backward_quantized(qdy, sdy, qx_MK, sx, qw_KN, sw, power_2, fast):
    """dgrad and wgrad from dY already in E5M2 (``qdy = fp8(clip(dY * sdy))``, [..., N]);
    ``fast``: their accumulation (``fast_accumulation(options).backward``)."""
    return _fp8_dgrad(qdy, sdy, qw_KN, sw, power_2, fast), _fp8_wgrad(qdy, sdy, qx_MK, sx, power_2, fast)


def _fp8_dgrad(qdy, sdy, qw_KN, sw, power_2, fast):
    dx_MK = fp8_gemm_tn(_flat(qdy), sdy, _gathered(qw_KN), sw, power_2=power_2,
                        fast_accumulation=fast)  # dY[M,N] . W[K,N]^T
    return dx_MK.reshape(*qdy.shape[:-1], qw_KN.shape[0])


def _fp8_wgrad(qdy, sdy, qx_MK, sx, power_2, fast, qdy_t_NM=None, qx_t_KM=None):
    """X^T[K,M] . dY^T[N,M]^T. cuBLASLt reads FP8 operands only contiguous along M here, so XLA
    transposes qx and qdy first, unless their producer stored them transposed already
    (``qx_t_KM``, ``qdy_t_NM``: the same values)."""
    qdy_t_NM = _flat(qdy).T if qdy_t_NM is None else qdy_t_NM
    qx_t_KM = qx_MK.T if qx_t_KM is None else qx_t_KM
    return fp8_gemm_tn(qx_t_KM, sx, qdy_t_NM, sdy, jnp.float32, power_2, fast)


def _power_2(options) -> bool:
    return bool(dict(options).get("power_2_scale", False))


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


def _delayed_scales(scales, options):
    # With power_2_scale the state's scales are already powers of two (state.py rounds them);
    # rounding again here is a no-op then, and keeps the BF16 GEMM form exact for scales that
    # are not (a state initialised or restored by other code, scales passed in by a caller).
    return F.power_2_floor(scales) if _power_2(options) else scales


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
    return fp8_delayed_forward_quantized(qx, _amax(x), x.dtype, w, options, scales)


def fp8_delayed_scales(options, scales) -> jax.Array:
    """The (x, w, dY) scales a step quantizes with, from the layer's delayed-scaling state."""
    return _delayed_scales(scales, options)


def fp8_delayed_forward_quantized(qx, amax_x, x_dtype, w, options, scales):
    """``fp8_delayed_forward`` for x already quantized with ``fp8_delayed_scales(...)[0]`` by
    its producer, which also reports ``amax_x``, the max of |x| in ``x_dtype`` (the dtype the
    BF16 path would have handed the recipe, and the dtype of dx)."""
    s = _delayed_scales(scales, options)  # kept for the backward pass as used here
    y, (qx_MK, qw) = _fp8_forward_quantized(qx, s[0], w, s[1], _power_2(options), fast_accumulation(options).forward)
    amax_xw = jnp.stack([jnp.asarray(amax_x, jnp.float32), _amax(w)])
    return y, (qx_MK, qw, s, amax_xw, _dtype_token(x_dtype))


def fp8_delayed_dy_scale(residuals) -> jax.Array:
    """The scale dY is quantized with: ``qdy = fp8_e5m2(clip(dY * scale))``."""
    return residuals[2][2]


def fp8_delayed_x_scale(residuals) -> jax.Array:
    """The scale x was quantized with in the forward (``fp8_delayed_scales(...)[0]``)."""
    return residuals[2][0]


def fp8_delayed_quantize_dy(residuals, dy) -> tuple[jax.Array, jax.Array]:
    """``(qdy, amax)``: the BF16 gradient dy in E5M2 with ``fp8_delayed_dy_scale``, and max |dy|."""
    return F.quantize_fp8(dy, fp8_delayed_dy_scale(residuals), F.FP8_E5M2), _amax(dy)


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
    _, qw, s, _, x_token = residuals
    return _fp8_dgrad(qdy, s[2], qw, s[1], _power_2(options), fast_accumulation(options).backward
                      ).astype(x_token.dtype)


def fp8_delayed_wgrad(options, residuals, qdy, amax_dy, qdy_t_NM=None, qx_t_KM=None):
    """``(dw, amaxes)``, the rest of ``fp8_delayed_backward_quantized``; ``qx_t_KM``: x as quantized
    in the forward, stored transposed ([K, M]) by the code that also produced it."""
    qx, _, s, amax_xw, _ = residuals
    dw = _fp8_wgrad(qdy, s[2], qx, s[0], _power_2(options), fast_accumulation(options).backward, qdy_t_NM, qx_t_KM)
    # The scales' "gradient" is this step's amaxes (x, w, dY): see the module docstring.
    return dw, jnp.concatenate([amax_xw, jnp.asarray(amax_dy, jnp.float32)[None]])


_fp8_delayed.defvjp(_fp8_delayed_fwd, _fp8_delayed_bwd)


def fp8_delayed_dot(x, w, options=(), scales=None, key=None):
    """Per-tensor FP8 with scales from earlier steps' amaxes (Transformer Engine DelayedScaling,
    HYBRID: E4M3 for x and w, E5M2 for dY)."""
    if scales is None:
        raise ValueError("fp8_delayed needs its scaling state (scales f32[3])")
    return _fp8_delayed(x, w, options, scales, key)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _fp8_current(x, w, power_2, accumulation):
    return _fp8_current_fwd(x, w, power_2, accumulation)[0]


def _fp8_current_fwd(x, w, power_2, accumulation):
    sx = F.scale_from_amax(_amax(x), F.FP8_E4M3, power_2=power_2)
    sw = F.scale_from_amax(_amax(w), F.FP8_E4M3, power_2=power_2)
    y, (qx, qw) = _fp8_forward(x, w, sx, sw, power_2, accumulation.forward)
    return y, (qx, qw, sx, sw, _dtype_token(x.dtype))


def _fp8_current_bwd(power_2, accumulation, res, dy):
    qx, qw, sx, sw, x_token = res
    sdy = F.scale_from_amax(_amax(dy), F.FP8_E5M2, power_2=power_2)
    dx, dw = _fp8_backward(dy, sdy, qx, sx, qw, sw, power_2, accumulation.backward)
    return dx.astype(x_token.dtype), dw


_fp8_current.defvjp(_fp8_current_fwd, _fp8_current_bwd)


def fp8_current_dot(x, w, options=(), scales=None, key=None):
    """Per-tensor FP8 with each scale from the tensor's own current amax (no state)."""
    del scales, key
    return _fp8_current(x, w, _power_2(options), fast_accumulation(options))


# ----------------------------------------------------------------------------- NVFP4


def block_scaled_fp4_available() -> bool:
    """True on NVIDIA Blackwell (compute capability 10 and up), where cuDNN runs block-scaled FP4
    GEMMs behind ``jax.nn.scaled_matmul``; Hopper and CPU emulate."""
    device = jax.devices()[0]
    try:
        return device.platform == "gpu" and float(getattr(device, "compute_capability", 0)) >= 10.0
    except (TypeError, ValueError):
        return False


def _row_block_scales(q: F.NVFP4Array) -> jax.Array:
    """E4M3 scales per row and 16-block of K: a 2D 16x16 tile's scale covers its 16 rows."""
    return jnp.repeat(q.block_scales, F.NVFP4_BLOCK, axis=-2) if q.two_d else q.block_scales


def nvfp4_gemm_tn(a: F.NVFP4Array, b: F.NVFP4Array, block_scaled: bool | None = None,
                  out_dtype=COMPUTE_DTYPE) -> jax.Array:
    """``a[M,K] @ b[N,K]^T`` of two NVFP4 tensors blocked along K, ``out_dtype`` out (BF16).

    Blackwell: the FP4 elements and E4M3 block scales go to cuDNN's block-scaled GEMM. Elsewhere:
    ``q * s`` has at most 6 significant bits, so the block-dequantized operands are exact in
    BF16, and a BF16 GEMM with FP32 accumulation computes the same product up to summation
    order. Either way the two FP32 global decode scales multiply the FP32 result, one after
    the other: their product can underflow where a tensor's amax is tiny (formats: S_dec
    down to 2^-126). ``block_scaled`` forces one path (None: the device decides).
    """
    if block_scaled_fp4_available() if block_scaled is None else block_scaled:
        y = jax.nn.scaled_matmul(a.elements[None], b.elements[None], _row_block_scales(a)[None],
                                 _row_block_scales(b)[None], preferred_element_type=jnp.float32)[0]
    else:
        y = jax.lax.dot_general(a.block_dequantize(COMPUTE_DTYPE), b.block_dequantize(COMPUTE_DTYPE),
                                TN, preferred_element_type=jnp.float32)
    return ((y * a.global_decode_scale) * b.global_decode_scale).astype(out_dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _nvfp4(x, w, options, key):
    return _nvfp4_fwd(x, w, options, key)[0]


def _nvfp4_fwd(x, w, options, key):
    opts = dict(options)
    # x stays in its own (BF16) dtype, here and in the residuals: the quantizer widens it to
    # FP32 inside its fusions, so no FP32 copy of an activation is written (same values).
    x_MK = _flat(x)
    qx = F.quantize_nvfp4(x_MK, two_d=False)
    # Weights: 16x16 tiles, so W and W^T quantize to the same values and dgrad reuses them.
    two_d = bool(opts["weight_2d"])
    qw_NK = F.quantize_nvfp4(w.T, two_d=two_d)
    y = nvfp4_gemm_tn(qx, qw_NK).reshape(*x.shape[:-1], w.shape[1])
    return y, (checkpoint_name(x_MK, GEMM_IN), w if not two_d else None, checkpoint_name(qw_NK, GEMM_WEIGHT), key)


def _nvfp4_bwd(options, res, dy):
    opts = {**NVFP4_DEFAULTS, **dict(options)}  # options written before rht_bf16 existed
    x_MK, w, qw_NK, key = res
    # dY stays BF16 as it arrives: widening it here made XLA write FP32 copies of dY (and of
    # its transpose) for the three quantizations to read. Each widens inside its own fusion.
    dy_MN = _flat(dy)
    sr = bool(opts["stochastic_rounding"])
    k_dgrad, k_wgrad = jax.random.split(key) if (sr and key is not None) else (None, None)

    # dgrad: dY[M,N] blocked along N times W^T[K,N] blocked along N.
    qdy = F.quantize_nvfp4(dy_MN, key=k_dgrad)
    qw_KN = F.NVFP4Array(qw_NK.elements.T, jnp.swapaxes(qw_NK.block_scales, -1, -2),
                         qw_NK.global_decode_scale, True) if w is None else F.quantize_nvfp4(w)
    dx = nvfp4_gemm_tn(qdy, qw_KN)

    dw = nvfp4_wgrad(x_MK, dy_MN, bool(opts["rht"]), k_wgrad, rht_bf16=bool(opts["rht_bf16"]))
    return dx.reshape(*dy.shape[:-1], x_MK.shape[1]).astype(x_MK.dtype), dw, None


def nvfp4_wgrad(x_MK: jax.Array, dy_MN: jax.Array, rht: bool, key: jax.Array | None,
                block_scaled: bool | None = None, kernels: bool | None = None,
                rht_bf16: bool = True) -> jax.Array:
    """dW[K, N] = X^T dY in FP32, contracting over the tokens M, both operands NVFP4 with blocks
    of 16 tokens; ``key`` rounds dY stochastically. With ``rht`` the 16-point Hadamard transform
    along M spreads outliers first (H^T H = I, so the product is unchanged); ``rht_bf16`` rounds
    the transform to BF16 before it is quantized, as Transformer Engine's kernel does.
    The FP32 accumulation leaves unrounded: the weight gradient is FP32 (DESIGN.md).

    Blackwell's FP4 GEMM needs both operands K-major, so they are quantized as [K, M] and
    [N, M]. Emulated, the same values (bit for bit) are formed in the activations' own [M, K]
    and [M, N] layout and the BF16 GEMM contracts over their first axis: transposing the two
    activations cost ~10% of dense-1p3b's emulated NVFP4 step (2026-11-25). With
    ``rht`` the emulated operands come from the Pallas kernels of ``rht_kernel`` (same bits).
    ``block_scaled`` and ``kernels`` force one path each (None: the device decides).
    """
    if block_scaled_fp4_available() if block_scaled is None else block_scaled:
        if rht:
            x_MK, dy_MN = _hadamard_tokens(x_MK, rht_bf16), _hadamard_tokens(dy_MN, rht_bf16)
        return nvfp4_gemm_tn(F.quantize_nvfp4(x_MK.T), F.quantize_nvfp4(dy_MN.T, key=key), block_scaled=True,
                             out_dtype=jnp.float32)
    gpu = on_gpu()
    mesh, row_axes = batch_split()
    if kernels is None:
        # XLA cannot partition a kernel: on a mesh it would gather the whole operands onto every
        # device. The kernels run per device when the step is traced under a mesh whose only
        # split axes are the ones splitting the tokens (maxfp4.train traces it so).
        kernels = gpu and (jax.device_count() == 1 or (mesh is not None and splits_only(mesh, row_axes)))
    v_x, s_x = _emulated_wgrad_operand(x_MK, rht, None, kernels, not gpu, mesh, row_axes, rht_bf16)
    v_dy, s_dy = _emulated_wgrad_operand(dy_MN, rht, key, kernels, not gpu, mesh, row_axes, rht_bf16)
    dw = jax.lax.dot_general(v_x, v_dy, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (dw * s_x) * s_dy


def _hadamard_tokens(a_MK: jax.Array, rht_bf16: bool) -> jax.Array:
    """The Hadamard transform down the tokens, FP32 (rounded to BF16 values with ``rht_bf16``:
    integer operations that fuse into the quantizer's passes)."""
    h_MK = F.hadamard16(a_MK, axis=0)
    return F.round_bf16(h_MK) if rht_bf16 else h_MK


def _emulated_wgrad_operand(a_MK: jax.Array, rht: bool, key: jax.Array | None, kernels: bool, interpret: bool,
                            mesh=None, row_axes: tuple[str, ...] = (), rht_bf16: bool = True):
    """(block-dequantized BF16 values in a's layout, S_dec) of one emulated wgrad operand."""
    if rht and kernels and rht_columns_supported(*a_MK.shape, split_size(mesh, row_axes)):
        return hadamard_block_dequantize_nvfp4_columns(a_MK, key, COMPUTE_DTYPE, interpret, mesh=mesh,
                                                       row_axes=row_axes, rht_bf16=rht_bf16)
    if rht:
        a_MK = _hadamard_tokens(a_MK, rht_bf16)
    return F.block_dequantize_nvfp4_columns(a_MK, key=key, dtype=COMPUTE_DTYPE)


_nvfp4.defvjp(_nvfp4_fwd, _nvfp4_bwd)


def nvfp4_dot(x, w, options=(), scales=None, key=None):
    """NVIDIA's NVFP4 training recipe (arXiv 2509.25149), emulated exactly on Hopper and CPU."""
    del scales
    opts = dict(options)
    if opts["stochastic_rounding"] and key is None:
        raise ValueError("nvfp4 with stochastic_rounding needs a PRNG key")
    return _nvfp4(x, w, options, key)


# ----------------------------------------------------------------------------- defaults

# rht_bf16: the Hadamard-transformed wgrad operands are rounded to BF16 before quantization, as
# Transformer Engine's RHT cast kernel does (false: quantize the FP32 transform).
NVFP4_DEFAULTS = {"rht": True, "stochastic_rounding": True, "weight_2d": True, "rht_bf16": True}
# power_2_scale: scales rounded down to powers of two (Transformer Engine's QParams.power_2_scale),
# which lets the FP8 GEMMs write BF16 outputs exactly (fp8_gemm_tn).
# fast_accumulation: Hopper's fast FP8 accumulation for fprop, the precise (split) one for dgrad
# and wgrad, as Transformer Engine does (its GEMMs' use_split_accumulator); docs/PRECISION.md.
FAST_ACCUMULATION_DEFAULT = {"forward": True, "backward": False}
FP8_DELAYED_DEFAULTS = {"amax_history": 1024, "margin": 0, "amax_algo": "max", "power_2_scale": False,
                        "fast_accumulation": FAST_ACCUMULATION_DEFAULT}
FP8_CURRENT_DEFAULTS = {"power_2_scale": False, "fast_accumulation": FAST_ACCUMULATION_DEFAULT}


# The hooks through which a layer stores FP8 delayed-scaling operands from its own kernels.
FP8_DELAYED_FUSED = FusedOperands(
    recipe="fp8_delayed", x_format=F.FP8_E4M3, dy_format=F.FP8_E5M2, forward=fp8_delayed_forward,
    scales_of=fp8_delayed_scales, forward_quantized=fp8_delayed_forward_quantized, dy_scale=fp8_delayed_dy_scale,
    x_scale=fp8_delayed_x_scale, quantize_dy=fp8_delayed_quantize_dy, backward=fp8_delayed_backward,
    backward_quantized=fp8_delayed_backward_quantized, dgrad=fp8_delayed_dgrad, wgrad=fp8_delayed_wgrad)

