"""The Pallas SSD kernel (interpret mode on CPU) against the sequential scan: forward and all
gradients in float64, packed segments, chunk sizes, groups, BF16 operands, strong decay, and the
whole hybrid model with model.mamba.kernels=pallas against the XLA path.

Bounds as in test_ssd.py (its docstring derives them): 1e-10 forward and 1e-9 gradients in
float64. The kernel's decays are exp(cs_i - cs_j), differences of one running sum, which adds a
rounding error of about eps * |cs| to each exponent: |cs| <= Q * max(dt) * max(|A|) <= 16 * 1 * 2
here, 3e-15 in float64, far inside the bound.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.config import ConfigError, load_config
from maxfp4.model import get_model
from maxfp4.model.layers import ACT_DTYPE
from maxfp4.model.mamba import use_ssd_kernel
from maxfp4.model.ssd import ssd_reference
from maxfp4.model.ssd_kernel import kernel_supported, ssd_fused
from maxfp4.precision import resolve_policy
from tests.test_hybrid import TINY
from tests.test_ssd import ARG_NAMES, PACKED_IDS, _inputs, _rel

_reference = jax.jit(ssd_reference)


@functools.lru_cache(maxsize=None)
def _fused(chunk_size, matmul_dtype=None):
    return jax.jit(functools.partial(ssd_fused, chunk_size=chunk_size, matmul_dtype=matmul_dtype, interpret=True))


@pytest.mark.parametrize("g", [1, 2])
def test_kernel_matches_reference_float64(x64, g):
    b, t, h, p, n = 2, 37, 4, 3, 5  # 37 is not a multiple of any chunk size below
    args = _inputs(2, b, t, h, p, g, n)
    for ids in (np.ones((b, t), np.int32), PACKED_IDS[:, :t]):
        ids = jnp.asarray(ids)
        ref = _reference(*args, ids)
        for q in (4, 8, 64):  # 64 > T: a single padded chunk
            got = _fused(q)(*args, ids)
            assert got.shape == ref.shape and got.dtype == jnp.float64
            assert _rel(got, ref) < 1e-10, (g, q)


@pytest.mark.parametrize("g,q,t", [(1, 4, 18), (2, 8, 21), (2, 8, 40)])
def test_kernel_gradients_match_reference_float64(x64, g, q, t):
    b, h, p, n = 2, 4, 3, 5
    args = _inputs(3, b, t, h, p, g, n)
    ids = jnp.asarray(PACKED_IDS[:, :t])
    w = jnp.asarray(np.random.default_rng(4).standard_normal((b, t, h, p)))

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, ids) * w)

    ref_grads = jax.jit(jax.grad(loss(ssd_reference), argnums=range(5)))(*args)
    got_grads = jax.jit(jax.grad(loss(_fused(q)), argnums=range(5)))(*args)
    for name, got, ref in zip(ARG_NAMES, got_grads, ref_grads):
        assert np.max(np.abs(np.asarray(ref))) > 0, name
        assert _rel(got, ref) < 1e-9, name


def test_kernel_keeps_segments_apart(x64):
    """Changing one packed document changes no output outside it (exactly)."""
    b, t, h, p, g, n = 2, 40, 4, 3, 2, 5
    args = _inputs(5, b, t, h, p, g, n)
    ids = jnp.asarray(PACKED_IDS)
    fn = _fused(8)
    base = np.asarray(fn(*args, ids))
    for lo, hi in [(8, 13), (15, 31)]:
        x = np.array(args[0])
        x[0, lo:hi] += 1.0
        y = np.asarray(fn(jnp.asarray(x), *args[1:], ids))
        outside = np.ones((b, t), bool)
        outside[0, lo:hi] = False
        np.testing.assert_array_equal(y[outside], base[outside])
        assert not np.allclose(y[0, lo:hi], base[0, lo:hi])


def test_kernel_bf16_operands_stay_close_to_the_fp32_reference():
    """Same bounds as the XLA path's BF16 test (2e-2 of max |y|, forward and gradients but A)."""
    b, t, h, p, g, n = 2, 40, 4, 8, 2, 16
    args = _inputs(11, b, t, h, p, g, n, dtype=np.float32)
    ids = jnp.asarray(PACKED_IDS)
    low = _fused(8, jnp.bfloat16)
    y_ref = _reference(*args, ids)
    assert 0 < _rel(low(*args, ids), y_ref) < 2e-2

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, ids) * jnp.cos(jnp.arange(b * t * h * p).reshape(b, t, h, p)))
    g_low = jax.grad(loss(low), argnums=range(5))(*args)
    g_ref = jax.grad(loss(_reference), argnums=range(5))(*args)
    for name, a, e in zip(ARG_NAMES, g_low, g_ref):
        # dL/dA sums signed terms over every token: cancellation, hence 1e-1 (as in test_ssd).
        assert _rel(a, e) < (1e-1 if name == "A" else 2e-2), name


