"""Exact float32 arithmetic the formats need: correctly rounded division and powers of two."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _float64_of_normal(bits_u32: jax.Array) -> jax.Array:
    """The float64 equal to a normal float32, built from its bits rather than by a conversion
    (see ``div_rn``): the exponent and significand fields shifted up together by 29 bits, the
    exponent rebiased from 127 to 1023 by one add (no carry leaves the 11-bit field), the sign
    to bit 63. Few operations: a dense-1p3b NVFP4 step's HLO holds ~51,000 instructions of these
    divisions (``benchmarks/compile_cost.py``)."""
    bits = bits_u32.astype(jnp.uint64)
    magnitude = ((bits & 0x7FFFFFFF) << 29) + ((1023 - 127) << 52)
    return jax.lax.bitcast_convert_type(magnitude | ((bits >> 31) << 63), jnp.float64)


def _normal(bits_u32: jax.Array) -> jax.Array:
    """Whether the exponent field is in [1, 254]: its value minus one, unsigned, below 254."""
    return ((bits_u32 & 0x7F800000) - 0x00800000) < 0x7F000000


@jax.jit
def div_rn(a, b) -> jax.Array:
    """IEEE round-to-nearest-even float32 ``a / b``, identical on every backend.

    XLA on GPU lowers float32 division to PTX ``div.full`` (up to 2 ulp off: on an H200 with
    jax 0.11.2 about a quarter of random quotients differed from IEEE). Float64 division is
    IEEE there (``div.rn.f64``) and on CPU, and one float64 quotient rounded to float32 is the
    correctly rounded float32 quotient: a quotient of two 24-bit significands is never a
    float32 midpoint and lies at least 2^-49 (relative) from every one, while the float64
    quotient is within 2^-53 of it (2^-52 if XLA's simplifier turns it into a multiply by the
    reciprocal, as it does for ``x / broadcast(s)``), so rounding it to float32 crosses no
    midpoint (Figueroa's double-rounding bound, 53 >= 2 x 24 + 2).
    The float64 operands are built from the float32 bits, not converted: LLVM shrinks
    ``fptrunc(fdiv(fpext a, fpext b))`` back to a float32 division (the same theorem), which the
    GPU would run as ``div.full`` again. Zeros, infinities, NaNs and subnormal operands fall
    back to ``a / b``. Jitted, so that eager callers do not dispatch the steps one operation at
    a time; float64 is enabled for its body only.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jnp.asarray(b, jnp.float32)
    a, b = jnp.broadcast_arrays(a, b)
    a_bits = jax.lax.bitcast_convert_type(a, jnp.uint32)
    b_bits = jax.lax.bitcast_convert_type(b, jnp.uint32)
    with jax.enable_x64(True):
        quotient = (_float64_of_normal(a_bits) / _float64_of_normal(b_bits)).astype(jnp.float32)
    return jnp.where(_normal(a_bits) & _normal(b_bits), quotient, a / b)


def exp2_int(e: jax.Array) -> jax.Array:
    """Exact float32 ``2**e`` for int32 ``e`` in [-126, 127], built from the exponent bits."""
    bits = (e.astype(jnp.int32) + 127) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)
