"""mlp_up with its activation as one VJP under FP8 delayed scaling (``maxfp4.model.fp8_mlp``):
the activation's backward stores mlp_up's output gradient in E5M2 with its amax, where the
recipe would cast a BF16 copy. Same bits as the recipe's own path, and the stored bytes against
a NumPy float64 reading of the formulas."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maxfp4.config import load_config
from maxfp4.model import fp8_mlp
from maxfp4.model.activations import relu2, swiglu_product
from maxfp4.model.layers import swiglu_mlp
from maxfp4.precision import LayerPrecision, resolve_policy

D, F = 32, 48
E5M2_MAX = 57344.0


def _lp(default: str, scales=None) -> LayerPrecision:
    cfg = load_config(None, [f"precision.default={default}"])
    return LayerPrecision(resolve_policy(cfg.precision, 1), 0, scales)


# Scales that are not powers of two, and a dY scale large enough that E5M2's rounding and its
# clip at 57344 both occur: a value that differs anywhere changes the bits compared below.
SCALES = {"mlp_up": jnp.array([3.7, 51.3, 3.1e6], jnp.float32),
          "mlp_down": jnp.array([2.9, 47.1, 2.3e5], jnp.float32)}


def _inputs(kind):
    gates = 2 if kind == "swiglu" else 1
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (2, 16, D), jnp.float32).astype(jnp.bfloat16)
    w_up = 0.3 * jax.random.normal(keys[1], (D, gates * F), jnp.float32)
    w_down = 0.3 * jax.random.normal(keys[2], (F, D), jnp.float32)
    return x, w_up, w_down, keys[3]


def _activation(kind):
    return (lambda y: swiglu_product(y.reshape(*y.shape[:-1], F, 2))) if kind == "swiglu" else relu2


def _assert_same_bits_and_clipped(got, want):
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    grads = got[1]
    amax_dy = float(grads[-1]["mlp_up"][2])
    assert amax_dy * 3.1e6 > E5M2_MAX, amax_dy  # the largest |dY| of mlp_up clips
    assert np.mean(np.asarray(grads[1]) != 0) > 0.9  # (a squared-ReLU column may be all off)


@pytest.mark.parametrize("kind", ["swiglu", "relu2"])
def test_fused_up_activation_equals_the_recipe_path_bit_for_bit(kind):
    """Output, and gradients of x, w_up and the scales (the amaxes the recipe reports), of the
    fused VJP against ``lp.dot`` then the activation's own VJP, compiled on the CPU."""
    x, w_up, _, key = _inputs(kind)
    weights = jax.random.normal(key, (2, 16, F), jnp.float32)

    def value_and_grads(fn):
        loss = lambda x, w, s: jnp.sum(fn(x, w, _lp("fp8_delayed", s)) * weights)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, w_up, SCALES)

    got = value_and_grads(lambda x, w, lp: fp8_mlp.up_activation(x, w, lp, kind))
    want = value_and_grads(lambda x, w, lp: _activation(kind)(lp.dot(x, w, "mlp_up")))
    _assert_same_bits_and_clipped(got, want)


@pytest.mark.parametrize("kind", ["swiglu", "relu2"])
def test_fused_mlp_equals_the_recipe_path_bit_for_bit(kind):
    """The whole MLP as one VJP (mlp_down's E4M3 input stored by the activation's forward, mlp_up's
    E5M2 output gradient by its backward) against the two recipes and the activation apart:
    output, and the gradients of x, both weights and both layers' scales."""
    x, w_up, w_down, key = _inputs(kind)
    weights = jax.random.normal(key, (2, 16, D), jnp.float32)

    def value_and_grads(fn):
        def loss(x, w_up, w_down, s):
            return jnp.sum(fn(x, w_up, w_down, _lp("fp8_delayed", s)).astype(jnp.float32) * weights)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, w_up, w_down, SCALES)

    def recipe_path(x, w_up, w_down, lp):
        h = _activation(kind)(lp.dot(x, w_up, "mlp_up")).astype(jnp.bfloat16)
        return lp.dot(h, w_down, "mlp_down")

    got = value_and_grads(lambda x, w_up, w_down, lp: fp8_mlp.mlp(x, w_up, w_down, lp, kind))
    want = value_and_grads(recipe_path)
    _assert_same_bits_and_clipped(got, want)
    assert float(got[1][3]["mlp_down"][0]) > 0  # mlp_down's input amax, from the activation


