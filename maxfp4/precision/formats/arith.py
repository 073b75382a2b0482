"""Exact float32 arithmetic the formats need: correctly rounded division and powers of two."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def reciprocal_from_below(mb: jax.Array) -> jax.Array:
    """A float32 underestimate of ``1 / mb`` for integers ``mb`` in [2^23, 2^24), within a
    relative 2^-8 of it, from multiplies and subtracts only (no division, whose accuracy
    varies by backend): the minimax line through [0.5, 1) (relative error below 1/17), one
    Newton step (which squares the error and, in exact arithmetic, lands below the reciprocal),
    then 2^-20 less to cover the steps' float roundings (a few 2^-24) and any fused
    multiply-add a backend forms."""
    m = mb.astype(jnp.float32) * jnp.float32(2.0 ** -24)  # in [0.5, 1), exact
    x = jnp.float32(48.0 / 17.0) - jnp.float32(32.0 / 17.0) * m
    x = x * (jnp.float32(2.0) - m * x)
    return x * jnp.float32(2.0 ** -24 * (1.0 - 2.0 ** -20))


@jax.jit
def div_rn(a, b) -> jax.Array:
    """IEEE round-to-nearest-even float32 ``a / b``, identical on every backend.

    XLA on GPU lowers float32 division to PTX ``div.full`` (up to 2 ulp off: on an H200 with
    jax 0.11.2 about a quarter of random quotients differed from IEEE), and its algebraic
    simplifier (on every backend) rewrites divisions
    (``x / broadcast(s)`` -> ``x * (1/s)``, ``1 / (c / a)`` -> ``a * (1/c)``). Scale arithmetic
    built on those would round differently per backend and per program. This computes the
    quotient's 24-bit significand by long division of the integer significands instead, in
    digits of 8, 8 and 7 bits. Each digit is estimated in float32 from a reciprocal that is
    never too large, so the estimate is the digit or one less; the exact uint32 remainder says
    which (the partial remainder stays below 2^24, so shifted by 8 it fits 32 bits and converts
    to float32 exactly). Rounding is decided on the final remainder, so no float rounding of
    any backend reaches the result. No integer division either: XLA gives each one a fusion of
    its own and copies the cheap steps before it into each of them.
    Operands and results in float32's normal range take that path; zeros, infinities, NaNs,
    subnormals and overflowing or subnormal results fall back to ``a / b``. Jitted, so that
    eager callers do not dispatch the steps one operation at a time.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    a, b = jnp.broadcast_arrays(a, b)
    a_bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    b_bits = jax.lax.bitcast_convert_type(b, jnp.uint32)
    ea = ((a_bits >> 23) & 0xFF).astype(jnp.int32)
    eb = ((b_bits >> 23) & 0xFF).astype(jnp.int32)
    ma = (a_bits & 0x7FFFFF) | 0x800000  # significands in [2^23, 2^24)
    mb = (b_bits & 0x7FFFFF) | 0x800000
    # Pre-shift so the quotient lies in [1, 2): its leading bit is 1 and the remainder after
    # it is the shifted dividend minus mb, in [0, mb).
    lt = ma < mb
    r = jnp.where(lt, ma << 1, ma) - mb
    e = ea - eb + 127 - lt.astype(jnp.int32)  # biased exponent of the quotient
    inv_mb = reciprocal_from_below(mb)
    q = jnp.ones_like(ma)
    for bits in (8, 8, 7):  # the other 23 significand bits
        t = r << bits
        digit = (t.astype(jnp.float32) * inv_mb).astype(jnp.uint32)  # floor(t / mb), or one less
        r = t - digit * mb  # exact, in [0, 2 mb)
        high = r >= mb
        digit = digit + high.astype(jnp.uint32)
        r = jnp.where(high, r - mb, r)
        q = (q << bits) | digit
    # Round to nearest on the remainder: up above half an ulp (2 r > mb), ties to even.
    up = (2 * r > mb) | ((2 * r == mb) & ((q & 1) == 1))
    q = q + up.astype(jnp.uint32)
    carry = q >> 24  # rounding overflowed to 2^24
    q = q >> carry
    e = e + carry.astype(jnp.int32)
    sign = (a_bits ^ b_bits) & jnp.uint32(0x80000000)
    bits = sign | (jnp.clip(e, 1, 254).astype(jnp.uint32) << 23) | (q & 0x7FFFFF)
    exact = jax.lax.bitcast_convert_type(bits, jnp.float32)
    in_range = (ea > 0) & (ea < 255) & (eb > 0) & (eb < 255) & (e >= 1) & (e <= 254)
    return jnp.where(in_range, exact, a / b)

def exp2_int(e: jax.Array) -> jax.Array:
    """Exact float32 ``2**e`` for int32 ``e`` in [-126, 127], built from the exponent bits."""
    bits = (e.astype(jnp.int32) + 127) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
