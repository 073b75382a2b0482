"""Hand-written VJPs of the element-wise layers against autodiff of their plain formulas, and
the packed-attention layout computed from segment ids against a NumPy reading of the rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.model.attention import segment_runs, split_heads
from maxfp4.model.activations import relu2, swiglu_product
from maxfp4.model.layers import rms_norm


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _vjp_pair(fn, ref, args, seed):
    """Gradients of <fn(args), c> and <ref(args), c> for a fixed random cotangent c."""
    out = ref(*args)
    c = jax.random.normal(jax.random.key(seed), out.shape, jnp.float32)
    loss = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * c)
    n = len(args)
    return (jax.grad(loss(fn), argnums=tuple(range(n)))(*args),
            jax.grad(loss(ref), argnums=tuple(range(n)))(*args))


def test_rms_norm_gradients_match_autodiff_of_the_formula():
    x = jax.random.normal(jax.random.key(0), (2, 8, 64), jnp.float32) * 3.0
    scale = 1.0 + 0.1 * jax.random.normal(jax.random.key(1), (64,), jnp.float32)

    def ref32(x, s):
        r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)
        return x * r * s

    # The layer returns BF16, so its incoming gradient is BF16 too: the reference rounds alike.
    ref = lambda x, s: ref32(x, s).astype(jnp.bfloat16)

    got, want = _vjp_pair(lambda x, s: rms_norm(x, s, 1e-5), ref, (x, scale), 2)
    # FP32 arithmetic in both, different order: relative error far under 1e-5.
    for g, w in zip(got, want):
        assert _rel(g, w) < 1e-5
    # The forward is the FP32 formula rounded once to BF16.
    np.testing.assert_allclose(np.asarray(rms_norm(x, scale, 1e-5), np.float32), np.asarray(ref32(x, scale)),
                               rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_product_gradient_matches_autodiff(dtype):
    gu = (2.0 * jax.random.normal(jax.random.key(3), (2, 8, 32, 2), jnp.float32)).astype(dtype)
    ref = lambda a: jax.nn.silu(a[..., 0].astype(jnp.float32)) * a[..., 1].astype(jnp.float32)
    (got,), (want,) = _vjp_pair(swiglu_product, ref, (gu,), 4)
    assert got.dtype == dtype and got.shape == gu.shape
    # FP32: rounding only (< 1e-5); BF16 gradients: one BF16 rounding of each element (2^-8).
    assert _rel(got, want) < (1e-5 if dtype == jnp.float32 else 2 ** -8)
    np.testing.assert_array_equal(np.asarray(swiglu_product(gu)), np.asarray(ref(gu)))


def test_swiglu_bf16_gradient_from_packed_pairs_equals_the_fp32_formula_rounded():
    """The BF16 backward unpacks each (gate, up) pair from one 32-bit word: the same FP32
    arithmetic as the general path, so the same bits once that path's result is rounded."""
    gu = (3.0 * jax.random.normal(jax.random.key(7), (2, 16, 48, 2), jnp.float32)).astype(jnp.bfloat16)
    dh = jax.random.normal(jax.random.key(8), (2, 16, 48), jnp.float32)
    _, vjp_bf16 = jax.vjp(swiglu_product, gu)
    _, vjp_f32 = jax.vjp(swiglu_product, gu.astype(jnp.float32))
    got, = vjp_bf16(dh)
    want, = vjp_f32(dh)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                  np.asarray(want.astype(jnp.bfloat16).astype(jnp.float32)))


