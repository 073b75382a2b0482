"""DeepSeek-V3's fine-grained FP8 (arXiv 2412.19437): ``fp8_block``.

E4M3 everywhere, activations and gradients in 1x128 tiles along the contraction dimension of the
GEMM they enter, weights in 128x128 blocks, one FP32 scale per tile. Emulated at FP32 GEMM speed
for numerics studies (stock XLA has no per-tile scaled FP8 GEMM on Hopper).

Dimension letters: M tokens (batch x sequence), K input features, N output features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxfp4.precision import catalog
from maxfp4.precision import formats as F
from maxfp4.precision.recipes import COMPUTE_DTYPE, GEMM_IN, TN, Recipe, check_multiple, dtype_token, flat, unflat

FP8_BLOCK_TILE = catalog.FP8_BLOCK.block


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
    x_MK = flat(x)
    qx, sx = quantize_fp8_tiles(x_MK, _ROW_TILE)  # 1x128 tiles along K
    qw, sw = quantize_fp8_tiles(w, _WEIGHT_TILE)  # 128x128 blocks of W[K,N]
    w_deq = dequantize_fp8_tiles(qw, sw, _WEIGHT_TILE)
    y = _f32_gemm_tn(dequantize_fp8_tiles(qx, sx, _ROW_TILE), w_deq.T).astype(COMPUTE_DTYPE)
    return unflat(y, x.shape[:-1]), (qw, sw)


def _fp8_block_fwd(x, w):
    m = flat(x).shape[0]
    check_multiple("fp8_block", "the token count M (wgrad contracts over it)", m, FP8_BLOCK_TILE,
                    x.shape)
    y, (qw, sw) = _fp8_block_forward(x, w)
    # 128x128 weight blocks: W^T quantizes to the same values, so dgrad reuses (qw, sw).
    return y, (checkpoint_name(flat(x), GEMM_IN), qw, sw, dtype_token(x.dtype))


def _fp8_block_bwd(res, dy):
    x_MK, qw, sw, x_token = res
    dy_MN = flat(dy).astype(jnp.float32)
    w_deq = dequantize_fp8_tiles(qw, sw, _WEIGHT_TILE)  # W[K,N]
    # dgrad: dY[M,N] in 1x128 tiles along N, times W^T (contract dim 1 of W[K,N]).
    qdy, sdy = quantize_fp8_tiles(dy_MN, _ROW_TILE)
    dx = _f32_gemm_tn(dequantize_fp8_tiles(qdy, sdy, _ROW_TILE), w_deq).astype(COMPUTE_DTYPE)
    # wgrad: X^T[K,M] and dY^T[N,M] in 1x128 tiles along M (tokens).
    qxt, sxt = quantize_fp8_tiles(x_MK.astype(jnp.float32).T, _ROW_TILE)
    qdyt, sdyt = quantize_fp8_tiles(dy_MN.T, _ROW_TILE)
    dw = _f32_gemm_tn(dequantize_fp8_tiles(qxt, sxt, _ROW_TILE),
                      dequantize_fp8_tiles(qdyt, sdyt, _ROW_TILE))
    return unflat(dx, dy.shape[:-1]).astype(x_token.dtype), dw


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
    check_multiple("fp8_block", "the contraction dimension K", w.shape[0], FP8_BLOCK_TILE, w.shape)
    check_multiple("fp8_block", "the output dimension N", w.shape[1], FP8_BLOCK_TILE, w.shape)
    return _fp8_block(x, w)


FP8_BLOCK = Recipe(catalog.FP8_BLOCK, fp8_block_dot)
