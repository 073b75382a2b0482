"""Comparison recipes: OCP Microscaling (``mxfp8``, ``mxfp4``) and DeepSeek-V3's block FP8.

These exist to compare NVFP4 against the other published low-precision training formats on the
same model and data. They are emulations for numerics studies: they compute what the format
computes (up to summation order) but at BF16/FP32 GEMM speed on Hopper and CPU, not at FP8/FP4
speed. Same signature and conventions as :mod:`maxfp4.precision.recipes`:
``fn(x[..., K], w[K, N], options, scales, key) -> y[..., N]`` (BF16), a ``jax.custom_vjp`` over
``x`` and ``w``; the weight gradient leaves in FP32, the input gradient in ``x``'s dtype. They
keep no state and round to nearest even only, so ``options``, ``scales`` and ``key`` are ignored.

Every linear layer makes three GEMMs; dimension letters M tokens, K input, N output features:

=======  =====================  ==========================  ============================
GEMM     formula                operand A (blocked along)   operand B (blocked along)
=======  =====================  ==========================  ============================
fprop    ``Y  = X W``           X[M,K]    (K)               W[K,N]    (K)
dgrad    ``dX = dY W^T``        dY[M,N]   (N)               W[K,N]    (N)
wgrad    ``dW = X^T dY``        X^T[K,M]  (M)               dY^T[N,M] (M)
=======  =====================  ==========================  ============================

Every operand is blocked along the contraction dimension of the GEMM it enters, so the block
sizes constrain M, K and N (see each recipe). M is checked only when the call is differentiated
(the forward pass alone never blocks along M).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxfp4.precision import formats as F
from maxfp4.precision.recipes import COMPUTE_DTYPE, GEMM_IN, TN, _dtype_token, _flat

# ----------------------------------------------------------------------------- OCP MX

_MX_ELEMENT = {"mxfp8": F.FP8_E4M3, "mxfp4": F.FP4_E2M1}


def _check_multiple(name: str, what: str, size: int, block: int, shape) -> None:
    if size % block:
        raise ValueError(f"{name}: {what} ({size}) of shape {tuple(shape)} must be a multiple of {block}")


def mx_gemm_tn(a: F.MXArray, b: F.MXArray) -> jax.Array:
    """``a[M,K] @ b[N,K]^T`` of two MX tensors blocked along K; FP32 result.

    The dequantized operands ``q * 2**e`` are exact in BF16, so a BF16 GEMM with FP32
    accumulation is the MX GEMM up to summation order:

    * E2M1 elements have at most 2 significant bits, E4M3 elements at most 4 (1 implicit + 3
      stored; subnormals fewer); BF16 holds 8. Multiplying by the power of two ``2**e`` adds no
      bits, so ``q * 2**e`` is exact in BF16 as long as it stays inside BF16's (= FP32's) normal
      exponent range.
    * Overflow is impossible: ``e = floor(log2(block_amax)) - emax_elem`` with ``block_amax`` a
      finite FP32, so ``|q| * 2**e <= max_elem * 2**(floor(log2(amax)) - emax_elem)``, which is
      ``1.75 * 2**floor(log2(amax)) < 2**128`` for E4M3 (448 = 1.75 * 2**8) and ``1.5 * ...``
      for E2M1 (6 = 1.5 * 2**2).
    * Underflow needs a tiny block: the smallest nonzero element is ``2**-9`` (E4M3 subnormal)
      or ``0.5`` (E2M1) times ``2**e``, i.e. at least ``2**(floor(log2(amax)) - 17)`` for MXFP8;
      that is a normal BF16 unless ``block_amax < 2**-109`` (~1.5e-33), far below any activation,
      weight or BF16 gradient a model produces. Below it the smallest elements would be flushed
      to zero (or rounded as BF16 subnormals), an absolute error under ``2**-126`` -- the same
      thing XLA on CPU does to FP32 subnormals anyway.
    """
    return jax.lax.dot_general(a.dequantize(COMPUTE_DTYPE), b.dequantize(COMPUTE_DTYPE), TN,
                               preferred_element_type=jnp.float32)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mx(x, w, name):
    return _mx_forward(x, w, name)  # undifferentiated: no residuals, no constraint on M


def _mx_forward(x, w, name):
    elem = _MX_ELEMENT[name]
    x_MK = _flat(x)
    qx = F.quantize_mx(x_MK.astype(jnp.float32), elem)  # X blocked along K
    qw_NK = F.quantize_mx(w.astype(jnp.float32).T, elem)  # W blocked along K
    y = mx_gemm_tn(qx, qw_NK).astype(COMPUTE_DTYPE)
    return y.reshape(*x.shape[:-1], w.shape[1])


def _mx_fwd(x, w, name):
    m = _flat(x).shape[0]
    _check_multiple(name, "the token count M (wgrad contracts over it)", m, F.MX_BLOCK, x.shape)
    # MX blocks are 1D, so W blocked along K (fprop) and along N (dgrad) are different
    # quantizations: keep W itself (FP32 master weights) and quantize it again in the backward.
    return _mx_forward(x, w, name), (checkpoint_name(_flat(x), GEMM_IN), w, _dtype_token(x.dtype))


def _mx_bwd(name, res, dy):
    x_MK, w, x_token = res
    elem = _MX_ELEMENT[name]
    dy_MN = _flat(dy).astype(jnp.float32)
    # dgrad: dY[M,N] blocked along N times W[K,N] blocked along N.
    qdy = F.quantize_mx(dy_MN, elem)
    qw_KN = F.quantize_mx(w.astype(jnp.float32), elem)
    dx = mx_gemm_tn(qdy, qw_KN).astype(COMPUTE_DTYPE)
    # wgrad: X^T[K,M] and dY^T[N,M], both blocked along M (tokens).
    qxt = F.quantize_mx(x_MK.astype(jnp.float32).T, elem)
    qdyt = F.quantize_mx(dy_MN.T, elem)
    dw = mx_gemm_tn(qxt, qdyt)  # FP32
    return dx.reshape(*dy.shape[:-1], x_MK.shape[1]).astype(x_token.dtype), dw


_mx.defvjp(_mx_fwd, _mx_bwd)


def _mx_dot(name, x, w):
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"{name}: expected x[..., K] and w[K, N], got {x.shape} and {w.shape}")
    _check_multiple(name, "the contraction dimension K", w.shape[0], F.MX_BLOCK, w.shape)
    _check_multiple(name, "the output dimension N (dgrad contracts over it)", w.shape[1], F.MX_BLOCK,
                    w.shape)
    return _mx(x, w, name)


def mxfp8_dot(x, w, options=(), scales=None, key=None):
    """OCP MXFP8 training (E4M3 elements for X, W and dY alike, as in the OCP MX training recipe):
    every operand of every GEMM in blocks of 32 along that GEMM's contraction dimension with an
    E8M0 power-of-two scale, round to nearest even. K, N and (when differentiated) M must be
    multiples of 32. Emulated as a BF16 GEMM of exactly dequantized operands (see
    :func:`mx_gemm_tn`); Blackwell has a native MXFP8 GEMM, Hopper and stock XLA do not."""
    del options, scales, key
    return _mx_dot("mxfp8", x, w)


def mxfp4_dot(x, w, options=(), scales=None, key=None):
    """OCP MXFP4 training: as :func:`mxfp8_dot` with E2M1 elements (no Hadamard transform, no
    stochastic rounding: the plain format, for comparison with ``nvfp4``)."""
    del options, scales, key
    return _mx_dot("mxfp4", x, w)


# ----------------------------------------------------------------------------- block FP8

FP8_BLOCK_TILE = 128


def quantize_fp8_tiles(x: jax.Array, tile_shape: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """E4M3 with one FP32 scale per tile of the last two axes (DeepSeek-V3 fine-grained FP8).

    ``tile_shape = (tr, tc)``: ``(1, 128)`` for activations and gradients (128 consecutive
    elements of a row), ``(128, 128)`` for weights. For each tile::

        scale = 448 / tile_amax         (div_rn; 1 for an all-zero or non-finite tile; FP32's
                                         max where the quotient overflows)
        q     = e4m3(clip(x * scale, -448, 448))   round to nearest even

    Returns ``(q, scales)``: ``q`` float8_e4m3fn of ``x``'s shape, ``scales`` float32 of shape
    ``x.shape[:-2] + (rows // tr, cols // tc)``. Raises ValueError unless the last two axes are
    multiples of the tile. ``q`` is pinned with an optimization barrier (XLA on GPU otherwise
    deletes an ``f32 -> fp8 -> f32`` round trip inside jit).
    """
    tr, tc = tile_shape
    if x.ndim < 2:
        raise ValueError(f"quantize_fp8_tiles: needs at least 2 dimensions, got shape {x.shape}")
    *lead, r, c = x.shape
    if r % tr or c % tc:
        raise ValueError(f"quantize_fp8_tiles: the last two dimensions ({r}, {c}) of shape "
                         f"{tuple(x.shape)} must be multiples of the tile {tuple(tile_shape)}")
    x_t = x.astype(jnp.float32).reshape(*lead, r // tr, tr, c // tc, tc)
    amax = jnp.max(jnp.abs(x_t), axis=(-3, -1))
    scales = F.scale_from_amax(amax, F.FP8_E4M3)  # div_rn(448, amax), zero/non-finite -> 1
    q_t = F.quantize_fp8(x_t, scales[..., :, None, :, None], F.FP8_E4M3)  # clip, cast, barrier
    return q_t.reshape(x.shape), scales


def dequantize_fp8_tiles(q: jax.Array, scales: jax.Array, tile_shape: tuple[int, int]) -> jax.Array:
    """``q * (1 / scale)`` per tile in FP32 (the reciprocal by :func:`formats.div_rn`, so every
    backend gives the same bits); float32 result of ``q``'s shape."""
    tr, tc = tile_shape
    *lead, r, c = q.shape
    inv = F.div_rn(1.0, scales)[..., :, None, :, None]
    q_t = q.astype(jnp.float32).reshape(*lead, r // tr, tr, c // tc, tc)
    return (q_t * inv).reshape(q.shape)


def qdq_fp8_tiles(x: jax.Array, tile_shape: tuple[int, int]) -> jax.Array:
    """Quantize with :func:`quantize_fp8_tiles` and dequantize again; float32 of ``x``'s shape."""
    q, s = quantize_fp8_tiles(x, tile_shape)
    return dequantize_fp8_tiles(q, s, tile_shape)


_ROW_TILE = (1, FP8_BLOCK_TILE)
_WEIGHT_TILE = (FP8_BLOCK_TILE, FP8_BLOCK_TILE)


def _f32_gemm_tn(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a[M,K] @ b[N,K]^T`` in FP32. Precision HIGHEST: on GPU an FP32 dot may otherwise run in
    TF32 (11 significant bits), far coarser than these FP32-scaled operands."""
    return jax.lax.dot_general(a, b, TN, precision=jax.lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)


@jax.custom_vjp
def _fp8_block(x, w):
    return _fp8_block_forward(x, w)[0]  # undifferentiated: no constraint on M


def _fp8_block_forward(x, w):
    x_MK = _flat(x)
    qx, sx = quantize_fp8_tiles(x_MK, _ROW_TILE)  # 1x128 tiles along K
    qw, sw = quantize_fp8_tiles(w, _WEIGHT_TILE)  # 128x128 blocks of W[K,N]
    w_deq = dequantize_fp8_tiles(qw, sw, _WEIGHT_TILE)
    y = _f32_gemm_tn(dequantize_fp8_tiles(qx, sx, _ROW_TILE), w_deq.T).astype(COMPUTE_DTYPE)
    return y.reshape(*x.shape[:-1], w.shape[1]), (qw, sw)


def _fp8_block_fwd(x, w):
    m = _flat(x).shape[0]
    _check_multiple("fp8_block", "the token count M (wgrad contracts over it)", m, FP8_BLOCK_TILE,
                    x.shape)
    y, (qw, sw) = _fp8_block_forward(x, w)
    # 128x128 weight blocks: W^T quantizes to the same values, so dgrad reuses (qw, sw).
    return y, (checkpoint_name(_flat(x), GEMM_IN), qw, sw, _dtype_token(x.dtype))


def _fp8_block_bwd(res, dy):
    x_MK, qw, sw, x_token = res
    dy_MN = _flat(dy).astype(jnp.float32)
    w_deq = dequantize_fp8_tiles(qw, sw, _WEIGHT_TILE)  # W[K,N]
    # dgrad: dY[M,N] in 1x128 tiles along N, times W^T (contract dim 1 of W[K,N]).
    qdy, sdy = quantize_fp8_tiles(dy_MN, _ROW_TILE)
    dx = _f32_gemm_tn(dequantize_fp8_tiles(qdy, sdy, _ROW_TILE), w_deq).astype(COMPUTE_DTYPE)
    # wgrad: X^T[K,M] and dY^T[N,M] in 1x128 tiles along M (tokens).
    qxt, sxt = quantize_fp8_tiles(x_MK.astype(jnp.float32).T, _ROW_TILE)
    qdyt, sdyt = quantize_fp8_tiles(dy_MN.T, _ROW_TILE)
    dw = _f32_gemm_tn(dequantize_fp8_tiles(qxt, sxt, _ROW_TILE),
                      dequantize_fp8_tiles(qdyt, sdyt, _ROW_TILE))
    return dx.reshape(*dy.shape[:-1], x_MK.shape[1]).astype(x_token.dtype), dw


_fp8_block.defvjp(_fp8_block_fwd, _fp8_block_bwd)


def fp8_block_dot(x, w, options=(), scales=None, key=None):
    """DeepSeek-V3's fine-grained FP8 (arXiv 2412.19437), current scaling, E4M3 everywhere
    (gradients too): activations and gradients in 1x128 tiles along the contraction dimension of
    the GEMM they enter, weights in 128x128 blocks, one FP32 scale ``448 / tile_amax`` per tile
    (see :func:`quantize_fp8_tiles`); operands dequantized by ``q * (1/scale)`` in FP32 and
    multiplied in FP32 (HIGHEST precision; the dequantized values are not exact in BF16, since
    the scales are arbitrary FP32 numbers).

    For numerics studies only: stock XLA has no fast Hopper path for per-tile scaled FP8 GEMMs
    (its cuBLASLt FP8 rewrite takes per-tensor scalar scales), so this runs at FP32 GEMM speed.
    K and N must be multiples of 128 (W's 128x128 blocks; K also for X's tiles, N for dY's in
    dgrad) and, when differentiated, the token count M too (wgrad's tiles run along M).
    """
    del options, scales, key
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_block: expected x[..., K] and w[K, N], got {x.shape} and {w.shape}")
    _check_multiple("fp8_block", "the contraction dimension K", w.shape[0], FP8_BLOCK_TILE, w.shape)
    _check_multiple("fp8_block", "the output dimension N", w.shape[1], FP8_BLOCK_TILE, w.shape)
    return _fp8_block(x, w)


MXFP8_DEFAULTS: dict = {}
MXFP4_DEFAULTS: dict = {}
FP8_BLOCK_DEFAULTS: dict = {}

__all__ = [
    "mxfp8_dot",
    "mxfp4_dot",
    "fp8_block_dot",
    "mx_gemm_tn",
    "quantize_fp8_tiles",
    "dequantize_fp8_tiles",
    "qdq_fp8_tiles",
    "FP8_BLOCK_TILE",
]
