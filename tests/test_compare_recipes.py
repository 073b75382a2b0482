"""Tests of the comparison recipes (maxfp4.precision.recipes.mx and .fp8_block): mxfp8, mxfp4 and fp8_block.

Each recipe's forward output and its three GEMMs (fprop, dgrad, wgrad through ``jax.vjp`` with a
random dY) are compared with a float64 NumPy reference built from the same quantized operands.
The reference quantizers are written here from the format definitions and never call the code
under test: E4M3/E2M1 grids are enumerated from their sign/exponent/mantissa bits and rounding
searches the grid (ties to the even code).

Tolerance of a GEMM ``C = A B^T`` with contraction length L, elementwise, rigorous for any
summation order: FP32 accumulation (u = 2^-24) is off by at most ``gamma_L * (|A| |B|^T)``,
``gamma_L = L u / (1 - L u)``; an output rounded to BF16 (8 significant bits, round to nearest
even: relative error at most 2^-8) may be off by another ``2^-8 |C|``. So

    BF16 outputs (y, dx):  |got - ref| <= 2^-8 |ref| + (1 + 2^-8) gamma_L (|A| |B|^T)
    FP32 outputs (dw):     |got - ref| <= gamma_L (|A| |B|^T)

Every such comparison is also run against operands quantized differently (not at all, or
blocked along the wrong axis) and must FAIL there, so the tolerance is tight enough to see the
quantization.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.precision.recipes import fp8_block as FB, mx as MX
from maxfp4.precision import formats as F
from maxfp4.precision.recipes.nvfp4 import nvfp4_dot
from maxfp4.precision.registry import RECIPES

# ---------------------------------------------------------------------------------------------
# Reference number grids and rounding (from the format definitions)
# ---------------------------------------------------------------------------------------------


def fp_grid(exp_bits: int, man_bits: int, bias: int, n_finite: int) -> np.ndarray:
    """Non-negative values of magnitude codes 0..n_finite-1 (increasing with the code)."""
    vals = []
    for code in range(n_finite):
        e, m = code >> man_bits, code & ((1 << man_bits) - 1)
        if e == 0:
            vals.append(m / 2.0**man_bits * 2.0 ** (1 - bias))
        else:
            vals.append((1 + m / 2.0**man_bits) * 2.0 ** (e - bias))
    return np.array(vals, np.float64)


E2M1_GRID = fp_grid(2, 1, 1, 8)
E4M3_GRID = fp_grid(4, 3, 7, 127)  # code 0x7F is NaN


def test_reference_grids():
    np.testing.assert_array_equal(E2M1_GRID, [0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert E4M3_GRID[-1] == 448.0 and E4M3_GRID[1] == 2.0**-9 and E4M3_GRID[8] == 2.0**-6
    assert np.all(np.diff(E4M3_GRID) > 0)


def rne(v: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Round float64 ``v`` (|v| <= grid max) to the nearest grid value, ties to the even code."""
    a = np.abs(np.asarray(v, np.float64))
    assert np.all(a <= grid[-1])
    hi = np.clip(np.searchsorted(grid, a, side="left"), 0, len(grid) - 1)
    lo = np.clip(hi - 1, 0, len(grid) - 1)
    d_lo, d_hi = a - grid[lo], grid[hi] - a
    code = np.where(d_hi < d_lo, hi, np.where(d_lo < d_hi, lo, np.where(hi % 2 == 0, hi, lo)))
    return np.copysign(grid[code], v)


# ---------------------------------------------------------------------------------------------
# Reference quantizers
# ---------------------------------------------------------------------------------------------

MX_SPEC = {"mxfp8": (8, E4M3_GRID), "mxfp4": (2, E2M1_GRID)}  # (emax_elem, element grid)


