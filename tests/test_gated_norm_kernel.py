"""The Mamba-2 mixer's epilogue kernel (SiLU gate, RMSNorm per group; interpret mode on
CPU) against the formula written in NumPy, float64: forward and every gradient, bound 1e-12
relative to the largest magnitude (tens of multiply-adds per element; float64 leaves ~1e-15)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.kernels.gated_norm import gated_norm_fused, gated_norm_supported

EPS = 1e-5


def _numpy_forward(u, z, scale, groups):
    """out = RMSNorm per group of u * silu(z), times scale."""
    b, t, e = u.shape
    g = u * z / (1.0 + np.exp(-z))
    g = g.reshape(b, t, groups, e // groups)
    g = g / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + EPS)
    return g.reshape(b, t, e) * scale


def _numpy_gradients(u, z, scale, groups, w):
    """Gradients of sum(out * w), by the chain rule from the forward formula."""
    b, t, e = u.shape
    eg = e // groups
    sig = 1.0 / (1.0 + np.exp(-z))
    g = (u * z * sig).reshape(b, t, groups, eg)
    r = 1.0 / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + EPS)
    ws = (w * scale).reshape(b, t, groups, eg)
    dg = (ws * r - g * r ** 3 * np.sum(g * ws, axis=-1, keepdims=True) / eg).reshape(b, t, e)
    du = dg * z * sig
    dz = dg * u * sig * (1.0 + z * (1.0 - sig))
    dscale = np.sum(w * (g * r).reshape(b, t, e), axis=(0, 1))
    return du, dz, dscale


def _rel(got, expected):
    expected = np.asarray(expected, np.float64)
    return float(np.max(np.abs(np.asarray(got, np.float64) - expected)) / np.max(np.abs(expected)))


@pytest.mark.parametrize("e,groups,extra", [(64, 1, 0), (512, 1, 24), (1024, 2, 8), (4096, 1, 8)])
def test_matches_numpy_forward_and_gradients(x64, e, groups, extra):
    """extra: columns after the first E of the array z is read from (left untouched).
    Groups of 64 and 512 columns take several rows a tile, 4096 one row; T = 32 is two of the
    backward's 16-row blocks."""
    b, t = 2, 32
    rng = np.random.default_rng(e)
    u = rng.standard_normal((b, t, e))
    zx = rng.standard_normal((b, t, e + 2 * extra)) * 2.0
    scale = rng.uniform(0.5, 1.5, e)
    w = rng.standard_normal((b, t, e))
    z = zx[..., :e]

    def fused(u, zx, scale):
        return gated_norm_fused(u, zx, scale, groups, EPS, jnp.float64, True)

    out = jax.jit(fused)(u, zx, scale)
    assert out.dtype == jnp.float64
    assert _rel(out, _numpy_forward(u, z, scale, groups)) < 1e-12

    grads = jax.jit(jax.grad(lambda *a: jnp.sum(fused(*a) * w), argnums=range(3)))(u, zx, scale)
    du, dz, dscale = _numpy_gradients(u, z, scale, groups, w)
    assert _rel(grads[0], du) < 1e-12
    assert _rel(grads[1][..., :e], dz) < 1e-12 and np.all(np.asarray(grads[1])[..., e:] == 0)
    assert _rel(grads[2], dscale) < 1e-12


def test_bf16_gate_source_and_output():
    """z read from a BF16 array (the in_proj output), BF16 output: the gradient of that array
    comes back in BF16, and the result is the FP32 formula on the same inputs to BF16 rounding."""
    b, t, e = 1, 16, 256
    rng = np.random.default_rng(1)
    u = jnp.asarray(rng.standard_normal((b, t, e)), jnp.float32)
    zx = jnp.asarray(rng.standard_normal((b, t, e + 16)), jnp.bfloat16)
    scale = jnp.ones((e,), jnp.float32)

    def fused(zx):
        return gated_norm_fused(u, zx, scale, 1, EPS, jnp.bfloat16, True)

    out = fused(zx)
    assert out.dtype == jnp.bfloat16
    expected = _numpy_forward(*(np.asarray(a, np.float64) for a in (u, zx[..., :e], scale)), 1)
    assert _rel(out, expected) < 1e-2  # BF16 output: 2^-8 relative per element
    dzx = jax.grad(lambda zx: jnp.sum(fused(zx).astype(jnp.float32)))(zx)
    assert dzx.dtype == jnp.bfloat16 and dzx.shape == zx.shape


def test_supported_shapes():
    assert gated_norm_supported(2048, 4096, 1) and gated_norm_supported(8192, 8192, 8)
    assert gated_norm_supported(16, 16, 1)
    assert not gated_norm_supported(24, 4096, 1)  # T not a multiple of 16
    assert not gated_norm_supported(16, 4096, 3)  # groups do not divide E
    assert not gated_norm_supported(16, 96 * 3, 3)  # group width 96: not a power of two
    assert not gated_norm_supported(16, 8192, 1)  # a row of 8192 does not fit one tile
