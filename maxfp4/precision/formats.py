"""Low-precision number formats: quantize, dequantize and the transforms the recipes need.

Everything here is pure ``jax.numpy``, jit-compatible and bitwise identical under ``jax.jit`` and
eagerly, on CPU and GPU.

FP8 (per-tensor scale, Transformer Engine semantics)
    ``E4M3`` (``float8_e4m3fn``: 4 exponent bits, bias 7, 3 mantissa bits, max 448, no inf) and
    ``E5M2`` (``float8_e5m2``: bias 15, 2 mantissa bits, max 57344). ``q = fp8(clip(x * scale))``,
    ``x ~ q * (1 / scale)``. The clip comes before the cast because an ``e4m3fn`` cast of anything
    beyond 464 is NaN.

NVFP4 (NVIDIA, arXiv 2509.25149; Transformer Engine ``NVFP4BlockScaling``)
    Elements are E2M1 (``float4_e2m1fn``): magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. Blocks of 16
    consecutive elements along the last axis (or 16x16 tiles over the last two axes) share one
    E4M3 scale ``s``; the tensor has one FP32 scale::

        S_enc = min(448 * 6 / amax(x), 2^126)   (1 if amax == 0),   S_dec = 1 / S_enc
        s     = e4m3(min(block_amax * (S_enc * (1/6)), 448))   round to nearest even
        q     = e2m1(clip(x * min(1 / (f32(s) * S_dec), f32_max), -6, 6))  round to nearest even
        x    ~= q * f32(s) * S_dec

    Every step is Transformer Engine's kernel arithmetic (``core_nvfp4.cuh``,
    ``quantize_transpose_nvfp4.cuh``), so codes, block scales and ``S_dec`` equal TE's bits
    (tests/test_te_nvfp4.py holds them to a NumPy model of its kernels). Two places differ:
    TE clamps ``S_enc`` at float32's max, whose reciprocal is subnormal (zero where XLA flushes
    subnormals, as on CPU); maxfp4 clamps at 2^126, the largest ``S_enc`` with a normal
    ``S_dec``, so a tensor whose amax is tiny but normal (below 2688 / 2^126 = 3.2e-35) still
    quantizes and dequantizes to its values. And ``1 / (f32(s) * S_dec)`` is taken with both
    factors scaled by 2^64 where ``S_dec`` is below 2^-64, so the product is never subnormal
    (TE's equals it wherever TE's product is normal). A block whose scale rounds to 0 gets
    the factor f32_max, as in TE: its nonzero elements saturate to +-6 and dequantize to
    (signed) 0. With a PRNG key the E2M1 rounding
    is stochastic with 8 random bits per element, as Blackwell's ``cvt.rs.satfinite.e2m1x4.f32``
    takes them (one 32-bit word per 4 elements): E[q] equals the clipped scaled value to within
    2^-9 of a grid step.

OCP MX (microscaling v1.0; comparison recipes only)
    Blocks of 32 along the last axis share a power-of-two E8M0 scale
    ``2**(floor(log2(block_amax)) - emax_elem)``; elements are E4M3, E5M2 or E2M1, clipped to the
    element format's max and rounded to nearest even.

Hadamard
    ``hadamard16`` applies the fixed 16x16 orthonormal transform ``H16 @ diag(sign) / 4`` to every
    group of 16 consecutive elements along one axis (NVFP4's random Hadamard transform for wgrad).
    TE's RHT cast kernel rounds the transform's FP32 result to BF16 before it takes amaxes and
    quantizes (``hadamard_transform_cast_fusion.cu``: "Downcast to BF16 for bit-wise
    compatibility"); :func:`round_bf16` is that rounding, in integer operations that XLA cannot
    fold away and that fuse into the quantizer's passes.

Floating-point caveat: XLA on CPU flushes float32 subnormals (|x| < 1.18e-38) to zero, so a
tensor whose magnitudes all lie below float32's smallest normal quantizes as an all-zero tensor
there. Non-finite inputs give unspecified (but non-crashing) results.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

FP8_E4M3 = jnp.float8_e4m3fn
FP8_E5M2 = jnp.float8_e5m2
FP4_E2M1 = jnp.float4_e2m1fn
E8M0 = jnp.float8_e8m0fnu

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0

NVFP4_BLOCK = 16
MX_BLOCK = 32

_F32_MAX = float(np.finfo(np.float32).max)
# The largest global encode scale whose reciprocal, S_dec, is a normal float32 (module docstring).
NVFP4_S_ENC_MAX = 2.0**126
# S_dec below this: 1 / (s * S_dec) is formed from S_dec * 2^64, so s * S_dec is never subnormal.
_DEC_SHIFT_BELOW = 2.0**-64
_DEC_SHIFT = 2.0**64


# --------------------------------------------------------------------------------------------
# Correctly rounded float32 division
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# FP8 with per-tensor scales
# --------------------------------------------------------------------------------------------


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
    Works elementwise on arrays of amaxes. ``margin`` is an integer (Python or traced).
    ``power_2``: round the new scale down to a power of two (:func:`power_2_floor`).
    """
    amax = jnp.asarray(amax, jnp.float32)
    old = jnp.ones_like(amax) if old_scale is None else jnp.asarray(old_scale, jnp.float32)
    if isinstance(margin, (int, np.integer)):
        pow2 = jnp.float32(2.0 ** -int(margin))
    else:  # a traced integer margin: build 2**-margin from exponent bits (exp2 may be inexact)
        pow2 = _exp2_int(-jnp.asarray(margin, jnp.int32))
    new = div_rn(fp8_max(fp8_dtype), amax) * pow2
    new = jnp.where(jnp.isinf(new), jnp.float32(_F32_MAX), new)
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


