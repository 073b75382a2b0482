"""maxfp4's NVFP4 against a NumPy model of Transformer Engine's kernels, bit for bit.

The model below is written from TE's CUDA source (common/cast/nvfp4/core_nvfp4.cuh,
quantize_transpose_nvfp4.cuh, hadamard_transform/hadamard_transform_cast_fusion.cu), in NumPy
float32/float64 with ml_dtypes' casts for BF16, E4M3 and E2M1 (round to nearest even; TE's
``cvt.rn.satfinite``, so values are clipped first). No JAX, none of maxfp4's arithmetic:

  S_enc = fminf(448 * 6 / amax, f32_max); 1 if amax == 0 or S_enc == 0   (float32 division)
  S_dec = (float)(1.0 / S_enc)                                            (double division)
  s     = e4m3_satfinite(block_amax * (S_enc * (1.0f / 6)))
  enc   = fminf(1.0f / ((float)s * S_dec), f32_max)
  q     = e2m1_rn_satfinite(x * enc)
  RHT (wgrad operands): groups of 16 tokens times diag(sign) H16 / 4, accumulated in FP32 by
  the tensor cores, then "Downcast to BF16 for bit-wise compatibility"; amaxes and the
  quantization read the BF16 values.

Where maxfp4 departs from TE (amax below 3.2e-35, formats' docstring) is tested at the end,
against the values instead of TE's bits.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maxfp4.precision import formats as F
from maxfp4.precision.recipes import nvfp4 as R

F32 = np.float32
F32_MAX = np.finfo(F32).max
SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float64)


# ------------------------------------------------------------------------------- the TE model


def te_global_encode_scale(amax: np.float32) -> np.float32:
    with np.errstate(divide="ignore", over="ignore"):
        s_enc = np.minimum(F32(448.0 * 6.0) / F32(amax), F32_MAX)
    return F32(1.0) if amax == 0 or s_enc == 0 else F32(s_enc)


def te_quantize(x: np.ndarray, tile_rows: int = 1) -> dict:
    """TE's NVFP4 cast of float32 x [R, C]: blocks of 1x16 (tile_rows=1) or 16x16 tiles."""
    x = np.asarray(x, F32)
    r, c = x.shape
    amax = F32(np.max(np.abs(x)))
    s_enc = te_global_encode_scale(amax)
    s_dec = F32(1.0 / np.float64(s_enc))
    blk = x.reshape(r // tile_rows, tile_rows, c // 16, 16)
    block_amax = np.max(np.abs(blk), axis=(1, 3), keepdims=True)
    s_dec_b = block_amax * (s_enc * F32(1.0 / 6.0))
    s_e4m3 = np.minimum(s_dec_b, F32(448.0)).astype(ml_dtypes.float8_e4m3fn)
    with np.errstate(divide="ignore", over="ignore"):
        enc = np.minimum(F32(1.0) / (s_e4m3.astype(F32) * s_dec), F32_MAX)
        y = np.clip(blk * enc, F32(-6.0), F32(6.0))
    q = y.astype(ml_dtypes.float4_e2m1fn).reshape(r, c)
    scales = s_e4m3[:, 0, :, 0]
    return dict(codes=q.view(np.uint8), scale_bits=scales.view(np.uint8), s_dec=s_dec, q=q, scales=scales)


def te_rht_columns(x_MK: np.ndarray, bf16: bool = True) -> np.ndarray:
    """TE's RHT of the wgrad operand x^T [K, M] along M, returned in x's [M, K] layout: exact in
    float64 (BF16 inputs times +-1/4), rounded to the FP32 accumulator, then to BF16."""
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    transform = np.diag(SIGNS) @ h / 4.0  # a group g (row vector) becomes g @ diag(sign) H / 4
    m, k = x_MK.shape
    groups = np.asarray(x_MK, np.float64).T.reshape(k, m // 16, 16)
    t = (groups @ transform).astype(F32)
    if bf16:
        t = t.astype(ml_dtypes.bfloat16).astype(F32)
    return t.reshape(k, m).T


# ---------------------------------------------------------------------------------- inputs


def te_inputs(seed: int, shape, scale: float = 1.0, bf16: bool = True) -> np.ndarray:
    """BF16-representable values whose 16-blocks span 4 decades, an outlier of 3e4, an all-zero
    block, and blocks at 1e-5 (subnormal E4M3 scale) and 1e-9 (scale 0) of the amax, all
    times ``scale``; the special blocks are 16x16 tiles, so they are blocks in every layout."""
    rng = np.random.default_rng(seed)
    r, c = shape
    x = rng.standard_normal((r // 16, 16, c // 16, 16)) * 10.0 ** rng.uniform(-1, 3, (r // 16, 1, c // 16, 1))
    x = x.reshape(shape)
    x[3, 5] = 3.0e4
    x[16:32, :16] = 0.0
    x[:16, 16:32] *= 3.0e4 * 1e-5 / np.max(np.abs(x[:16, 16:32]))
    x[16:32, 16:32] *= 3.0e4 * 1e-9 / np.max(np.abs(x[16:32, 16:32]))
    x = (x * scale).astype(F32)
    return x.astype(ml_dtypes.bfloat16).astype(F32) if bf16 else x


SHAPES = [(32, 64), (64, 48), (128, 32)]
# Down to 1e-24: the 1e-9 tile then stays above float32's normal range (XLA on CPU flushes
# subnormal inputs, TE's kernels do not).
SCALES = [1.0, 1e-24, 1e25]


def _codes(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _bits(a) -> np.ndarray:
    return np.asarray(a, F32).view(np.uint32)


def assert_equals_te(q: F.NVFP4Array, te: dict):
    np.testing.assert_array_equal(_codes(q.elements), te["codes"])
    np.testing.assert_array_equal(_codes(q.block_scales), te["scale_bits"])
    assert _bits(q.global_decode_scale) == _bits(te["s_dec"])


# ------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", SCALES)
def test_1d_blocks_equal_te_bitwise(shape, scale):
    x = te_inputs(1, shape, scale)
    te = te_quantize(x)
    # The inputs reach every case: a zero scale with nonzero elements (saturated to +-6, as in
    # TE), subnormal E4M3 scales, the all-zero block, both signs.
    assert np.any((te["scale_bits"] == 0)) and np.any((te["scale_bits"] > 0) & (te["scale_bits"] < 8))
    assert np.any(te["codes"] == 7) and np.any(te["codes"] & 8)
    assert_equals_te(jax.jit(F.quantize_nvfp4)(jnp.asarray(x, jnp.bfloat16)), te)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", SCALES)
def test_2d_weight_tiles_equal_te_bitwise(shape, scale):
    """Weights: 16x16 tiles of the FP32 master weight (not BF16-representable)."""
    w = te_inputs(2, shape, scale, bf16=False)
    te = te_quantize(w, tile_rows=16)
    q = jax.jit(lambda a: F.quantize_nvfp4(a, two_d=True))(jnp.asarray(w))
    assert_equals_te(q, te)


def _recipe_operands(x_MK, rht_bf16):
    """Every way the recipe forms an RHT wgrad operand (block-dequantized q * s in x's layout,
    and S_dec): the XLA path, the Pallas kernels (interpret mode off GPU), and the K-major
    quantization the Blackwell path hands to the FP4 GEMM."""
    xla = jax.jit(lambda a: R._emulated_wgrad_operand(a, True, None, False, True, rht_bf16=rht_bf16))(x_MK)
    kernels = jax.jit(lambda a: R._emulated_wgrad_operand(a, True, None, True, True, rht_bf16=rht_bf16))(x_MK)
    q_KM = jax.jit(lambda a: F.quantize_nvfp4(R._hadamard_tokens(a, rht_bf16).T))(x_MK)
    return xla, kernels, q_KM


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scale", SCALES)
def test_rht_wgrad_operands_equal_te_bitwise(shape, scale):
    x = te_inputs(3, shape, scale)
    x_MK = jnp.asarray(x, jnp.bfloat16)
    te = te_quantize(te_rht_columns(x).T)  # TE quantizes x^T [K, M] along M
    xla, kernels, q_KM = _recipe_operands(x_MK, rht_bf16=True)
    assert_equals_te(q_KM, te)
    # q * s: exact in BF16 (6 significant bits), so the emulated operands carry the same codes.
    te_v_MK = (te["q"].astype(F32).reshape(te["q"].shape[0], -1, 16)
               * te["scales"].astype(F32)[..., None]).reshape(te["q"].shape).T
    for v, s_dec in (xla, kernels):
        assert v.dtype == jnp.bfloat16
        np.testing.assert_array_equal(_bits(v), _bits(te_v_MK))
        assert _bits(s_dec) == _bits(te["s_dec"])


def test_rht_bf16_off_quantizes_the_fp32_transform():
    """rht_bf16=false: the FP32 transform is quantized (TE's model with the rounding left out),
    and that differs from TE's kernel on these inputs, so the option has teeth."""
    x = te_inputs(4, (64, 48))
    x_MK = jnp.asarray(x, jnp.bfloat16)
    xla, kernels, q_KM = _recipe_operands(x_MK, rht_bf16=False)
    assert_equals_te(q_KM, te_quantize(te_rht_columns(x, bf16=False).T))
    np.testing.assert_array_equal(_bits(xla[0]), _bits(kernels[0]))
    te_bf16 = te_quantize(te_rht_columns(x).T)
    assert np.any(_codes(q_KM.elements) != te_bf16["codes"])


def test_rht_stochastic_rounding_is_unbiased():
    """TE draws its bits from Philox and maxfp4 from threefry, so stochastic codes cannot match
    bit for bit; the property both promise is E[q] = y, y = clip(t * enc, -6, 6) the scaled BF16
    transform (scales do not depend on the key, and equal TE's). Over N = 512 keys each
    element's mean code is within 2^-9 of a grid step (the 8-bit threshold's bias) plus 5
    standard errors (sigma <= step / 2) of y, and the mean of the errors over all elements,
    in steps, is within 5 standard errors of 0."""
    x = te_inputs(5, (32, 32))
    te = te_quantize(te_rht_columns(x).T)
    t_KM = te_rht_columns(x).T
    with np.errstate(divide="ignore", over="ignore"):  # the all-zero block's scale is 0
        enc = np.minimum(F32(1.0) / (te["scales"].astype(F32) * te["s_dec"]), F32_MAX)
        y = np.clip(t_KM.reshape(32, 2, 16) * enc[..., None], -6.0, 6.0).reshape(32, 32).astype(np.float64)
    n = 512
    keys = jax.random.split(jax.random.key(11), n)
    x_MK = jnp.asarray(x, jnp.bfloat16)
    draw = jax.jit(jax.vmap(lambda k: F.quantize_nvfp4(R._hadamard_tokens(x_MK, True).T, key=k)))
    q = draw(keys)
    np.testing.assert_array_equal(_codes(q.block_scales[0]), te["scale_bits"])
    mean_q = np.asarray(q.elements.astype(jnp.float32), np.float64).mean(axis=0)
    a = np.abs(y)
    step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))
    err = mean_q - y
    assert np.all(np.abs(err) <= step * (2.0**-9 + 5 * 0.5 / np.sqrt(n)))
    rel = err / step
    assert abs(rel.mean()) <= 2.0**-9 + 5 * 0.5 / np.sqrt(n * rel.size)
    assert np.any(mean_q != np.round(mean_q))  # really stochastic


# ---------------------------------------------------------------------- tiny amax, zero amax


@pytest.mark.parametrize("amax", [1e-37, 1e-30, 1e-20])
@pytest.mark.parametrize("two_d", [False, True])
def test_tiny_amax_quantizes_to_its_values(amax, two_d):
    """Below 2688 / f32_max (~7.9e-36) 448*6/amax overflows float32; below 3.2e-35 its reciprocal
    is subnormal, which XLA on CPU flushes to zero. The values must survive: every element is
    within (1/6 + 2^-4) of its block's amax of the input (half an E2M1 step at the top of the
    block, plus the E4M3 scale's rounding), and the blocks' top elements are not zero."""
    rng = np.random.default_rng(6)
    x = rng.uniform(0.5, 1.0, (32, 64)) * rng.choice([-1.0, 1.0], (32, 64))
    x = (x * (amax / np.max(np.abs(x)))).astype(F32)
    deq = np.asarray(jax.jit(lambda a: F.qdq_nvfp4(a, two_d=two_d))(jnp.asarray(x)), np.float64)
    tiles = (lambda a: a.reshape(2, 16, 4, 16)) if two_d else (lambda a: a.reshape(32, 4, 16))
    axes = (1, 3) if two_d else (2,)
    block_amax = np.max(np.abs(tiles(x.astype(np.float64))), axis=axes, keepdims=True)
    err = np.abs(tiles(deq) - tiles(x.astype(np.float64)))
    assert np.all(err <= (1 / 6 + 2.0**-4) * block_amax)
    assert np.all(np.max(np.abs(tiles(deq)), axis=axes) > 0)
    q = F.quantize_nvfp4(jnp.asarray(x), two_d=two_d)
    assert float(q.global_decode_scale) >= np.finfo(F32).tiny  # a normal S_dec


def test_tiny_amax_wgrad_is_not_flushed():
    """The wgrad product of a tiny dY (amax 1e-37) and an ordinary X: the two S_dec multiply the
    FP32 accumulator one after the other, so their product (below float32's normal range)
    never appears. Float64 reference of the same quantized operands, relative 1e-5, plus
    float32's smallest normal for the elements whose exact value is itself subnormal."""
    rng = np.random.default_rng(7)
    x_MK = jnp.asarray(rng.standard_normal((64, 32)).astype(F32), jnp.bfloat16)
    dy_MN = jnp.asarray((rng.standard_normal((64, 16)) * 1e-37).astype(F32), jnp.bfloat16)
    dw = jax.jit(lambda a, b: R.nvfp4_wgrad(a, b, True, None, False, False))(x_MK, dy_MN)
    (v_x, s_x), (v_dy, s_dy) = (R._emulated_wgrad_operand(a, True, None, False, True) for a in (x_MK, dy_MN))
    want = (np.asarray(v_x, np.float64).T @ np.asarray(v_dy, np.float64)) * float(s_x) * float(s_dy)
    assert dw.dtype == jnp.float32 and np.max(np.abs(want)) > 1e-36
    np.testing.assert_allclose(np.asarray(dw, np.float64), want, rtol=1e-5, atol=float(np.finfo(F32).tiny))


def test_zero_amax_gives_zeros_and_scale_one():
    for two_d in (False, True):
        q = F.quantize_nvfp4(jnp.zeros((32, 32)), two_d=two_d)
        assert float(q.global_decode_scale) == 1.0 and not np.any(_codes(q.elements))
        assert not np.any(np.asarray(q.dequantize()))
        te = te_quantize(np.zeros((32, 32), F32), 16 if two_d else 1)
        assert_equals_te(q, te)


def test_round_bf16_is_the_bfloat16_cast():
    rng = np.random.default_rng(8)
    bits = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    bits = bits[(bits & 0x7F800000) != 0x7F800000]  # finite
    bits[:4] = [0x3F808000, 0x3F818000, 0x3F808001, 0xBF818000]  # ties to even, just above, negative
    x = bits.view(F32)
    x = x[np.abs(x) >= np.finfo(F32).tiny]  # XLA on CPU flushes subnormals
    want = x.astype(ml_dtypes.bfloat16).astype(F32)
    np.testing.assert_array_equal(_bits(jax.jit(F.round_bf16)(jnp.asarray(x))), _bits(want))


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1.0, 1e-24])
def test_rht_kernels_on_gpu_equal_te_bitwise(scale):
    """The Triton-compiled RHT kernels and the XLA path on the GPU give TE's codes and scales."""
    x = te_inputs(9, (2048, 512), scale)
    te = te_quantize(te_rht_columns(x).T)
    te_v_MK = (te["q"].astype(F32).reshape(512, -1, 16) * te["scales"].astype(F32)[..., None]).reshape(512, 2048).T
    x_MK = jax.device_put(jnp.asarray(x, jnp.bfloat16), jax.devices("gpu")[0])
    for kernels in (True, False):
        v, s_dec = jax.jit(lambda a: R._emulated_wgrad_operand(a, True, None, kernels, False))(x_MK)
        np.testing.assert_array_equal(_bits(v), _bits(te_v_MK))
        assert _bits(s_dec) == _bits(te["s_dec"])
    assert_equals_te(jax.jit(F.quantize_nvfp4)(x_MK), te_quantize(x))