def _bf16_round(v):
    return v.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _e5m2_decoded(v, scale):
    return np.clip(v * scale, -E5M2_MAX, E5M2_MAX).astype(ml_dtypes.float8_e5m2).astype(np.float64)


def test_swiglu_e5m2_gradient_against_numpy():
    """Each pair's two bytes: the gate's gradient in element 0, the up's in element 1, each the
    float64 formula rounded to BF16, scaled, clipped and cast to E5M2. Float64 and the
    kernel's FP32 arithmetic may round a BF16 tie differently, which moves the E5M2 value by at
    most one step (2^-2 relative); the amax is within one BF16 rounding (2^-8)."""
    rng = np.random.default_rng(3)
    gu = (2.0 * rng.normal(size=(4, 8, F, 2))).astype(ml_dtypes.bfloat16)
    dh = rng.normal(size=(4, 8, F)).astype(np.float32)
    scale = np.float32(900.0)
    q, amax = fp8_mlp.swiglu_grad_e5m2(jnp.asarray(gu), jnp.asarray(dh), jnp.asarray(scale))
    assert q.dtype == jnp.float8_e5m2 and q.shape == gu.shape
    g, u = gu[..., 0].astype(np.float64), gu[..., 1].astype(np.float64)
    sig = 1.0 / (1.0 + np.exp(-g))
    d_gate = _bf16_round(dh * u * sig * (1.0 + g * (1.0 - sig)))
    d_up = _bf16_round(dh * g * sig)
    want = np.stack([_e5m2_decoded(d_gate, scale), _e5m2_decoded(d_up, scale)], axis=-1)
    got = np.asarray(q.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, want, rtol=2 ** -2, atol=2 ** -16)
    assert np.mean(got == want) > 0.99  # ties are rare: nearly every byte is the same
    ref_amax = max(np.abs(d_gate).max(), np.abs(d_up).max())
    assert abs(float(amax) - ref_amax) <= 2 ** -8 * ref_amax


def test_relu2_e5m2_gradient_against_numpy():
    rng = np.random.default_rng(4)
    a = (2.0 * rng.normal(size=(4, 8, F))).astype(ml_dtypes.bfloat16)
    dh = rng.normal(size=(4, 8, F)).astype(np.float32)
    scale = np.float32(3000.0)
    q, amax = fp8_mlp.relu2_grad_e5m2(jnp.asarray(a), jnp.asarray(dh), jnp.asarray(scale))
    da = _bf16_round(2.0 * np.maximum(a.astype(np.float64), 0.0) * dh)
    got = np.asarray(q.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(got, _e5m2_decoded(da, scale), rtol=2 ** -2, atol=2 ** -16)
    assert np.all(got[a.astype(np.float32) <= 0] == 0.0)
    assert abs(float(amax) - np.abs(da).max()) <= 2 ** -8 * np.abs(da).max()


def test_the_mlp_takes_the_fused_paths_only_for_fp8_delayed_with_scales():
    assert fp8_mlp.up_fused(_lp("fp8_delayed", SCALES)) and fp8_mlp.mlp_fused(_lp("fp8_delayed", SCALES))
    assert not fp8_mlp.up_fused(_lp("fp8_delayed"))
    assert not fp8_mlp.up_fused(_lp("fp8_current", SCALES))
    assert not fp8_mlp.up_fused(_lp("bf16"))
    only_up = load_config(None, ["precision.default=fp8_delayed", "precision.rules=[{classes: [mlp_down], recipe: bf16}]"])
    lp_only_up = LayerPrecision(resolve_policy(only_up.precision, 1), 0, SCALES)
    assert fp8_mlp.up_fused(lp_only_up) and not fp8_mlp.mlp_fused(lp_only_up)
    # And the whole SwiGLU MLP (mlp_down on the recipe's own path) runs and differentiates.
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(2, 16, D)), jnp.bfloat16)
    w_up = jnp.asarray(0.3 * rng.normal(size=(D, F, 2)), jnp.float32)
    w_down = jnp.asarray(0.3 * rng.normal(size=(F, D)), jnp.float32)
    loss = lambda w_up, scales: jnp.sum(swiglu_mlp(x, w_up, w_down, _lp("fp8_delayed", scales)).astype(jnp.float32))
    dw_up, dscales = jax.grad(loss, argnums=(0, 1))(w_up, SCALES)
    assert dw_up.shape == (D, F, 2) and np.all(np.isfinite(np.asarray(dw_up)))
    assert float(dscales["mlp_up"][2]) > 0 and float(dscales["mlp_down"][2]) > 0
