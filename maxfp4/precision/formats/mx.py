"""OCP MX formats (microscaling v1.0; comparison recipes only)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maxfp4.precision.formats.arith import exp2_int
from maxfp4.precision.formats.dtypes import (E2M1_MAX, E4M3_MAX, E5M2_MAX, E8M0, FP4_E2M1, FP8_E4M3, FP8_E5M2,
                                             MX_BLOCK)
from maxfp4.precision.formats.e2m1 import round_e2m1
from maxfp4.precision.formats.nvfp4 import check_blockable, from_blocks, to_blocks


# element dtype -> (emax_elem, max_elem)
_MX_ELEMENTS = {
    np.dtype(FP8_E4M3): (8, E4M3_MAX),
    np.dtype(FP8_E5M2): (15, E5M2_MAX),
    np.dtype(FP4_E2M1): (2, E2M1_MAX),
}


@dataclasses.dataclass(frozen=True)
class MXArray:
    """An MX-quantized tensor (a pytree).

    elements:     the element dtype (float8_e4m3fn, float8_e5m2 or float4_e2m1fn), shape of x.
    block_scales: float8_e8m0fnu, ``x.shape[:-1] + (cols // 32,)``: the power of two ``2**e``,
                  ``e`` in [-127, 127] (biased exponent ``e + 127`` in the byte).
    """

    elements: jax.Array
    block_scales: jax.Array

    def scale_exponents(self) -> jax.Array:
        """The unbiased int32 exponents ``e`` of the block scales."""
        bits = jax.lax.bitcast_convert_type(self.block_scales, jnp.uint8)
        return bits.astype(jnp.int32) - 127

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``q * 2**e`` in float32, returned as ``dtype``."""
        q_blk = to_blocks(self.elements.astype(jnp.float32), False, MX_BLOCK)
        return _dequantize_blocks(q_blk, self.scale_exponents()).astype(dtype)


jax.tree_util.register_dataclass(MXArray, data_fields=["elements", "block_scales"], meta_fields=[])


def _mx_blocks(x: jax.Array, elem_dtype) -> tuple[jax.Array, jax.Array]:
    """The shared first half of :func:`quantize_mx` and :func:`qdq_mx`: ``(q_blk, e)``, the
    rounded elements in blocks of 32 (E2M1: float32 values on the grid; FP8: the FP8 array) and
    the int32 scale exponents, one a block."""
    key = np.dtype(elem_dtype)
    if key not in _MX_ELEMENTS:
        raise ValueError(f"quantize_mx: unsupported element dtype {elem_dtype}")
    emax, max_elem = _MX_ELEMENTS[key]
    check_blockable(tuple(x.shape), False, MX_BLOCK, "quantize_mx")

    x_blk = to_blocks(x.astype(jnp.float32), False, MX_BLOCK)
    block_amax = jnp.max(jnp.abs(x_blk), axis=-1)
    # floor(log2(amax)) is the unbiased exponent field of a normal float32: exact, unlike log2.
    biased = (jax.lax.bitcast_convert_type(block_amax, jnp.int32) >> 23) & 0xFF
    is_zero = biased == 0
    e = jnp.clip(biased - 127 - emax, -127, 127)
    e = jnp.where(is_zero, -127, e)

    # x * 2**-e: exact (2**-e is a normal float32 for e in [-127, 126]); zero blocks stay zero.
    y_blk = x_blk * jnp.where(is_zero, 0.0, exp2_int(jnp.minimum(-e, 127)))[..., None]
    y_blk = jnp.clip(y_blk, -max_elem, max_elem)
    if key == np.dtype(FP4_E2M1):
        return round_e2m1(y_blk), e  # exact arithmetic: nothing for XLA to fold
    return jax.lax.optimization_barrier(y_blk.astype(elem_dtype)), e  # pin the rounding against cast folding


def _dequantize_blocks(q_blk: jax.Array, e: jax.Array) -> jax.Array:
    """``q * 2**e`` in float32 from blocks of elements and their exponents."""
    # (q * 2**(e+1)) * 0.5: 2**(e+1) is a normal float32 for every e in [-127, 126], while
    # 2**-127 itself is subnormal (flushed to zero by XLA on CPU). Both products are exact.
    up = exp2_int(e + 1)[..., None]
    return from_blocks((q_blk.astype(jnp.float32) * up) * jnp.float32(0.5), False)


def quantize_mx(x: jax.Array, elem_dtype) -> MXArray:
    """OCP MX quantization: blocks of 32 along the last axis with an E8M0 power-of-two scale.

    ``e = clamp(floor(log2(block_amax)) - emax_elem, -127, 127)``, elements
    ``cast(clip(x / 2**e, -max_elem, max_elem))`` rounded to nearest even. A block with
    ``block_amax == 0`` (or below float32's smallest normal) gets ``e = -127`` and zero elements.
    ``elem_dtype``: float8_e4m3fn (MXFP8), float8_e5m2, or float4_e2m1fn (MXFP4).
    """
    q_blk, e = _mx_blocks(x, elem_dtype)
    if np.dtype(elem_dtype) == np.dtype(FP4_E2M1):
        q_blk = jax.lax.optimization_barrier(q_blk.astype(FP4_E2M1))  # exact: values are on the grid
    scales = jax.lax.bitcast_convert_type((e + 127).astype(jnp.uint8), E8M0)
    return MXArray(elements=from_blocks(q_blk, False), block_scales=scales)


def qdq_mx(x: jax.Array, elem_dtype) -> jax.Array:
    """``quantize_mx(x, elem_dtype).dequantize()``: float32, shape of ``x``, bit for bit.

    Computed without storing E2M1 elements: the training recipes call this, and XLA on GPU
    handles arrays of the 4-bit ``float4_e2m1fn`` type (two to a byte) far more slowly than the
    float32 grid values they hold exactly."""
    q_blk, e = _mx_blocks(x, elem_dtype)
    return _dequantize_blocks(q_blk, e)
