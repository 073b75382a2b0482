"""Mamba-2 SSD core: the chunked form against the sequential scan, a hand-written NumPy loop
for the scan itself, gradients, packed-segment isolation, chunk-size invariance, strong decay.

Error bounds used below (eps64 = 1.1e-16, eps32 = 6e-8; "relative" = max |error| / max |y|):
both forms sum the same products (at most ~5 factors each) in a different order, and the
exponents of the decays are sums of at most max(T, Q) terms, so the rounding difference is
about (T + Q) * eps * (sum of |terms|) / max |y|. With T <= 96 and O(1) inputs this is ~1e-13
in float64 (tests allow 1e-10 forward, 1e-9 for gradients, which add one more pass) and ~1e-5
worst case, ~1e-6 typical, in float32 (tests allow 1e-5).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.model.ssd import ssd_chunked, ssd_reference
from maxfp4.kernels.ssd import ssd_fused

ARG_NAMES = ("x", "dt", "A", "B", "C")


def _inputs(seed, b, t, h, p, g, n, dtype=np.float64, dt_range=(0.01, 1.0), a_range=(0.1, 2.0)):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((b, t, h, p))
    dt = rng.uniform(*dt_range, (b, t, h))
    A = -rng.uniform(*a_range, h)
    B = rng.standard_normal((b, t, g, n))
    C = rng.standard_normal((b, t, g, n))
    return tuple(jnp.asarray(a, dtype) for a in (x, dt, A, B, C))


def _rel(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.all(np.isfinite(actual))
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


@functools.lru_cache(maxsize=None)
def _chunked(chunk_size, impl="xla"):
    """The chunked form: XLA's (ssd_chunked) or the Pallas kernel's (ssd_fused, interpreted)."""
    if impl == "pallas":
        return jax.jit(functools.partial(ssd_fused, chunk_size=chunk_size, interpret=True))
    return jax.jit(functools.partial(ssd_chunked, chunk_size=chunk_size))


_reference = jax.jit(ssd_reference)

# Row 0: a start exactly on a chunk boundary (8, for chunk 8), starts inside chunks (13, 15,
# 31), a 2-token segment shorter than any chunk, a segment spanning three chunks, and a padding
# run of id 0 that crosses a chunk boundary. Row 1: a single document.
PACKED_IDS = np.array([[1] * 8 + [2] * 5 + [3] * 2 + [4] * 16 + [0] * 9, [5] * 40], np.int32)
ROW0_SEGMENTS = [(0, 8), (8, 13), (13, 15), (15, 31), (31, 40)]


def test_reference_matches_handwritten_numpy_loop(x64):
    """The scan against the recurrence written out element by element, with one reset."""
    b, t, p, n = 1, 5, 2, 3
    ids = np.array([[3, 3, 7, 7, 7]], np.int32)
    for h, g in ((2, 1), (2, 2), (4, 2)):
        x, dt, A, B, C = (np.asarray(a) for a in _inputs(1, b, t, h, p, g, n))
        expected = np.zeros((b, t, h, p))
        for head in range(h):
            grp = head // (h // g)
            state = np.zeros((p, n))
            for s in range(t):
                if s == 0 or ids[0, s] != ids[0, s - 1]:
                    state = np.zeros((p, n))
                else:
                    state = np.exp(dt[0, s, head] * A[head]) * state
                for i in range(p):
                    for j in range(n):
                        state[i, j] += dt[0, s, head] * x[0, s, head, i] * B[0, s, grp, j]
                for i in range(p):
                    expected[0, s, head, i] = sum(state[i, j] * C[0, s, grp, j] for j in range(n))
        got = _reference(x, dt, A, B, C, jnp.asarray(ids))
        assert got.dtype == jnp.float64
        assert _rel(got, expected) < 1e-13, (h, g)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("g", [1, 2])
def test_chunked_matches_reference_float64(x64, g, impl):
    b, t, h, p, n = 2, 37, 4, 3, 5  # 37 is not a multiple of any chunk size below
    args = _inputs(2, b, t, h, p, g, n)
    for ids in (np.ones((b, t), np.int32), PACKED_IDS[:, :t]):
        ids = jnp.asarray(ids)
        ref = _reference(*args, ids)
        for q in (4, 8, 16, 64):  # 64 > T: a single padded chunk
            got = _chunked(q, impl)(*args, ids)
            assert got.shape == ref.shape and got.dtype == jnp.float64
            assert _rel(got, ref) < 1e-10, (g, q)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("g,q,t", [(1, 4, 18), (2, 8, 21), (2, 8, 40)])
def test_gradients_match_reference_float64(x64, g, q, t, impl):
    # Head dim 4: a power of two, so the Pallas path passes states with its kernel too.
    b, h, p, n = 2, 4, 4, 5
    args = _inputs(3, b, t, h, p, g, n)
    ids = jnp.asarray(PACKED_IDS[:, :t])
    w = jnp.asarray(np.random.default_rng(4).standard_normal((b, t, h, p)))

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, ids) * w)

    ref_grads = jax.jit(jax.grad(loss(ssd_reference), argnums=range(5)))(*args)
    got_grads = jax.jit(jax.grad(loss(_chunked(q, impl)), argnums=range(5)))(*args)
    for name, got, ref in zip(ARG_NAMES, got_grads, ref_grads):
        assert np.max(np.abs(np.asarray(ref))) > 0, name
        assert _rel(got, ref) < 1e-9, name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_segments_are_isolated(x64, dtype):
    b, t, h, p, g, n = 2, 40, 4, 3, 2, 5
    args = _inputs(5, b, t, h, p, g, n, dtype=dtype)
    ids = jnp.asarray(PACKED_IDS)
    fns = {"reference": _reference, "chunk 8": _chunked(8), "chunk 16": _chunked(16)}
    base = {name: np.asarray(fn(*args, ids)) for name, fn in fns.items()}
    rng = np.random.default_rng(6)
    for lo, hi in ROW0_SEGMENTS:
        # New values for x, dt, B and C inside [lo, hi) of row 0 only.
        changed = []
        for i, a in enumerate(args):
            if i == 2:  # A is per head, not per position
                changed.append(a)
                continue
            fresh = np.array(a)
            fresh[0, lo:hi] = rng.standard_normal(fresh[0, lo:hi].shape)
            if i == 1:
                fresh[0, lo:hi] = np.abs(fresh[0, lo:hi]) + 0.01
            changed.append(jnp.asarray(fresh, dtype))
        outside = np.ones((b, t), bool)
        outside[0, lo:hi] = False
        for name, fn in fns.items():
            y = np.asarray(fn(*changed, ids))
            # Exactly equal: masked contributions are exact zeros, not small numbers.
            np.testing.assert_array_equal(y[outside], base[name][outside], err_msg=f"{name} {lo}:{hi}")
            assert not np.allclose(y[0, lo:hi], base[name][0, lo:hi]), f"{name} {lo}:{hi} unchanged"

    if dtype == np.float64:
        # A packed segment's output equals that segment run on its own: moved to position 0
        # of row 0 with all-zero inputs after it (same shapes, so no new compilation), and at
        # another offset relative to the chunk grid, hence a rounding tolerance.
        for lo, hi in ROW0_SEGMENTS:
            alone = []
            for a in map(np.asarray, args):
                if a.ndim > 1:
                    a = a.copy()
                    a[0] = 0.0
                    a[0, :hi - lo] = np.asarray(args[len(alone)])[0, lo:hi]
                alone.append(jnp.asarray(a))
            alone_ids = jnp.asarray(PACKED_IDS).at[0].set(0)
            for name, fn in fns.items():
                y_alone = fn(*alone, alone_ids)
                assert _rel(base[name][0, lo:hi], y_alone[0, :hi - lo]) < 1e-10, f"{name} {lo}:{hi}"


def test_chunk_size_does_not_change_float32_result():
    b, t, h, p, g, n = 2, 96, 4, 8, 2, 16
    args = _inputs(7, b, t, h, p, g, n, dtype=np.float32)
    ids = jnp.asarray(np.repeat(np.array([[1, 2, 3], [4, 4, 5]], np.int32), [30, 17, 49], axis=1))
    y8 = _chunked(8)(*args, ids)
    assert y8.dtype == jnp.float32
    assert _rel(_reference(*args, ids), y8) < 1e-5
    for q in (1, 16, 128):  # 128 > T: a single padded chunk
        assert _rel(_chunked(q)(*args, ids), y8) < 1e-5, q


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_strong_decay_is_finite_and_accurate(x64, impl):
    """dt up to 10 and A down to -16 (dt*A down to -160 per token, running sums ~ -1e4 per
    chunk) interleaved with small steps that keep some memory. Decays built as differences of
    one cumulative sum are off by up to ~1e4 * eps32 ~ 6e-4 in the exponent here: the XLA form
    avoids them (FP32 bound 1e-5); the Pallas kernel uses them, as Mamba-2's kernels do, so its
    FP32 bound is 5e-3 (a relative error up to ~6e-4 on each decay). float64: 1e-10 for both."""
    b, t, h, p, g, n = 2, 64, 4, 4, 1, 8
    x, _, _, B, C = _inputs(8, b, t, h, p, g, n)
    rng = np.random.default_rng(9)
    big = rng.random((b, t, h)) < 0.5
    dt = jnp.asarray(np.where(big, rng.uniform(0.0, 10.0, (b, t, h)), rng.uniform(1e-3, 0.05, (b, t, h))))
    A = jnp.asarray([-16.0, -4.0, -1.0, -0.5])
    ids = jnp.asarray(np.repeat(np.array([[1, 2, 3], [4, 4, 4]], np.int32), [20, 7, 37], axis=1))
    args64 = (x, dt, A, B, C)
    ref64 = _reference(*args64, ids)
    assert _rel(_chunked(16, impl)(*args64, ids), ref64) < 1e-10

    # float32 against the float64 truth on the same float32-rounded inputs.
    args32 = tuple(a.astype(jnp.float32) for a in args64)
    ref_on_32 = _reference(*(a.astype(jnp.float64) for a in args32), ids)
    assert _rel(_chunked(64, impl)(*args32, ids), ref_on_32) < (1e-5 if impl == "xla" else 5e-3)
    assert _rel(_reference(*args32, ids), ref_on_32) < 1e-5

    grads = jax.jit(jax.grad(lambda *a: jnp.sum(_chunked(16, impl)(*a, ids) ** 2), argnums=range(5)))(*args32)
    for name, gr in zip(ARG_NAMES, grads):
        assert gr.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(gr))), name


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _all_eqns(inner)


def test_bf16_inputs_are_computed_in_fp32():
    b, t, h, p, g, n = 1, 24, 4, 8, 2, 16
    x, dt, A, B, C = _inputs(10, b, t, h, p, g, n, dtype=np.float32)
    bf = tuple(a.astype(jnp.bfloat16) for a in (x, dt, B, C))
    ids = jnp.asarray(np.repeat(np.array([[1, 2]], np.int32), [10, 14], axis=1))
    fn = functools.partial(ssd_chunked, chunk_size=8)
    bf_args = (bf[0], bf[1], A, bf[2], bf[3], ids)

    # Only conversions may touch BF16: every arithmetic op runs on FP32.
    jaxpr = jax.make_jaxpr(fn)(*bf_args).jaxpr
    for eqn in _all_eqns(jaxpr):
        if eqn.primitive.name != "convert_element_type":
            dtypes = [v.aval.dtype for v in eqn.outvars]
            assert jnp.bfloat16 not in dtypes, eqn.primitive.name

    y_bf = jax.jit(fn)(*bf_args)
    assert y_bf.dtype == jnp.bfloat16
    y32 = jax.jit(fn)(*(a.astype(jnp.float32) for a in bf_args[:5]), ids)
    # The only BF16 rounding is the final cast, at most the BF16 unit roundoff 2^-8 relative
    # per element (plus FP32 noise, 1e-6 of the largest output, should the two programs fuse
    # differently).
    y32 = np.asarray(y32)
    err = np.abs(np.asarray(y_bf, np.float32) - y32)
    assert np.all(err <= 2.0 ** -8 * np.abs(y32) + 1e-6 * np.max(np.abs(y32)))


def test_bf16_matmul_operands_stay_close_to_the_fp32_reference():
    """matmul_dtype=bf16 rounds the operands of the four token-length matmuls to BF16 (8-bit
    significand, relative error 2^-9 = 2e-3 each) and accumulates in FP32. A product of two
    rounded operands is off by <= 4e-3 relative, and sums of such products with mixed signs
    can lose a little more relative to max |y|: the bound is 2e-2, forward and gradients, with
    packed segments; still isolated per segment (an exact zero where a segment must not see
    another)."""
    b, t, h, p, g, n = 2, 40, 4, 8, 2, 16
    args = _inputs(11, b, t, h, p, g, n, dtype=np.float32)
    ids = jnp.asarray(PACKED_IDS)
    low = jax.jit(functools.partial(ssd_chunked, chunk_size=8, matmul_dtype=jnp.bfloat16))
    y_ref = _reference(*args, ids)
    assert _rel(low(*args, ids), y_ref) < 2e-2
    assert _rel(low(*args, ids), y_ref) > 0  # it really took the BF16 path

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, ids) * jnp.cos(jnp.arange(b * t * h * p).reshape(b, t, h, p)))
    g_low = jax.grad(loss(low), argnums=(0, 1, 2, 3, 4))(*args)
    g_ref = jax.grad(loss(_reference), argnums=(0, 1, 2, 3, 4))(*args)
    for name, a, e in zip(ARG_NAMES, g_low, g_ref):
        # dL/dA of a head sums signed terms over every token and state entry: the cancellation
        # amplifies the BF16 rounding relative to its (small) result, so it gets 1e-1.
        assert _rel(a, e) < (1e-1 if name == "A" else 2e-2), name
    # Segment isolation: changing the first document leaves the others' outputs bitwise equal.
    x2 = args[0].at[0, :8].multiply(-3.0)
    y1, y2 = low(*args, ids), low(x2, *args[1:], ids)
    np.testing.assert_array_equal(np.asarray(y1[0, 8:]), np.asarray(y2[0, 8:]))


@pytest.mark.parametrize("spec", ["bksgn,bksgrp->bkgnrp", "bklgn,bkgnrp->bklgrp", "bklgn,bksgn->bkgls",
                                  "bkgnrp,bklgn->bklgrp"])
def test_ordered_dot_and_its_gradients_match_numpy_einsum(x64, spec):
    """ordered_dot may swap its operands to write the output in place; the values are the einsum's
    (float64: sums of <= 8 products of O(1) numbers agree to 1e-12), and lowp_einsum_grads are
    the einsum's transposes (checked against NumPy's einsum of the cotangent)."""
    from maxfp4.kernels.ssd_ops import lowp_einsum_grads, ordered_dot

    sizes = {"b": 2, "k": 3, "s": 4, "l": 4, "g": 2, "n": 5, "r": 3, "p": 6}
    (spec_l, spec_r), spec_out = spec.split("->")[0].split(","), spec.split("->")[1]
    rng = np.random.default_rng(3)
    lhs, rhs, cot = (rng.standard_normal([sizes[c] for c in s]) for s in (spec_l, spec_r, spec_out))
    out = ordered_dot(spec, jnp.asarray(lhs), jnp.asarray(rhs))
    assert out.shape == tuple(sizes[c] for c in spec_out)
    np.testing.assert_allclose(out, np.einsum(spec, lhs, rhs), rtol=0, atol=1e-12)
    d_lhs, d_rhs = lowp_einsum_grads(spec, jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(cot))
    np.testing.assert_allclose(d_lhs, np.einsum(f"{spec_out},{spec_r}->{spec_l}", cot, rhs), rtol=0, atol=1e-12)
    np.testing.assert_allclose(d_rhs, np.einsum(f"{spec_out},{spec_l}->{spec_r}", cot, lhs), rtol=0, atol=1e-12)
