"""The Pallas causal convolution + SiLU (interpret mode on CPU) against the jax.numpy one of the
Mamba mixer, forward and the gradients of x, the weights and the bias, with packed documents.

Bound: 1e-5 of the largest magnitude in FP32. Both sum the same W products per output in FP32
(kernel: bias first, then lags in order; reference: in another order), so they differ by a few
FP32 roundings, ~1e-7 relative; the weight gradients sum B*T products in different orders
(tile partial sums), ~1e-6.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.config import ConfigError, load_config
from maxfp4.kernels.support import check_mamba_kernels
from maxfp4.kernels.conv import (ConvTiling, causal_conv_silu, conv_backward, conv_forward, conv_kernel_supported,
                                      default_conv_tiling)
from maxfp4.model.mamba import causal_conv, use_conv_kernel
from tests.test_hybrid import TINY


def _reference(x, w, b, ids):
    return jax.nn.silu(causal_conv(x.astype(jnp.float32), w, b, ids)).astype(x.dtype)


def _rel(a, e):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.max(np.abs(a - e)) / np.max(np.abs(e)))


@pytest.mark.parametrize("width", [4, 2])
def test_kernel_matches_reference_with_packed_documents(width):
    rng = np.random.default_rng(width)
    b, t, c = 2, 48, 80  # tiles of 16 x 16: several tiles along T and along channels
    x = jnp.asarray(rng.standard_normal((b, t, c)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((width, c)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(c), jnp.float32)
    # Row 0: documents of 3 (shorter than the kernel), 13 and 2 tokens, then one crossing the
    # tile boundary at 16 and 32; row 1 a single document.
    ids = jnp.asarray(np.array([[1] * 3 + [2] * 13 + [3] * 2 + [4] * 30, [7] * 48], np.int32))
    got = jax.jit(lambda *a: causal_conv_silu(*a, ids, True))
    assert _rel(got(x, w, bias), _reference(x, w, bias, ids)) < 1e-5
    dout = jnp.asarray(rng.standard_normal((b, t, c)), jnp.float32)
    g_got = jax.grad(lambda *a: jnp.sum(got(*a) * dout), argnums=(0, 1, 2))(x, w, bias)
    g_ref = jax.grad(lambda *a: jnp.sum(_reference(*a, ids) * dout), argnums=(0, 1, 2))(x, w, bias)
    for name, a, e in zip(("x", "w", "b"), g_got, g_ref):
        assert _rel(a, e) < 1e-5, name


@pytest.mark.parametrize("tiling", [ConvTiling(8, 16), ConvTiling(16, 32), ConvTiling(48, 16)])
def test_any_launch_tiling_gives_the_defaults_values(tiling):
    """The tile each program owns (rows x channels) changes no value: the output and the input
    gradient are equal bit for bit; the weight and bias gradients, sums of per-tile partial
    sums in another grouping, within FP32 rounding (1e-6 of the largest)."""
    rng = np.random.default_rng(5)
    b, t, c = 2, 48, 32
    x = jnp.asarray(rng.standard_normal((b, t, c)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, c)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(c), jnp.float32)
    ids = jnp.asarray(np.array([[1] * 3 + [2] * 20 + [3] * 25, [7] * 48], np.int32))
    dout = jnp.asarray(rng.standard_normal((b, t, c)), jnp.float32)
    default = default_conv_tiling(t, c)
    assert default == ConvTiling(16, 32)

    def run(tiling):
        out, res = conv_forward(x, w, bias, ids, True, tiling)
        return (out,) + conv_backward(res, dout, True, tiling=tiling)

    got, want = run(tiling), run(default)
    for name, a, e in zip(("out", "dx"), got[:2], want[:2]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=name)
    for name, a, e in zip(("dw", "db"), got[2:], want[2:]):
        assert _rel(a, e) < 1e-6, name


def test_a_tile_that_does_not_divide_the_input_is_refused():
    x = jnp.zeros((1, 48, 32), jnp.float32)
    with pytest.raises(ValueError, match=r"convolution tile 32 x 16 does not divide T x channels 48 x 32"):
        conv_forward(x, jnp.zeros((4, 32)), jnp.zeros(32), jnp.ones((1, 48), jnp.int32), True, ConvTiling(32, 16))


def test_kernel_never_reads_an_earlier_document():
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((1, 32, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    bias = jnp.zeros(16, jnp.float32)
    ids = jnp.asarray(np.array([[1] * 10 + [2] * 22], np.int32))
    base = np.asarray(causal_conv_silu(x, w, bias, ids, True))
    changed = np.asarray(causal_conv_silu(x.at[0, :10].multiply(-5.0), w, bias, ids, True))
    np.testing.assert_array_equal(changed[0, 10:], base[0, 10:])
    assert not np.allclose(changed[0, :10], base[0, :10])


def test_bf16_input_computes_in_fp32_and_stores_bf16():
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, 32)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(32), jnp.float32)
    ids = jnp.ones((2, 16), jnp.int32)
    got = causal_conv_silu(x, w, bias, ids, True)
    assert got.dtype == jnp.bfloat16
    ref = jax.nn.silu(causal_conv(x.astype(jnp.float32), w, bias, ids))
    # One BF16 rounding of the FP32 result: 2^-8 relative per element (plus FP32 noise).
    err = np.abs(np.asarray(got, np.float32) - np.asarray(ref))
    assert np.all(err <= 2.0 ** -8 * np.abs(np.asarray(ref)) + 1e-5)


def test_kernel_choice():
    assert conv_kernel_supported(2048, 4352) and not conv_kernel_supported(30, 64) and not conv_kernel_supported(64, 24)
    cfg = load_config(TINY, ["model.mamba.head_dim=16", "model.mamba.d_state=16", "model.mamba.chunk_size=16",
                             "model.mamba.kernels=pallas"])
    assert use_conv_kernel(cfg.model, 32, 192) and not use_conv_kernel(cfg.model, 30, 192)
    bad = load_config(TINY, ["model.mamba.head_dim=16", "model.mamba.d_state=16", "model.mamba.chunk_size=16",
                             "model.mamba.kernels=pallas", "data.seq_len=36"])
    with pytest.raises(ConfigError, match=r"model.mamba.kernels='pallas': expected xla or auto unless data.seq_len \(36\)"):
        check_mamba_kernels(bad.model, bad.data.seq_len)  # the trainer's start-up check