@pytest.mark.parametrize("rope_theta", [10000.0, None])
def test_split_heads_gradient_matches_autodiff(rope_theta):
    """q, k and v from the qkv GEMM's [B, T, K, G+2, H] output, RoPE on q and k: the
    hand-written backward (one concatenation) against autodiff of the slicing and rotation."""
    b, t, k, g, h = 2, 16, 2, 3, 8
    qkv = (2.0 * jax.random.normal(jax.random.key(9), (b, t, k, g + 2, h), jnp.float32)).astype(jnp.bfloat16)
    positions = jnp.tile(jnp.arange(t, dtype=jnp.int32)[None], (b, 1)) * 37

    def rope(x):  # rotate-half RoPE from its formula, in FP32, rounded once to x's dtype
        inv_freq = 1.0 / rope_theta ** (jnp.arange(h // 2, dtype=jnp.float32) * 2.0 / h)
        angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq
        x32 = x.astype(jnp.float32)
        x1, x2 = x32[..., :h // 2], x32[..., h // 2:]
        return jnp.concatenate([x1 * jnp.cos(angles) - x2 * jnp.sin(angles),
                                x2 * jnp.cos(angles) + x1 * jnp.sin(angles)], axis=-1).astype(x.dtype)

    def plain(a):
        q = a[:, :, :, :g, :].reshape(b, t, k * g, h)
        kk, v = a[:, :, :, g, :], a[:, :, :, g + 1, :]
        if rope_theta is not None:
            q, kk = rope(q), rope(kk)
        return q, kk, v

    got_out = split_heads(qkv, positions, rope_theta)
    for x, y in zip(got_out, plain(qkv)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    cots = [jax.random.normal(jax.random.key(10 + i), x.shape, jnp.float32).astype(jnp.bfloat16)
            for i, x in enumerate(got_out)]
    got, = jax.vjp(lambda a: split_heads(a, positions, rope_theta), qkv)[1](tuple(cots))
    want, = jax.vjp(plain, qkv)[1](tuple(cots))
    assert got.dtype == jnp.bfloat16 and got.shape == qkv.shape
    # The same FP32 products summed in another order, each rounded once to BF16: within one
    # BF16 rounding of each other (2^-8 relative); without RoPE the copies are exact.
    if rope_theta is None:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    else:
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=2 ** -8, atol=1e-6)


def test_relu2_gradient_matches_autodiff():
    a = 2.0 * jax.random.normal(jax.random.key(5), (2, 8, 32), jnp.float32)
    ref = lambda a: jnp.square(jax.nn.relu(a))
    (got,), (want,) = _vjp_pair(relu2, ref, (a,), 6)
    assert _rel(got, want) < 1e-6
    assert np.all(np.asarray(got)[np.asarray(a) < 0] == 0.0)


def _runs_numpy(seg_row):
    """(start, length) of each run of equal ids in one row."""
    cuts = [0] + [t for t in range(1, len(seg_row)) if seg_row[t] != seg_row[t - 1]] + [len(seg_row)]
    return [(s, e - s) for s, e in zip(cuts[:-1], cuts[1:])]


def test_segment_runs_describe_every_run_including_the_padding_tail():
    rng = np.random.default_rng(0)
    rows = [np.array([1, 1, 1, 2, 2, 3, 0, 0]), np.ones(8, int), np.array([1, 2, 3, 4, 5, 6, 7, 0])]
    for _ in range(5):
        cuts = np.sort(rng.choice(np.arange(1, 8), size=rng.integers(0, 4), replace=False))
        rows.append(np.searchsorted(cuts, np.arange(8), side="right") + 1)
    seg = jnp.asarray(np.stack(rows), jnp.int32)
    m = 4
    lengths, starts, runs = (np.asarray(a) for a in segment_runs(seg, m))
    assert lengths.shape == (len(rows), m) and starts.shape == (len(rows), m)
    for b, row in enumerate(rows):
        want = _runs_numpy(row)
        assert runs[b] == len(want)
        if len(want) > m:
            continue  # such a batch takes the masked kernel
        k = len(want)
        assert [tuple(x) for x in zip(starts[b, :k], lengths[b, :k])] == want
        assert np.all(lengths[b, k:] == -1) and np.all(starts[b, k:] == -1)
        assert lengths[b, :k].sum() == len(row)  # every token, the padding too, is in a run


def test_token_losses_forward_and_gradient_match_the_formula():
    from maxfp4.model.loss import token_losses

    logits = (3.0 * jax.random.normal(jax.random.key(7), (2, 8, 50), jnp.float32)).astype(jnp.bfloat16)
    targets = jax.random.randint(jax.random.key(8), (2, 8), 0, 50)
    g = jax.random.normal(jax.random.key(9), (2, 8), jnp.float32)

    def ref(lg):
        lg = lg.astype(jnp.float32)
        return jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(lg, targets[..., None], -1)[..., 0]

    # Forward: float64 NumPy from the same BF16 logits, within FP32 rounding.
    l64 = np.asarray(logits, np.float64)
    want = np.log(np.exp(l64).sum(-1)) - np.take_along_axis(l64, np.asarray(targets)[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(token_losses(logits, targets)), want, rtol=1e-5, atol=1e-5)
    got = jax.grad(lambda lg: jnp.sum(token_losses(lg, targets) * g))(logits)
    ref_grad = jax.grad(lambda lg: jnp.sum(ref(lg) * g))(logits)
    assert got.dtype == jnp.bfloat16
    # Both are the FP32 gradient rounded once to BF16: equal up to one BF16 rounding (2^-8).
    assert _rel(got, ref_grad) < 2 ** -8
