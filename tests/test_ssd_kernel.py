"""The Pallas SSD kernel (interpret mode on CPU): packed segments kept apart, BF16 operands
against the sequential scan, the whole hybrid model with model.mamba.kernels=pallas against the
XLA path, and the config switch. Forward and all gradients in float64 for several chunk sizes
and groups, and strong decay, are the ``impl="pallas"`` cases of test_ssd.py.

The kernel's decays are exp(cs_i - cs_j), differences of one running sum, which adds a rounding
error of about eps * |cs| to each exponent: |cs| <= Q * max(dt) * max(|A|) <= 8 * 1 * 2 in the
tests here, negligible against their bounds.
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


def test_hybrid_model_with_kernel_matches_xla_path():
    """The whole tiny hybrid stack, loss and every parameter gradient, Pallas kernels against
    the XLA path, both with FP32 SSD matmuls. The mixer stores its activations and their
    gradients in BF16 between kernels, and the two paths sum in different orders before that
    rounding, so they agree to BF16 precision through a few blocks: bound 3e-2 relative L2 per
    leaf (measured ~1e-2: a few BF16 ulps of 2^-8) and 1e-3 on the loss (measured 5e-5). A wrong
    kernel or a misread input is off by O(1). Each kernel alone is held to float64 tightly by
    its own tests."""
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
    assert abs(float(l_p) - float(l_x)) <= 1e-3 * abs(float(l_x))
    for (path, a), e in zip(jax.tree_util.tree_leaves_with_path(g_p), jax.tree_util.tree_leaves(g_x)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert np.linalg.norm(a - e) <= 3e-2 * np.linalg.norm(e), jax.tree_util.keystr(path)


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
