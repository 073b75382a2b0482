"""NVFP4: NVIDIA's NVFP4 training recipe (arXiv 2509.25149, Transformer Engine's NVFP4BlockScaling).

E2M1 elements in blocks of 16 along the contraction dimension with an E4M3 scale each and an
FP32 scale per tensor; 16x16 weight tiles, a 16-point Hadamard transform on the wgrad operands,
stochastic rounding of dY (docs/PRECISION.md). Emulated exactly on Hopper and CPU.

Dimension letters: M tokens (batch x sequence), K input features, N output features.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxfp4.kernels.launch import kernels_on_gpu, on_gpu
from maxfp4.kernels.rht import hadamard_block_dequantize_nvfp4_columns, rht_columns_supported
from maxfp4.parallel.mesh import batch_split, split_size, splits_only
from maxfp4.precision import catalog
from maxfp4.precision import formats as F
from maxfp4.precision.recipes.grouped import nvfp4_grouped
from maxfp4.precision.recipes import COMPUTE_DTYPE, GEMM_IN, GEMM_WEIGHT, TN, Recipe, flat, unflat

NVFP4_DEFAULTS = catalog.NVFP4.defaults


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
    x_MK = flat(x)
    qx = F.quantize_nvfp4(x_MK, two_d=False)
    # Weights: 16x16 tiles, so W and W^T quantize to the same values and dgrad reuses them.
    two_d = bool(opts["weight_2d"])
    qw_NK = F.quantize_nvfp4(w.T, two_d=two_d)
    y = unflat(nvfp4_gemm_tn(qx, qw_NK), x.shape[:-1])
    return y, (checkpoint_name(x_MK, GEMM_IN), w if not two_d else None, checkpoint_name(qw_NK, GEMM_WEIGHT), key)


def _nvfp4_bwd(options, res, dy):
    opts = {**NVFP4_DEFAULTS, **dict(options)}  # options written before rht_bf16 existed
    x_MK, w, qw_NK, key = res
    # dY stays BF16 as it arrives: widening it here made XLA write FP32 copies of dY (and of
    # its transpose) for the three quantizations to read. Each widens inside its own fusion.
    dy_MN = flat(dy)
    sr = bool(opts["stochastic_rounding"])
    k_dgrad, k_wgrad = jax.random.split(key) if (sr and key is not None) else (None, None)

    # dgrad: dY[M,N] blocked along N times W^T[K,N] blocked along N.
    qdy = F.quantize_nvfp4(dy_MN, key=k_dgrad)
    qw_KN = F.NVFP4Array(qw_NK.elements.T, jnp.swapaxes(qw_NK.block_scales, -1, -2),
                         qw_NK.global_decode_scale, True) if w is None else F.quantize_nvfp4(w)
    dx = nvfp4_gemm_tn(qdy, qw_KN)

    dw = nvfp4_wgrad(x_MK, dy_MN, bool(opts["rht"]), k_wgrad, rht_bf16=bool(opts["rht_bf16"]))
    return unflat(dx, dy.shape[:-1]).astype(x_MK.dtype), dw, None


def nvfp4_wgrad(x_MK: jax.Array, dy_MN: jax.Array, rht: bool, key: jax.Array | None,
                block_scaled: bool | None = None, kernels: bool | None = None,
                rht_bf16: bool = True) -> jax.Array:
    """dW[K, N] = X^T dY in FP32, contracting over the tokens M, both operands NVFP4 with blocks
    of 16 tokens; ``key`` rounds dY stochastically. With ``rht`` the 16-point Hadamard transform
    along M spreads outliers first (H^T H = I, so the product is unchanged); ``rht_bf16`` rounds
    the transform to BF16 before it is quantized, as Transformer Engine's kernel does.
    The FP32 accumulation leaves unrounded: the weight gradient is FP32 (docs/PRECISION.md).

    Blackwell's FP4 GEMM needs both operands K-major, so they are quantized as [K, M] and
    [N, M]. Emulated, the same values (bit for bit) are formed in the activations' own [M, K]
    and [M, N] layout and the BF16 GEMM contracts over their first axis: transposing the two
    activations cost ~10% of dense-1p3b's emulated NVFP4 step (2026-11-25). With
    ``rht`` the emulated operands come from the Pallas kernels of ``maxfp4.kernels.rht`` (same bits).
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
        kernels = kernels_on_gpu() and (jax.device_count() == 1 or (mesh is not None and splits_only(mesh, row_axes)))
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


NVFP4 = Recipe(catalog.NVFP4, nvfp4_dot, grouped=nvfp4_grouped)
