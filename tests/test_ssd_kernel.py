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
from maxfp4.kernels.ssd import Tiling, default_tiling, kernel_supported, ssd_fused
from maxfp4.kernels.support import check_mamba_kernels
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


@pytest.mark.parametrize("g,heads", [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)])
def test_d_skip_and_heads_per_program_float64(x64, g, heads):
    """The kernel's D skip (y + D x) and each number of heads per program: forward and every
    gradient, D's included, against the sequential scan plus D x, float64 (bounds of
    test_ssd.py: 1e-10 forward, 1e-9 gradients). A program of several heads loads their group's
    C.B once and sums d(C.B) over them itself."""
    b, t, h, p, n, q = 2, 21, 4, 4, 5, 8
    args = _inputs(7, b, t, h, p, g, n) + (jnp.asarray(np.random.default_rng(8).uniform(0.5, 1.5, h)),)
    ids = jnp.asarray(PACKED_IDS[:, :t])
    w = jnp.asarray(np.random.default_rng(9).standard_normal((b, t, h, p)))

    def fused(x, dt, A, B, C, D):
        return ssd_fused(x, dt, A, B, C, ids, q, interpret=True, tiling=Tiling(heads=heads), D_H=D)

    def reference(x, dt, A, B, C, D):
        return ssd_reference(x, dt, A, B, C, ids) + D[:, None] * x

    assert _rel(jax.jit(fused)(*args), jax.jit(reference)(*args)) < 1e-10
    got = jax.jit(jax.grad(lambda *a: jnp.sum(fused(*a) * w), argnums=range(6)))(*args)
    ref = jax.jit(jax.grad(lambda *a: jnp.sum(reference(*a) * w), argnums=range(6)))(*args)
    for name, a, e in zip(ARG_NAMES + ("D",), got, ref):
        assert _rel(a, e) < 1e-9, name


def test_x_read_in_place_from_a_wider_array(x64):
    """x as the first H x P columns of a wider array (as the mixer passes the convolution output):
    the same outputs, and the wider array's gradient is x's in those columns and exactly the
    other uses' (here none: zero) past them. T a multiple of the chunk, as the kernel needs."""
    b, t, h, p, g, n, q = 2, 24, 4, 4, 1, 5, 8
    x, dt, A, B, C = _inputs(10, b, t, h, p, g, n)
    wide = jnp.concatenate([x.reshape(b, t, h * p), jnp.full((b, t, 2 * p), 7.0)], axis=-1)
    ids = jnp.asarray(PACKED_IDS[:, :t])
    w = jnp.asarray(np.random.default_rng(11).standard_normal((b, t, h, p)))

    def fused(wide, in_place):
        x_BTHP = wide[..., :h * p].reshape(b, t, h, p)
        return ssd_fused(x_BTHP, dt, A, B, C, ids, q, interpret=True, x_within_BTC=wide if in_place else None)

    y_in_place, y_copy = jax.jit(fused, static_argnums=1)(wide, True), jax.jit(fused, static_argnums=1)(wide, False)
    assert _rel(y_in_place, _reference(x, dt, A, B, C, ids)) < 1e-10
    np.testing.assert_array_equal(np.asarray(y_in_place), np.asarray(y_copy))
    grad = jax.jit(jax.grad(lambda a, m: jnp.sum(fused(a, m) * w)), static_argnums=1)
    g_in_place, g_copy = np.asarray(grad(wide, True)), np.asarray(grad(wide, False))
    assert np.all(g_in_place[..., h * p:] == 0) and np.any(g_in_place[..., :h * p] != 0)
    assert _rel(g_in_place, g_copy) < 1e-12


def test_heads_per_program_choice():
    """The default walks the largest power of two of a group's heads up to 16 (Triton block sides
    are powers of two); a count that does not divide the group's heads is refused."""
    assert default_tiling(128, 64).heads == 16 and default_tiling(128, 12).heads == 4
    assert default_tiling(128, 3).heads == 1 and default_tiling(64, 2) == Tiling(num_warps=4, heads=2)
    args = _inputs(1, 1, 16, 4, 4, 2, 4, dtype=np.float32)
    with pytest.raises(ValueError, match=r"heads per program \(4\) must divide the heads per group \(2\)"):
        ssd_fused(*args, jnp.ones((1, 16), jnp.int32), 8, interpret=True, tiling=Tiling(heads=4))


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
    # The kernels' own tile rules, run by the trainer at start-up (hybrid-tiny's head_dim 8 cannot tile).
    cfg = load_config(TINY, ["model.mamba.kernels=pallas"])
    with pytest.raises(ConfigError, match=r"model.mamba.kernels='pallas': expected xla or auto unless chunk_size"):
        check_mamba_kernels(cfg.model, cfg.data.seq_len)
    cfg = load_config(TINY, ["model.mamba.head_dim=16", "model.mamba.d_state=16", "model.mamba.chunk_size=16",
                             "model.mamba.kernels=pallas", "data.seq_len=36"])
    with pytest.raises(ConfigError, match=r"expected xla or auto unless data.seq_len \(36\) is a multiple of 8"):
        check_mamba_kernels(cfg.model, cfg.data.seq_len)
    with pytest.raises(ConfigError, match=r"model.mamba.kernels='triton': expected auto, xla or pallas"):
        load_config(TINY, ["model.mamba.kernels=triton"])


def test_chunk_entry_states_equals_the_matmul_then_the_recurrence():
    """chunk_entry_states (one VJP, the states' gradient rounded to BF16 by the recurrence
    kernel) against the two pieces it fuses, each differentiated on its own (the BF16 matmul
    with its own VJP, then the recurrence kernel in FP32, whose FP32 state gradient the matmul's
    VJP rounds to BF16): same products, same roundings, so equal bit for bit."""
    from maxfp4.kernels.ssd_ops import lowp_einsum
    from maxfp4.kernels.ssd import chunk_entry_states
    from maxfp4.kernels.state_passing import entry_states

    b, k, q, g, r, p, n = 2, 3, 8, 2, 2, 16, 16
    rng = np.random.default_rng(5)
    B = jnp.asarray(rng.standard_normal((b, k, q, g, n)), jnp.bfloat16)
    wx = jnp.asarray(rng.standard_normal((b, k, q, g, r, p)), jnp.bfloat16)
    decay = jnp.asarray(rng.uniform(0.2, 1.0, (b, k, g, r)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((b, k, g, n, r, p)), jnp.float32)

    def fused(B, wx, decay):
        return jnp.sum(chunk_entry_states(B, wx, decay, True).astype(jnp.float32) * weights)

    def pieces(B, wx, decay):
        states = lowp_einsum("bksgn,bksgrp->bkgnrp", B, wx, jnp.float32)
        return jnp.sum(entry_states(states, decay, True, jnp.bfloat16).astype(jnp.float32) * weights)

    v_fused, g_fused = jax.value_and_grad(fused, argnums=(0, 1, 2))(B, wx, decay)
    v_pieces, g_pieces = jax.value_and_grad(pieces, argnums=(0, 1, 2))(B, wx, decay)
    assert v_fused == v_pieces
    for name, a, e in zip(("B", "wx", "decay"), g_fused, g_pieces):
        assert a.dtype == e.dtype, name
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32), err_msg=name)
        assert np.any(np.asarray(a, np.float32) != 0), name
