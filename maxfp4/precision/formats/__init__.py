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

from maxfp4.precision.formats.dtypes import (DEC_SHIFT, DEC_SHIFT_BELOW, E2M1_MAX, E4M3_MAX, E5M2_MAX, E8M0,
                                             F32_MAX, FP4_E2M1, FP8_E4M3, FP8_E5M2, MX_BLOCK, NVFP4_BLOCK,
                                             NVFP4_S_ENC_MAX)  # noqa: F401
from maxfp4.precision.formats.arith import div_rn, exp2_int  # noqa: F401
from maxfp4.precision.formats.fp8 import (cast_fp8, dequantize_fp8, fp8_max, power_2_floor, qdq_fp8, quantize_fp8,
                                          scale_from_amax)  # noqa: F401
from maxfp4.precision.formats.random_bits import (SR_BITS, byte_of_word, check_word_count, random_bytes,
                                                  random_word_key, random_words, random_words_at, threefry2x32)  # noqa: F401
from maxfp4.precision.formats.e2m1 import round_bf16, round_e2m1  # noqa: F401
from maxfp4.precision.formats.nvfp4 import (NVFP4Array, block_dequantize_nvfp4_columns, check_blockable,
                                            from_blocks, nvfp4_block_scales, qdq_nvfp4, quantize_nvfp4,
                                            scale_to_e2m1_range, to_blocks)  # noqa: F401
from maxfp4.precision.formats.hadamard import (HADAMARD16_SIGNS, hadamard16, hadamard16_inverse, hadamard16_matrix,
                                               walsh16)  # noqa: F401
from maxfp4.precision.formats.mx import MXArray, qdq_mx, quantize_mx  # noqa: F401

