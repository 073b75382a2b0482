"""NVFP4: E2M1 elements, an E4M3 scale per 16, a float32 scale per tensor (the package docstring)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maxfp4.precision.formats.arith import div_rn
from maxfp4.precision.formats.dtypes import (DEC_SHIFT, DEC_SHIFT_BELOW, E2M1_MAX, E4M3_MAX, F32_MAX, FP4_E2M1,
                                             FP8_E4M3, NVFP4_BLOCK, NVFP4_S_ENC_MAX)
from maxfp4.precision.formats.e2m1 import round_e2m1
from maxfp4.precision.formats.random_bits import random_bytes


@dataclasses.dataclass(frozen=True)
class NVFP4Array:
    """An NVFP4-quantized tensor (a pytree; ``two_d`` is static).

    elements:            float4_e2m1fn, the shape of the original tensor.
    block_scales:        float8_e4m3fn; ``x.shape[:-1] + (cols // 16,)`` for 1D blocks,
                         ``x.shape[:-2] + (rows // 16, cols // 16)`` for 16x16 tiles.
    global_decode_scale: float32 scalar ``S_dec``.
    two_d:               whether the blocks are 16x16 tiles over the last two axes.
    """

    elements: jax.Array
    block_scales: jax.Array
    global_decode_scale: jax.Array
    two_d: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.elements.shape)

    def block_dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``q * f32(s)`` without the global scale. At most 6 significant bits with exponents in
        [-10, 12], so exact in bfloat16: a BF16 GEMM of these with FP32 accumulation followed by
        a multiply with both ``global_decode_scale``s is the NVFP4 GEMM up to summation order."""
        q_blk = to_blocks(self.elements.astype(jnp.float32), self.two_d)
        s_blk = _expand_scales(self.block_scales.astype(jnp.float32), self.two_d)
        return from_blocks(q_blk * s_blk, self.two_d).astype(dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``q * f32(s) * S_dec`` in float32 (in that order), returned as ``dtype``."""
        return (self.block_dequantize(jnp.float32) * self.global_decode_scale).astype(dtype)


jax.tree_util.register_dataclass(
    NVFP4Array,
    data_fields=["elements", "block_scales", "global_decode_scale"],
    meta_fields=["two_d"],
)


def check_blockable(shape: tuple[int, ...], two_d: bool, block: int, what: str) -> None:
    dims = 2 if two_d else 1
    if len(shape) < dims:
        raise ValueError(f"{what}: needs at least {dims} dimension(s), got shape {shape}")
    for d in shape[-dims:]:
        if d % block:
            raise ValueError(
                f"{what}: the blocked dimension(s) {shape[-dims:]} of shape {shape} must be "
                f"divisible by {block}"
            )


def to_blocks(x: jax.Array, two_d: bool, block: int = NVFP4_BLOCK) -> jax.Array:
    """(..., C) -> (..., C/b, b), or (..., R, C) -> (..., R/b, b, C/b, b) for tiles."""
    if two_d:
        *lead, r, c = x.shape
        return x.reshape(*lead, r // block, block, c // block, block)
    *lead, c = x.shape
    return x.reshape(*lead, c // block, block)


def from_blocks(x_blk: jax.Array, two_d: bool) -> jax.Array:
    if two_d:
        *lead, rb, b0, cb, b1 = x_blk.shape
        return x_blk.reshape(*lead, rb * b0, cb * b1)
    *lead, cb, b = x_blk.shape
    return x_blk.reshape(*lead, cb * b)


def _block_axes(two_d: bool) -> tuple[int, ...]:
    return (-3, -1) if two_d else (-1,)


def _expand_scales(scales: jax.Array, two_d: bool) -> jax.Array:
    """Stored scales -> a shape that broadcasts against the blocked tensor."""
    if two_d:
        return scales[..., :, None, :, None]
    return scales[..., None]


def quantize_nvfp4(
    x: jax.Array, *, two_d: bool = False, key: jax.Array | None = None
) -> NVFP4Array:
    """Quantize ``x`` to NVFP4 (see the module docstring for the exact arithmetic).

    Args:
      x: float array; the last axis (and with ``two_d`` the last two axes) divisible by 16.
      two_d: one scale per 16x16 tile over the last two axes (weights: W and W^T then quantize
        to the same values) instead of per 16 consecutive elements of the last axis.
      key: a JAX PRNG key; when given, elements are rounded stochastically (unbiased to 2^-9 of
        a grid step) instead of to nearest even. Scales do not depend on the key.

    The amax, and so ``S_enc``, is taken over the whole array, leading dimensions included.
    """
    check_blockable(tuple(x.shape), two_d, NVFP4_BLOCK, "quantize_nvfp4")
    x_blk = to_blocks(x.astype(jnp.float32), two_d)
    rand_bytes = None if key is None else random_bytes(key, x_blk.shape)
    q_blk, s_e4m3, s_dec = _quantize_blocks(x_blk, _block_axes(two_d), rand_bytes)
    return NVFP4Array(
        elements=from_blocks(q_blk, two_d).astype(FP4_E2M1),  # exact: values are on the grid
        block_scales=jnp.squeeze(s_e4m3, axis=_block_axes(two_d)),
        global_decode_scale=s_dec.astype(jnp.float32),
        two_d=two_d,
    )


def _quantize_blocks(x_blk: jax.Array, axes: tuple[int, ...], rand_bytes: jax.Array | None):
    """The NVFP4 arithmetic (module docstring) on a float32 array whose blocks span ``axes``:
    E2M1 values on the grid (float32, x_blk's shape), E4M3 block scales (``axes`` kept as 1s)
    and the float32 global decode scale."""
    block_amax = jnp.max(jnp.abs(x_blk), axis=axes, keepdims=True)
    s_e4m3, enc, s_dec = nvfp4_block_scales(block_amax)
    return round_e2m1(scale_to_e2m1_range(x_blk, enc), rand_bytes), s_e4m3, s_dec


def nvfp4_block_scales(block_amax: jax.Array, amax: jax.Array | None = None):
    """From the block amaxes of a tensor (any shape): its E4M3 block scales, the float32 factor
    ``enc`` that takes each block's elements to the E2M1 range (0 where the scale is 0), and the
    float32 global decode scale ``S_dec``. ``amax``: the whole tensor's amax, where
    ``block_amax`` holds only one device's blocks of it (default: their max)."""
    # The tensor's amax as the max of its block amaxes (exact: max is associative), so the
    # tensor is read once for both instead of once more for a whole-tensor reduction.
    amax = jnp.max(block_amax) if amax is None else amax
    # Divisions are div_rn (IEEE on every backend): a 1-ulp difference in a scale can flip the
    # rounding of an element or a block scale.
    s_enc = div_rn(E4M3_MAX * E2M1_MAX, amax)
    # amax == 0 and amax == inf (s_enc == 0) fall back to 1, as TE; a tiny amax (the quotient
    # overflows, or its reciprocal would be subnormal) gives NVFP4_S_ENC_MAX.
    s_enc = jnp.where((amax == 0) | (s_enc == 0), jnp.float32(1.0), jnp.minimum(s_enc, NVFP4_S_ENC_MAX))
    s_dec = div_rn(1.0, s_enc)
    # Exact power-of-two scaling: s * (S_dec 2^64) rounds as s * S_dec would were it normal.
    shift = jnp.where(s_dec < DEC_SHIFT_BELOW, jnp.float32(DEC_SHIFT), jnp.float32(1.0))
    # The barrier keeps XLA's simplifier from reassociating block_amax * (s_enc * (1/6)) into
    # (block_amax * s_enc) * (1/6), which rounds differently (and s * (s_dec * shift) likewise).
    # S_dec passes it too, so that what reads it (the GEMM outputs' scaling) reads this value
    # rather than a copy of the divisions that make it.
    block_enc, s_dec_shifted, shift, s_dec = jax.lax.optimization_barrier(
        (s_enc * jnp.float32(1.0 / E2M1_MAX), s_dec * shift, shift, s_dec)
    )

    s_f32 = jnp.minimum(block_amax * block_enc, jnp.float32(E4M3_MAX))
    # The barrier keeps XLA from folding the f32 -> e4m3 -> f32 round trip of the callers away.
    s_e4m3 = jax.lax.optimization_barrier(s_f32.astype(FP8_E4M3))

    # TE: fminf(1 / (s * S_dec), f32_max); a zero scale gives 1/0 = inf, hence f32_max. A block's
    # factor depends only on its scale's byte, so it is computed once for each of the 256 E4M3
    # codes and looked up by the byte: the same float32 operations on the same values, so the
    # same bits, but one exact division of 256 elements per tensor instead of one per block
    # inside the quantizer's fusions (the division is ~100 integer instructions; on an H200 the
    # 6-block NVFP4 step's XLA passes took 35.2 s with it there, 21.3 s with the table).
    # The barrier keeps the table a table: XLA would fuse its computation into the lookup,
    # which computes the looked-up entry, one division per block again.
    enc_of_code = jax.lax.optimization_barrier(
        jnp.minimum(div_rn(1.0, _E4M3_VALUES * s_dec_shifted) * shift, F32_MAX))
    codes = jax.lax.bitcast_convert_type(s_e4m3, jnp.uint8).astype(jnp.int32)
    enc = enc_of_code.at[codes].get(mode="promise_in_bounds")
    return s_e4m3, enc, s_dec


# Every E4M3 code's value in float32, indexed by the code's byte (NaN for the two NaN codes);
# NumPy, so that importing the module starts no JAX backend.
_E4M3_VALUES = np.arange(256, dtype=np.uint8).view(np.dtype(FP8_E4M3)).astype(np.float32)


def scale_to_e2m1_range(x: jax.Array, enc: jax.Array) -> jax.Array:
    """``clip(x * enc, -6, 6)``: one float32 multiply, then the clip."""
    return jnp.clip(x * enc, -E2M1_MAX, E2M1_MAX)


def block_dequantize_nvfp4_columns(x_MK: jax.Array, key: jax.Array | None = None,
                                   dtype=jnp.bfloat16) -> tuple[jax.Array, jax.Array]:
    """NVFP4 with blocks of 16 consecutive elements down axis 0 of ``x_MK``, in x's layout:
    ``(v_MK, S_dec)`` with ``v_MK = quantize_nvfp4(x_MK.T, key=key).block_dequantize(dtype).T``
    bit for bit (the random bits of stochastic rounding included: they are drawn for the
    [K, M] layout), without the transposes.

    For emulated GEMMs that contract over M (the weight gradient's tokens): a BF16 GEMM reads
    either layout, so the operand need not be moved into [K, M] as an FP4 GEMM's would be.
    """
    m, k = x_MK.shape
    check_blockable((k, m), False, NVFP4_BLOCK, "block_dequantize_nvfp4_columns")
    x_blk = x_MK.astype(jnp.float32).reshape(m // NVFP4_BLOCK, NVFP4_BLOCK, k)
    rand_bytes = None
    if key is not None:
        rand_bytes = random_bytes(key, (k, m // NVFP4_BLOCK, NVFP4_BLOCK)).transpose(1, 2, 0)
    q_blk, s_e4m3, s_dec = _quantize_blocks(x_blk, (-2,), rand_bytes)
    return (q_blk * s_e4m3.astype(jnp.float32)).reshape(m, k).astype(dtype), s_dec.astype(jnp.float32)


def qdq_nvfp4(x: jax.Array, *, two_d: bool = False, key: jax.Array | None = None) -> jax.Array:
    """``quantize_nvfp4(x, two_d=two_d, key=key).dequantize()``: float32, shape of ``x``."""
    return quantize_nvfp4(x, two_d=two_d, key=key).dequantize(jnp.float32)
