"""FP8 with per-tensor scales (Transformer Engine semantics; the package docstring states them)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxfp4.precision.formats.arith import div_rn, exp2_int
from maxfp4.precision.formats.dtypes import F32_MAX


def fp8_max(dtype) -> float:
    """Largest finite value of a narrow float dtype: 448 for E4M3, 57344 for E5M2, 6 for E2M1."""
    return float(jnp.finfo(dtype).max)


def power_2_floor(scale) -> jax.Array:
    """``2**floor(log2(scale))`` for positive normal float32 ``scale``: its significand bits
    cleared, as Transformer Engine's ``force_pow_2_scales``. Idempotent; 1.0 stays 1.0.

    A power-of-two scale makes ``1/scale`` exact in BF16, so the FP8 GEMM can take its inverse
    scales as BF16 operand factors and write a BF16 output (see ``recipes.fp8_gemm_tn``).
    """
    bits = jax.lax.bitcast_convert_type(jnp.asarray(scale, jnp.float32), jnp.uint32)
    floor = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFF800000), jnp.float32)
    # A subnormal scale (an amax above fp8_max * 2**126) would clear to zero: keep the smallest
    # normal instead, so nothing quantizes to zero by accident.
    return jnp.maximum(floor, jnp.float32(np.finfo(np.float32).tiny))


def scale_from_amax(amax, fp8_dtype, margin=0, old_scale=None, power_2=False) -> jax.Array:
    """Transformer Engine's scale update: ``(fp8_max / amax) / 2**margin`` as float32.

    A zero, negative or non-finite ``amax`` keeps ``old_scale`` (1.0 when None), so an all-zero
    or diverged step does not wreck the scale. An ``amax`` so small that the quotient overflows
    gives float32's max instead of inf (as Transformer Engine does), so ``0 * scale`` stays 0.
    Works elementwise on arrays of amaxes; ``fp8_dtype`` may be a sequence of dtypes, one for
    each entry of the last axis. ``margin`` is an integer (Python or traced).
    ``power_2``: round the new scale down to a power of two (:func:`power_2_floor`).
    """
    amax = jnp.asarray(amax, jnp.float32)
    if isinstance(fp8_dtype, (tuple, list)):
        top = jnp.asarray([fp8_max(d) for d in fp8_dtype], jnp.float32)
    else:
        top = fp8_max(fp8_dtype)
    old = jnp.ones_like(amax) if old_scale is None else jnp.asarray(old_scale, jnp.float32)
    if isinstance(margin, (int, np.integer)):
        pow2 = jnp.float32(2.0 ** -int(margin))
    else:  # a traced integer margin: build 2**-margin from exponent bits (exp2 may be inexact)
        pow2 = exp2_int(-jnp.asarray(margin, jnp.int32))
    new = div_rn(top, amax) * pow2
    new = jnp.where(jnp.isinf(new), jnp.float32(F32_MAX), new)
    if power_2:
        new = power_2_floor(new)
    keep = ~(jnp.isfinite(amax) & (amax > 0))
    return jnp.where(keep, old, new).astype(jnp.float32)


def quantize_fp8(x: jax.Array, scale, dtype) -> jax.Array:
    """``fp8(clip(x * scale, -max, max))``, round to nearest even; returns an array of ``dtype``.

    The result is pinned with an optimization barrier: with ``xla_allow_excess_precision`` XLA may
    otherwise fold a later ``f32 -> fp8 -> f32`` round trip into the identity.
    """
    return jax.lax.optimization_barrier(cast_fp8(x, scale, dtype))


def cast_fp8(x: jax.Array, scale, dtype) -> jax.Array:
    """``quantize_fp8`` without its barrier, for code that XLA's simplifier never sees (a Pallas
    kernel body, which stores FP8 with the same formula)."""
    m = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32), -m, m).astype(dtype)


def dequantize_fp8(q: jax.Array, scale, dtype=jnp.float32) -> jax.Array:
    """``q / scale``, computed as ``q * (1 / scale)`` in float32 and returned as ``dtype``.

    Transformer Engine's ``q * scale_inv``. The reciprocal is correctly rounded (:func:`div_rn`)
    and the product is one float32 multiply, so the result is the same on every backend (a
    plain ``q / scale`` is rewritten by XLA into a multiply by an approximate reciprocal anyway).
    """
    scale_inv = div_rn(1.0, scale)
    return (q.astype(jnp.float32) * scale_inv).astype(dtype)


def qdq_fp8(x: jax.Array, scale, dtype) -> jax.Array:
    """Quantize to ``dtype`` with ``scale`` and dequantize again; float32 result."""
    return dequantize_fp8(quantize_fp8(x, scale, dtype), scale, jnp.float32)