def ref_mx(x: np.ndarray, name: str) -> np.ndarray:
    """OCP MX, blocks of 32 along the last axis; float64 dequantized values ``q * 2**e``.

    Shared exponent ``e = floor(log2(block amax)) - emax_elem`` (clamped to E8M0's [-127, 127]);
    elements ``x / 2**e`` clipped to the element max and rounded to nearest even on the grid.
    """
    emax, grid = MX_SPEC[name]
    x = np.asarray(x, np.float64)
    blk = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    amax = np.max(np.abs(blk), axis=-1, keepdims=True)
    _, ex = np.frexp(np.where(amax == 0, 1.0, amax))  # amax = m * 2**ex, m in [0.5, 1)
    e = np.clip(ex - 1 - emax, -127, 127).astype(np.float64)
    y = np.clip(blk / 2.0**e, -grid[-1], grid[-1])
    deq = np.where(amax == 0, 0.0, rne(y, grid) * 2.0**e)
    return deq.reshape(x.shape)


def ref_fp8_tiles(x: np.ndarray, tile: tuple[int, int]):
    """DeepSeek-V3 tiles over a 2D array: returns (q float64, scales float32, dequantized float64).

    ``scale = 448 / tile_amax`` as an FP32 number (1 for a zero tile); ``q = e4m3(clip(x * scale))``
    with the product in FP32 (the spec's scales and scaling are FP32); dequantized
    ``q * (1 / scale)`` with the reciprocal and the product in FP32.
    """
    x = np.asarray(x, np.float32)
    r, c = x.shape
    tr, tc = tile
    t = x.reshape(r // tr, tr, c // tc, tc)
    amax = np.max(np.abs(t), axis=(1, 3), keepdims=True).astype(np.float64)
    # float64 quotient rounded once to float32 = the correctly rounded float32 quotient.
    scale = np.where(amax == 0, 1.0, 448.0 / np.where(amax == 0, 1.0, amax)).astype(np.float32)
    y = np.clip(t * scale, np.float32(-448), np.float32(448))  # float32 product
    q = rne(y.astype(np.float64), E4M3_GRID)
    inv = np.float32(1.0) / scale  # IEEE float32 division
    deq = (q.astype(np.float32) * inv).astype(np.float64)
    return q.reshape(r, c), scale[:, 0, :, 0], deq.reshape(r, c)


def ref_fp8_block(x, name):
    del name
    return ref_fp8_tiles(x, (1, 128))[2]


# ---------------------------------------------------------------------------------------------
# Data, tolerance and helpers
# ---------------------------------------------------------------------------------------------

B, T, K, N = 2, 128, 256, 384  # M = 256 tokens: every dimension a multiple of 128


def make_inputs(seed: int = 0, spread: float = 1.0, weight_outliers: bool = True):
    """x BF16 [B,T,K], w FP32 [K,N], dY BF16 [B,T,N] with per-row/column magnitude spread
    (lognormal, sigma ``spread``: blocking along different axes then gives different scales) and
    a few large outliers (0.3% of the entries; in w only with ``weight_outliers``)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, T, K)) * np.exp(rng.normal(0, spread, (B, T, 1)))
    x *= np.exp(rng.normal(0, spread, (1, 1, K)))
    w = 0.05 * rng.standard_normal((K, N)) * np.exp(rng.normal(0, 0.7 * spread, (K, 1)))
    w *= np.exp(rng.normal(0, 0.7 * spread, (1, N)))
    dy = 1e-3 * rng.standard_normal((B, T, N)) * np.exp(rng.normal(0, spread, (B, T, 1)))
    dy *= np.exp(rng.normal(0, 0.7 * spread, (1, 1, N)))
    for a, mag in ((x, 30.0), (dy, 20.0)) + (((w, 15.0),) if weight_outliers else ()):
        a[rng.random(a.shape) < 0.003] *= mag
    return (jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.float32),
            jnp.asarray(dy, jnp.bfloat16))


def run_recipe(fn, x, w, dy, options=(), key=None):
    y, vjp = jax.vjp(lambda a, b: fn(a, b, options, None, key), x, w)
    dx, dw = vjp(dy)
    return y, dx, dw


_run_jit = jax.jit(run_recipe, static_argnums=(0, 4))


def violation(got, a, b, bf16_out: bool) -> float:
    """max over elements of |got - ref| / bound for ``ref = a @ b.T`` (float64); <= 1 passes."""
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    ref = a @ b.T
    L = a.shape[1]
    u = 2.0**-24
    gamma = L * u / (1 - L * u)
    acc = gamma * (np.abs(a) @ np.abs(b).T)
    bound = 2.0**-8 * np.abs(ref) + (1 + 2.0**-8) * acc if bf16_out else acc
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64).reshape(ref.shape)
    # A tiny absolute floor keeps exact zeros (0 <= 0) from dividing by zero.
    return float(np.max(np.abs(got - ref) / (bound + 1e-300)))


def gemm_operands(ref_q, x, w, dy, w_ref_q=None):
    """(A, B) of the three GEMMs as ``A @ B.T``: operands quantized by ``ref_q`` along their last
    axis, which is the GEMM's contraction dimension. ``w_ref_q(w) -> (W for fprop as [N,K],
    W for dgrad as [K,N])`` overrides the weight quantization."""
    x_MK = np.asarray(jnp.asarray(x, jnp.float32), np.float64).reshape(-1, K)
    dy_MN = np.asarray(jnp.asarray(dy, jnp.float32), np.float64).reshape(-1, N)
    w_KN = np.asarray(w, np.float64)
    w_NK_f, w_KN_d = (ref_q(w_KN.T), ref_q(w_KN)) if w_ref_q is None else w_ref_q(w_KN)
    return {
        "fprop": (ref_q(x_MK), w_NK_f),
        "dgrad": (ref_q(dy_MN), w_KN_d),
        "wgrad": (ref_q(x_MK.T), ref_q(dy_MN.T)),
    }


def fp8_block_weight(w_KN):
    deq = ref_fp8_tiles(w_KN, (128, 128))[2]
    return deq.T, deq


def reference_operands(name, x, w, dy):
    if name == "fp8_block":
        return gemm_operands(lambda a: ref_fp8_block(a, name), x, w, dy, fp8_block_weight)
    return gemm_operands(lambda a: ref_mx(a, name), x, w, dy)


def wrong_axis_operands(name, x, w, dy):
    """Every operand blocked along its GEMM's non-contraction dimension instead (the 128x128
    weight blocks are symmetric, so only activations/gradients change for fp8_block)."""
    def q_other_axis(a):
        return (ref_fp8_block if name == "fp8_block" else ref_mx)(a.T, name).T
    if name == "fp8_block":
        return gemm_operands(q_other_axis, x, w, dy, fp8_block_weight)
    return gemm_operands(q_other_axis, x, w, dy)


def unquantized_operands(x, w, dy):
    return gemm_operands(lambda a: a, x, w, dy)


NAMES = ["mxfp8", "mxfp4", "fp8_block"]

# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_registry_names():
    from maxfp4.config import load_config
    assert (RECIPES["mxfp8"].dot, RECIPES["mxfp8"].spec.defaults) == (MX.mxfp8_dot, {})
    assert (RECIPES["mxfp4"].dot, RECIPES["mxfp4"].spec.defaults) == (MX.mxfp4_dot, {})
    assert (RECIPES["fp8_block"].dot, RECIPES["fp8_block"].spec.defaults) == (FB.fp8_block_dot, {})
    for name in NAMES:
        assert load_config(None, [f"precision.default={name}"]).precision.default == name


@pytest.mark.parametrize("name", NAMES)
def test_gemms_match_reference(name):
    x, w, dy = make_inputs(seed=1)
    y, dx, dw = _run_jit(RECIPES[name].dot, x, w, dy)
    assert y.dtype == jnp.bfloat16 and y.shape == (B, T, N)
    assert dx.dtype == x.dtype and dx.shape == x.shape
    assert dw.dtype == jnp.float32 and dw.shape == w.shape

    outs = {"fprop": (y, True), "dgrad": (dx, True), "wgrad": (dw, False)}
    right = reference_operands(name, x, w, dy)
    wrong = wrong_axis_operands(name, x, w, dy)
    plain = unquantized_operands(x, w, dy)
    for gemm, (got, bf16_out) in outs.items():
        v = violation(got, *right[gemm], bf16_out)
        assert v <= 1.0, f"{name} {gemm}: {v:.3g} x the tolerance"
        # The tolerance resolves the quantization: other operands fail it.
        assert violation(got, *wrong[gemm], bf16_out) > 1.0, f"{name} {gemm} (wrong axis)"
        assert violation(got, *plain[gemm], bf16_out) > 1.0, f"{name} {gemm} (unquantized)"


def test_dx_follows_input_dtype():
    x, w, dy = make_inputs(seed=2)
    for name in NAMES:
        _, dx, dw = _run_jit(RECIPES[name].dot, x.astype(jnp.float32), w, dy)
        assert dx.dtype == jnp.float32 and dw.dtype == jnp.float32, name


def test_forward_of_2d_input_and_undifferentiated_any_m():
    """x may be 2D; undifferentiated calls do not block along M, so M need not be a multiple."""
    _, w, _ = make_inputs(seed=3)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, K)), jnp.bfloat16)
    x_np = np.asarray(x.astype(jnp.float32), np.float64)
    w_np = np.asarray(w, np.float64)
    for name in NAMES:
        y = jax.jit(RECIPES[name].dot, static_argnums=2)(x, w, (), None, None)
        assert y.shape == (5, N) and y.dtype == jnp.bfloat16
        if name == "fp8_block":
            a, b = ref_fp8_block(x_np, name), fp8_block_weight(w_np)[0]
        else:
            a, b = ref_mx(x_np, name), ref_mx(w_np.T, name)
        assert violation(y, a, b, True) <= 1.0, name


def test_quantize_fp8_tiles_bitwise():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((256, 384)) * np.exp(rng.normal(0, 3, (256, 1)))
    x[:, :128] *= np.exp(rng.normal(0, 3, (1, 128)))
    x[5, 128:256] = 0.0  # an all-zero 1x128 tile: scale 1, q 0
    x[:128, 256:] = 0.0  # an all-zero 128x128 block
    x[7, 0] = 1e-30  # tiny values in their own tile
    x[7, 1:128] = 3e-31
    x = x.astype(np.float32)
    for tile in [(1, 128), (128, 128), (128, 1)]:
        q, s = jax.jit(FB.quantize_fp8_tiles, static_argnums=1)(jnp.asarray(x), tile)
        want_q, want_s, want_deq = ref_fp8_tiles(x, tile)
        assert q.dtype == jnp.float8_e4m3fn and s.dtype == jnp.float32
        assert s.shape == (256 // tile[0], 384 // tile[1])
        np.testing.assert_array_equal(np.asarray(s), want_s)
        np.testing.assert_array_equal(np.asarray(q.astype(jnp.float32), np.float64), want_q)
        got = jax.jit(FB.qdq_fp8_tiles, static_argnums=1)(jnp.asarray(x), tile)
        np.testing.assert_array_equal(np.asarray(got, np.float64), want_deq)
    # the zero tiles really took scale 1, and the tile amax maps onto 448
    q, s = FB.quantize_fp8_tiles(jnp.asarray(x), (1, 128))
    assert float(s[5, 1]) == 1.0 and np.all(np.asarray(q[5, 128:256].astype(jnp.float32)) == 0)
    assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0


def test_fp8_block_shape_errors():
    good_w = jnp.ones((256, 256), jnp.float32)
    with pytest.raises(ValueError, match=r"\(192, 256\)"):
        FB.fp8_block_dot(jnp.ones((128, 192), jnp.bfloat16), jnp.ones((192, 256)))
    with pytest.raises(ValueError, match=r"\(256, 200\)"):
        FB.fp8_block_dot(jnp.ones((128, 256), jnp.bfloat16), jnp.ones((256, 200)))
    with pytest.raises(ValueError, match=r"token count M.*\(3, 40, 256\)"):
        jax.vjp(lambda a, b: FB.fp8_block_dot(a, b), jnp.ones((3, 40, 256), jnp.bfloat16), good_w)
    with pytest.raises(ValueError, match=r"expected x\[..., K\]"):
        FB.fp8_block_dot(jnp.ones((128, 128), jnp.bfloat16), good_w)
    with pytest.raises(ValueError, match=r"\(100, 200\).*tile \(1, 128\)"):
        FB.quantize_fp8_tiles(jnp.ones((100, 200)), (1, 128))
    with pytest.raises(ValueError, match=r"\(100, 256\)"):
        FB.quantize_fp8_tiles(jnp.ones((100, 256)), (128, 128))
    # MX: blocks of 32
    with pytest.raises(ValueError, match=r"\(48, 64\)"):
        MX.mxfp4_dot(jnp.ones((32, 48), jnp.bfloat16), jnp.ones((48, 64)))
    with pytest.raises(ValueError, match=r"token count M"):
        jax.vjp(lambda a, b: MX.mxfp8_dot(a, b), jnp.ones((40, 64), jnp.bfloat16), jnp.ones((64, 64)))


def _rel_err(got, want):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64).reshape(want.shape)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_mxfp4_error_exceeds_nvfp4():
    """Same inputs with outliers in x and dY: MXFP4 (blocks of 32, power-of-two scales) is less
    accurate than NVFP4 (blocks of 16, E4M3 scales), in all three GEMMs (NVFP4 with RHT and SR
    off, 16x16 weight tiles). Measured on seeds 0-5: the ratio of relative errors (~0.2 for
    MXFP4) is 1.39-1.44 (fprop), 1.31-1.39 (dgrad), 1.64-1.86 (wgrad); asserted > 1.2.

    Gaussian weights without row/column spread: NVFP4's 16x16 weight tiles share one scale over
    256 values, so isolated 15x outliers in 0.3% of the weights (about half the tiles hold one,
    vs 9% of MX's 32-blocks) or strong per-row magnitude spread make NVFP4's fprop/dgrad error
    exceed MXFP4's -- a real property of 2D weight tiles, not what this test is about."""
    x, w, dy = make_inputs(seed=5, spread=0.0, weight_outliers=False)
    plain = unquantized_operands(x, w, dy)
    exact = {g: a @ b.T for g, (a, b) in plain.items()}
    nv_opts = (("rht", False), ("stochastic_rounding", False), ("weight_2d", True))
    mx = dict(zip(["fprop", "dgrad", "wgrad"], _run_jit(MX.mxfp4_dot, x, w, dy)))
    nv = dict(zip(["fprop", "dgrad", "wgrad"], _run_jit(nvfp4_dot, x, w, dy, nv_opts)))
    for g in exact:
        e_mx, e_nv = _rel_err(mx[g], exact[g]), _rel_err(nv[g], exact[g])
        assert e_mx > 1.2 * e_nv, f"{g}: mxfp4 {e_mx:.4f} vs nvfp4 {e_nv:.4f}"
        assert e_nv > 0.0
    # and the element quantizers themselves, on the activations alone
    x_MK = x.reshape(-1, K).astype(jnp.float32)
    x64 = np.asarray(x_MK, np.float64)
    assert _rel_err(F.qdq_mx(x_MK, F.FP4_E2M1), x64) > _rel_err(F.qdq_nvfp4(x_MK), x64)


@pytest.mark.parametrize("name", NAMES)
def test_jit_equals_eager(name):
    x, w, dy = make_inputs(seed=6)
    fn = RECIPES[name].dot
    eager = run_recipe(fn, x, w, dy)
    jitted = _run_jit(fn, x, w, dy)
    for e, j in zip(eager, jitted):
        assert e.dtype == j.dtype
        np.testing.assert_array_equal(np.asarray(e.astype(jnp.float32)),
                                      np.asarray(j.astype(jnp.float32)))


def test_options_scales_key_ignored():
    x, w, dy = make_inputs(seed=7)
    for name in NAMES:
        fn = RECIPES[name].dot
        a = _run_jit(fn, x, w, dy)
        b = jax.jit(lambda p, q, r: run_recipe(fn, p, q, r, (("ignored", 1),),
                                               jax.random.key(1)))(x, w, dy)
        for u, v in zip(a, b):
            np.testing.assert_array_equal(np.asarray(u.astype(jnp.float32)),
                                          np.asarray(v.astype(jnp.float32)))
