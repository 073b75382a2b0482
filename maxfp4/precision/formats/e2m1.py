"""Rounding to E2M1 (arithmetic on float32, then an exact cast) and to BF16."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxfp4.precision.formats.random_bits import SR_BITS


def _round_half_even(v: jax.Array) -> jax.Array:
    """Non-negative float32 ``v`` rounded to the nearest integer, ties to even, from ``floor``
    and exact arithmetic only, so the Pallas kernels (whose Triton lowering has no ``round``)
    compute it with the same code."""
    lo = jnp.floor(v)
    d = v - lo  # exact
    odd = jnp.floor(lo * 0.5) * 2.0 != lo
    return lo + ((d > 0.5) | ((d == 0.5) & odd)).astype(jnp.float32)


def round_bf16(x: jax.Array) -> jax.Array:
    """float32 ``x`` rounded to the nearest BF16 value (ties to even), as float32: what
    ``x.astype(bfloat16).astype(float32)`` computes, in integer operations on the bits. XLA may
    drop a float round trip (``xla_allow_excess_precision``) but not these, and a Pallas kernel
    runs the same code. Finite inputs only (the quantizers' inputs); overflow gives inf."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    half = jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))  # below half, plus 1 on odd: ties to even
    return jax.lax.bitcast_convert_type((bits + half) & jnp.uint32(0xFFFF0000), jnp.float32)


def _copysign(v: jax.Array, y: jax.Array) -> jax.Array:
    """``|v|`` with the sign bit of ``y`` (float32), as bit operations (-0.0 keeps its sign)."""
    bits = jax.lax.bitcast_convert_type
    sign = bits(y, jnp.uint32) & jnp.uint32(0x80000000)
    return bits(bits(v, jnp.uint32) | sign, jnp.float32)


def round_e2m1(y: jax.Array, rand_bytes: jax.Array | None = None) -> jax.Array:
    """Round float32 ``y`` (already clipped to [-6, 6]) onto the E2M1 grid; float32 result.

    The grid spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], so ``|y| / step`` is an exact
    float32 and the E2M1 mantissa is even exactly when that integer is even: half-to-even
    rounding of ``|y| / step`` is E2M1 round-to-nearest-even (0.25 -> 0, 0.75 -> 1, 1.75 -> 2,
    2.5 -> 2, 5 -> 4).

    With ``rand_bytes`` (uniform integers in [0, 256), same shape) it rounds stochastically: up
    with probability ``t / 256``, ``t = round(frac * 256)`` (half to even), where
    ``frac = (|y| - lo) / step`` is the position between the neighbours ``lo < |y| < lo + step``.
    So ``|E[q] - y| <= 2^-9 * step``. Eight bits an element is the entropy Blackwell's
    ``cvt.rs.satfinite.e2m1x4.f32`` spends (one 32-bit word per four E2M1 values), and it costs
    a quarter of the generator's work of one 32-bit draw per element. Rounding ``frac * 256``
    to nearest halves the worst bias of a truncation (which would also lose every fraction below
    2^-8) and leaves fractions below 2^-9 of a step on ``lo``, as nearest rounding would. Every
    operation here is exact, so the result does not depend on the backend.
    """
    a = jnp.abs(y)
    step = jnp.where(a < 2.0, 0.5, jnp.where(a < 4.0, 1.0, 2.0)).astype(jnp.float32)
    inv_step = jnp.where(a < 2.0, 2.0, jnp.where(a < 4.0, 1.0, 0.5)).astype(jnp.float32)
    k = a * inv_step  # exact: multiplying by a power of two (no division, whatever the backend)
    if rand_bytes is None:
        k = _round_half_even(k)
    else:
        lo = jnp.floor(k)
        # frac * 256 is exact (power-of-two scale); its rounding is an integer in [0, 256].
        threshold = _round_half_even((k - lo) * jnp.float32(2.0**SR_BITS)).astype(jnp.uint32)
        k = lo + (rand_bytes < threshold).astype(jnp.float32)
    return _copysign(k * step, y)