def test_kernel_strong_decay_is_finite_and_close(x64):
    """dt up to 10 and A down to -16: running sums of dt*A reach ~ -1e4 in a chunk of 16, so in
    FP32 the differences cs_i - cs_j carry an absolute error up to ~1e4 * 6e-8 = 6e-4, i.e. a
    relative error up to ~6e-4 on a decay (bound 5e-3 of max |y|). float64 stays at 1e-10."""
    b, t, h, p, g, n = 2, 64, 4, 4, 1, 8
    x, _, _, B, C = _inputs(8, b, t, h, p, g, n)
    rng = np.random.default_rng(9)
    big = rng.random((b, t, h)) < 0.5
    dt = jnp.asarray(np.where(big, rng.uniform(0.0, 10.0, (b, t, h)), rng.uniform(1e-3, 0.05, (b, t, h))))
    A = jnp.asarray([-16.0, -4.0, -1.0, -0.5])
    ids = jnp.asarray(np.repeat(np.array([[1, 2, 3], [4, 4, 4]], np.int32), [20, 7, 37], axis=1))
    args64 = (x, dt, A, B, C)
    assert _rel(_fused(16)(*args64, ids), _reference(*args64, ids)) < 1e-10
    args32 = tuple(a.astype(jnp.float32) for a in args64)
    ref_on_32 = _reference(*(a.astype(jnp.float64) for a in args32), ids)
    assert _rel(_fused(16)(*args32, ids), ref_on_32) < 5e-3
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(_fused(16)(*a, ids) ** 2), argnums=range(5)))(*args32)
    for name, gr in zip(ARG_NAMES, grads):
        assert gr.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(gr))), name


def test_hybrid_model_with_kernel_matches_xla_path():
    """The whole tiny hybrid stack, loss and every parameter gradient, Pallas kernel against
    XLA's chunked SSD, both with FP32 SSD matmuls. The two agree to ~1e-6 before the SSD output
    is stored in BF16; that rounding (2^-9 relative) can then fall on either side, so the bound
    is 1e-2 of the largest magnitude (a wrong kernel is off by O(1))."""
    shapes = ["model.mamba.head_dim=16", "model.mamba.d_state=16", "model.mamba.chunk_size=16",
              "model.mamba.ssd_matmul=fp32"]
    grads = {}
    for impl in ("xla", "pallas"):
        cfg = load_config(TINY, shapes + [f"model.mamba.kernels={impl}"])
        model = get_model(cfg.model)
        params = model.init_params(cfg.model, jax.random.key(0))
        policy = resolve_policy(cfg.precision, cfg.model.n_layers)
        T = 48
        x = 0.5 * jax.random.normal(jax.random.key(1), (2, T, cfg.model.d_model), jnp.float32)
        pos = jnp.tile(jnp.arange(T, dtype=jnp.int32)[None], (2, 1))
        seg = jnp.asarray(np.repeat(np.array([[1, 2], [3, 3]], np.int32), [20, 28], axis=1))

        def loss(params, x):
            y = model.forward_embedded(params, x.astype(ACT_DTYPE), pos, seg, cfg=cfg.model, policy=policy)
            return jnp.sum(jnp.square(y.astype(jnp.float32)))
        grads[impl] = jax.jit(jax.value_and_grad(loss))(params, x)
    (l_x, g_x), (l_p, g_p) = grads["xla"], grads["pallas"]
    assert abs(float(l_p) - float(l_x)) <= 1e-2 * abs(float(l_x))
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(g_p), jax.tree_util.tree_leaves(g_x)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert np.max(np.abs(a - e)) <= 1e-2 * max(np.max(np.abs(e)), 1e-30), jax.tree_util.keystr(path)


def test_kernel_choice_in_config():
    assert kernel_supported(128, 64, 128) and not kernel_supported(16, 8, 16) and not kernel_supported(48, 64, 128)
    # auto never picks the kernel off GPU (interpret mode is for tests, not training speed).
    cfg = load_config(TINY, ["model.mamba.head_dim=16", "model.mamba.d_state=16", "model.mamba.chunk_size=16"])
    assert cfg.model.mamba.kernels == "auto" and use_ssd_kernel(cfg.model) == (jax.default_backend() == "gpu")
    assert use_ssd_kernel(load_config(TINY, ["model.mamba.head_dim=16", "model.mamba.d_state=16",
                                             "model.mamba.chunk_size=16", "model.mamba.kernels=pallas"]).model)
    with pytest.raises(ConfigError, match=r"model.mamba.kernels='pallas': expected xla or auto unless"):
        load_config(TINY, ["model.mamba.kernels=pallas"])  # hybrid-tiny's head_dim 8 cannot tile
    with pytest.raises(ConfigError, match=r"model.mamba.kernels='triton': expected auto, xla or pallas"):
        load_config(TINY, ["model.mamba.kernels=triton"])