# --------------------------------------------------------------------------------------------
# Random bits for stochastic rounding
# --------------------------------------------------------------------------------------------

SR_BITS = 8  # random bits per element in stochastic rounding (see round_e2m1)

_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = 0x1BD11BDA


def threefry2x32(k1: jax.Array, k2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32, 20 rounds (Salmon et al., SC 2011), on uint32 arrays that broadcast: the
    hash behind ``jax.random`` (tests check the two agree bit for bit). Written out because the
    Pallas kernels of ``maxfp4.kernels.rht`` draw their random bits inside the kernel, where the hash's
    integer work runs while the kernel waits on memory, and Triton has no lowering for JAX's
    threefry primitive. The XLA path draws with ``jax.random.bits`` (:func:`random_words`):
    the same bits."""
    def rotl(v, r):
        return (v << jnp.uint32(r)) | (v >> jnp.uint32(32 - r))

    ks = (k1, k2, k1 ^ k2 ^ jnp.uint32(_THREEFRY_PARITY))
    x1, x2 = x1 + ks[0], x2 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x1 = x1 + x2
            x2 = x1 ^ rotl(x2, r)
        x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x1, x2


def random_word_key(key: jax.Array) -> jax.Array:
    """The uint32[2] threefry key of a PRNG key: a threefry key's own data, otherwise (another
    implementation's key) two words drawn from it."""
    data = jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key
    if data.shape != (2,) or data.dtype != jnp.uint32:
        data = jax.random.bits(key, (2,), jnp.uint32)
    return data


def random_words_at(word_key: jax.Array, index: jax.Array) -> jax.Array:
    """The uint32 word number ``index`` (uint32) of the stream of ``word_key``: threefry of the
    64-bit counter (0, index), its two halves xor-ed, as ``jax.random.bits`` forms word
    ``index`` of a uint32 draw."""
    b1, b2 = threefry2x32(word_key[0], word_key[1], jnp.zeros_like(index), index)
    return b1 ^ b2


def check_word_count(words_shape: tuple[int, ...]) -> None:
    """Word indices are uint32 counters (the kernels hash them as such): fewer than 2^32 words."""
    if int(np.prod(words_shape)) >= 2**32:
        raise ValueError(f"stochastic rounding: {words_shape} words exceed the 32-bit counter")


def random_words(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The uint32 words behind :func:`random_bytes` of ``shape``: ``shape[:-1] + (n // 4,)``,
    ``jax.random.bits`` of the threefry key ``random_word_key(key)`` (for a threefry key, the
    key itself), which is word ``i`` = ``random_words_at(random_word_key(key), i)`` of the
    flattened shape. ``jax.random`` draws them here because XLA fuses its draw into the
    quantizer that reads it; drawn with :func:`threefry2x32` directly, XLA wrote the words out
    in a pass of their own (70 us for a [16384, 5632] dY on an H100)."""
    *lead, n = shape
    words_shape = (*lead, n // 4)
    check_word_count(words_shape)
    threefry_key = jax.random.wrap_key_data(random_word_key(key), impl="threefry2x32")
    return jax.random.bits(threefry_key, words_shape, jnp.uint32)


def byte_of_word(words: jax.Array, byte: int | jax.Array) -> jax.Array:
    """Byte ``byte`` (0 is the low byte) of every uint32 word, as uint32."""
    return (words >> (jnp.uint32(SR_BITS) * jnp.uint32(byte))) & jnp.uint32(0xFF)


def random_bytes(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Uniform 8-bit random numbers (as uint32) of ``shape``, the last axis divisible by 4:
    one 32-bit word is drawn per 4 consecutive elements of the last axis and element ``i`` takes
    byte ``i % 4`` of word ``i // 4`` (low byte first). A quarter of the words of one draw per
    element: the counter-based generator's hash is what stochastic rounding's fusion spends its
    time on (H100 profile, 2026-11-25)."""
    words = random_words(key, shape)[..., None]
    return byte_of_word(words, jnp.arange(4, dtype=jnp.uint32)).reshape(shape)


# --------------------------------------------------------------------------------------------
# E2M1 rounding (arithmetic on float32, then an exact cast)
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# NVFP4
# --------------------------------------------------------------------------------------------


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
        q_blk = _to_blocks(self.elements.astype(jnp.float32), self.two_d)
        s_blk = _expand_scales(self.block_scales.astype(jnp.float32), self.two_d)
        return _from_blocks(q_blk * s_blk, self.two_d).astype(dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``q * f32(s) * S_dec`` in float32 (in that order), returned as ``dtype``."""
        return (self.block_dequantize(jnp.float32) * self.global_decode_scale).astype(dtype)


jax.tree_util.register_dataclass(
    NVFP4Array,
    data_fields=["elements", "block_scales", "global_decode_scale"],
    meta_fields=["two_d"],
)


def _check_blockable(shape: tuple[int, ...], two_d: bool, block: int, what: str) -> None:
    dims = 2 if two_d else 1
    if len(shape) < dims:
        raise ValueError(f"{what}: needs at least {dims} dimension(s), got shape {shape}")
    for d in shape[-dims:]:
        if d % block:
            raise ValueError(
                f"{what}: the blocked dimension(s) {shape[-dims:]} of shape {shape} must be "
                f"divisible by {block}"
            )


def _to_blocks(x: jax.Array, two_d: bool, block: int = NVFP4_BLOCK) -> jax.Array:
    """(..., C) -> (..., C/b, b), or (..., R, C) -> (..., R/b, b, C/b, b) for tiles."""
    if two_d:
        *lead, r, c = x.shape
        return x.reshape(*lead, r // block, block, c // block, block)
    *lead, c = x.shape
    return x.reshape(*lead, c // block, block)


def _from_blocks(x_blk: jax.Array, two_d: bool) -> jax.Array:
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
    _check_blockable(tuple(x.shape), two_d, NVFP4_BLOCK, "quantize_nvfp4")
    x_blk = _to_blocks(x.astype(jnp.float32), two_d)
    rand_bytes = None if key is None else random_bytes(key, x_blk.shape)
    q_blk, s_e4m3, s_dec = _quantize_blocks(x_blk, _block_axes(two_d), rand_bytes)
    return NVFP4Array(
        elements=_from_blocks(q_blk, two_d).astype(FP4_E2M1),  # exact: values are on the grid
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
    shift = jnp.where(s_dec < _DEC_SHIFT_BELOW, jnp.float32(_DEC_SHIFT), jnp.float32(1.0))
    # The barrier keeps XLA's simplifier from reassociating block_amax * (s_enc * (1/6)) into
    # (block_amax * s_enc) * (1/6), which rounds differently (and s * (s_dec * shift) likewise).
    block_enc, s_dec_shifted, shift = jax.lax.optimization_barrier(
        (s_enc * jnp.float32(1.0 / E2M1_MAX), s_dec * shift, shift)
    )

    s_f32 = jnp.minimum(block_amax * block_enc, jnp.float32(E4M3_MAX))
    # The barrier keeps XLA from folding the f32 -> e4m3 -> f32 round trip below away.
    s_e4m3 = jax.lax.optimization_barrier(s_f32.astype(FP8_E4M3))
    s_dq = s_e4m3.astype(jnp.float32)

    # TE: fminf(1 / (s * S_dec), f32_max); a zero scale gives 1/0 = inf, hence f32_max.
    enc = jnp.minimum(div_rn(1.0, s_dq * s_dec_shifted) * shift, _F32_MAX)
    return s_e4m3, enc, s_dec


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
    _check_blockable((k, m), False, NVFP4_BLOCK, "block_dequantize_nvfp4_columns")
    x_blk = x_MK.astype(jnp.float32).reshape(m // NVFP4_BLOCK, NVFP4_BLOCK, k)
    rand_bytes = None
    if key is not None:
        rand_bytes = random_bytes(key, (k, m // NVFP4_BLOCK, NVFP4_BLOCK)).transpose(1, 2, 0)
    q_blk, s_e4m3, s_dec = _quantize_blocks(x_blk, (-2,), rand_bytes)
    return (q_blk * s_e4m3.astype(jnp.float32)).reshape(m, k).astype(dtype), s_dec.astype(jnp.float32)


def qdq_nvfp4(x: jax.Array, *, two_d: bool = False, key: jax.Array | None = None) -> jax.Array:
    """``quantize_nvfp4(x, two_d=two_d, key=key).dequantize()``: float32, shape of ``x``."""
    return quantize_nvfp4(x, two_d=two_d, key=key).dequantize(jnp.float32)


# --------------------------------------------------------------------------------------------
# 16-point Hadamard transform
# --------------------------------------------------------------------------------------------

HADAMARD16_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard16_matrix() -> np.ndarray:
    """The float64 16x16 matrix ``M = H16 @ diag(HADAMARD16_SIGNS) / 4`` (H16 Sylvester, +-1)."""
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return h @ np.diag(np.asarray(HADAMARD16_SIGNS, np.float64)) / 4.0


def walsh16(v: jax.Array, axis: int = -1) -> jax.Array:
    """``H16 @ g`` for every group g of 16 along ``axis`` of ``v`` (that axis has length 16; H16
    Sylvester, unnormalised), by butterflies.

    Sylvester's H16 is the Kronecker power H2 x H2 x H2 x H2, so four butterfly stages, one per
    bit of the index within the group (bit 3 first), compute the product: the element whose
    bit is 0 becomes ``a + b`` and its partner (the index with that bit set) ``a - b``. Adds
    only: no matmul, hence no TF32/bf16 matmul precision to worry about on GPU.

    Each stage pairs elements by reversing the two halves of every 2 * 2^bit run (a reverse
    and a select, both element-wise), so XLA can fuse the stages with the ops around them.
    Slicing the halves and stacking them again made every stage its own FP32 pass (profile of
    dense-1p3b's NVFP4 step on an H200: ~60 ms of 517). Still, the fused passes recompute
    multi-dimensional indices for each of an output's 16 inputs; all four stages on 16 slices
    with one stack at the end was 8% faster on one linear layer, but not measured on a whole
    model, whose compile it may lengthen (docs/PERFORMANCE.md, "Tried and not kept").
    """
    axis = axis % v.ndim
    lead, trail = v.shape[:axis], v.shape[axis + 1:]
    lane = np.arange(16).reshape((16,) + (1,) * len(trail))
    for bit in (3, 2, 1, 0):
        stride = 1 << bit
        runs = v.reshape(*lead, 16 // (2 * stride), 2, stride, *trail)
        partner = jnp.flip(runs, axis=axis + 1).reshape(v.shape)
        low = ((lane >> bit) & 1) == 0  # this element is the "a" of its pair
        v = jnp.where(low, v + partner, partner - v)
    return v


def _grouped(x: jax.Array, axis: int, fn) -> jax.Array:
    """``fn(groups, group_axis)`` on the groups of 16 along ``axis``, in place: the axis is split
    into (n / 16, 16) where it lies, so no transpose moves it (a transform along the token axis
    of an activation stays in the activation's layout)."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % 16:
        raise ValueError(f"hadamard16: axis {axis} of shape {x.shape} must be divisible by 16")
    lead, trail = x.shape[:axis], x.shape[axis + 1:]
    out = fn(x.astype(jnp.float32).reshape(*lead, n // 16, 16, *trail), axis + 1)
    return out.reshape(x.shape)


def _signs_along(ndim: int, axis: int) -> jax.Array:
    """HADAMARD16_SIGNS shaped to broadcast along ``axis`` of an ndim-dimensional array."""
    return jnp.asarray(HADAMARD16_SIGNS, jnp.float32).reshape((16,) + (1,) * (ndim - 1 - axis))


def hadamard16(x: jax.Array, axis: int = -1) -> jax.Array:
    """Apply ``M = H16 @ diag(sign) / 4`` to every group of 16 consecutive elements along ``axis``.

    Convention: a group ``g`` (the 16 values ``x[..., 16*j : 16*j+16, ...]`` along ``axis``) is
    treated as a column vector and becomes ``M @ g``, i.e. as a row vector ``g @ M.T`` =
    ``g @ diag(sign) @ H16 / 4``: the signs are applied first, then the Hadamard transform.
    ``M`` is orthonormal; :func:`hadamard16_inverse` applies ``M.T``. Computed in float32 and
    returned as float32. ``sign = HADAMARD16_SIGNS``; :func:`hadamard16_matrix` returns ``M``.
    """
    return _grouped(x, axis, lambda g, a: walsh16(g * _signs_along(g.ndim, a), a) * jnp.float32(0.25))


def hadamard16_inverse(x: jax.Array, axis: int = -1) -> jax.Array:
    """Inverse of :func:`hadamard16`: every group ``g`` becomes ``M.T @ g``, i.e.
    ``diag(sign) @ (H16 @ g) / 4`` (Hadamard first, then the signs)."""
    return _grouped(x, axis, lambda g, a: walsh16(g, a) * jnp.float32(0.25) * _signs_along(g.ndim, a))


# --------------------------------------------------------------------------------------------
# OCP MX formats
# --------------------------------------------------------------------------------------------

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
        q_blk = _to_blocks(self.elements.astype(jnp.float32), False, MX_BLOCK)
        # (q * 2**(e+1)) * 0.5: 2**(e+1) is a normal float32 for every e in [-127, 126], while
        # 2**-127 itself is subnormal (flushed to zero by XLA on CPU). Both products are exact.
        up = _exp2_int(self.scale_exponents() + 1)[..., None]
        return _from_blocks((q_blk * up) * jnp.float32(0.5), False).astype(dtype)


jax.tree_util.register_dataclass(MXArray, data_fields=["elements", "block_scales"], meta_fields=[])


def _exp2_int(e: jax.Array) -> jax.Array:
    """Exact float32 ``2**e`` for int32 ``e`` in [-126, 127], built from the exponent bits."""
    bits = (e.astype(jnp.int32) + 127) << 23
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def quantize_mx(x: jax.Array, elem_dtype) -> MXArray:
    """OCP MX quantization: blocks of 32 along the last axis with an E8M0 power-of-two scale.

    ``e = clamp(floor(log2(block_amax)) - emax_elem, -127, 127)``, elements
    ``cast(clip(x / 2**e, -max_elem, max_elem))`` rounded to nearest even. A block with
    ``block_amax == 0`` (or below float32's smallest normal) gets ``e = -127`` and zero elements.
    ``elem_dtype``: float8_e4m3fn (MXFP8), float8_e5m2, or float4_e2m1fn (MXFP4).
    """
    key = np.dtype(elem_dtype)
    if key not in _MX_ELEMENTS:
        raise ValueError(f"quantize_mx: unsupported element dtype {elem_dtype}")
    emax, max_elem = _MX_ELEMENTS[key]
    _check_blockable(tuple(x.shape), False, MX_BLOCK, "quantize_mx")

    x_blk = _to_blocks(x.astype(jnp.float32), False, MX_BLOCK)
    block_amax = jnp.max(jnp.abs(x_blk), axis=-1)
    # floor(log2(amax)) is the unbiased exponent field of a normal float32: exact, unlike log2.
    biased = (jax.lax.bitcast_convert_type(block_amax, jnp.int32) >> 23) & 0xFF
    is_zero = biased == 0
    e = jnp.clip(biased - 127 - emax, -127, 127)
    e = jnp.where(is_zero, -127, e)

    # x * 2**-e: exact (2**-e is a normal float32 for e in [-127, 126]); zero blocks stay zero.
    y_blk = x_blk * jnp.where(is_zero, 0.0, _exp2_int(jnp.minimum(-e, 127)))[..., None]
    y_blk = jnp.clip(y_blk, -max_elem, max_elem)
    if key == np.dtype(FP4_E2M1):
        q_blk = round_e2m1(y_blk).astype(FP4_E2M1)
    else:
        q_blk = y_blk.astype(elem_dtype)
    q_blk = jax.lax.optimization_barrier(q_blk)  # pin the rounding against cast folding

    scales = jax.lax.bitcast_convert_type((e + 127).astype(jnp.uint8), E8M0)
    return MXArray(elements=_from_blocks(q_blk, False), block_scales=scales)


def qdq_mx(x: jax.Array, elem_dtype) -> jax.Array:
    """``quantize_mx(x, elem_dtype).dequantize()``: float32, shape of ``x``."""
    return quantize_mx(x, elem_dtype).dequantize(jnp.float32)


__all__ = [
    "FP8_E4M3",
    "FP8_E5M2",
    "FP4_E2M1",
    "E8M0",
    "E4M3_MAX",
    "E5M2_MAX",
    "E2M1_MAX",
    "NVFP4_BLOCK",
    "MX_BLOCK",
    "HADAMARD16_SIGNS",
    "div_rn",
    "fp8_max",
    "power_2_floor",
    "scale_from_amax",
    "quantize_fp8",
    "dequantize_fp8",
    "qdq_fp8",
    "NVFP4Array",
    "quantize_nvfp4",
    "qdq_nvfp4",
    "block_dequantize_nvfp4_columns",
    "hadamard16",
    "hadamard16_inverse",
    "round_bf16",
    "NVFP4_S_ENC_MAX",
    "hadamard16_matrix",
    "MXArray",
    "quantize_mx",
    "qdq_mx",
]
