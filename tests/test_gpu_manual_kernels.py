"""On a Hopper GPU: the kernels bound by hand, against references.

- The Mosaic GPU grouped GEMMs (maxfp4.kernels.grouped_gemm) against a float64 NumPy product
  per group, including an empty group and rows past the groups, which must come out 0.
- cuDNN's attention bound directly under ``shard_map`` (maxfp4.kernels.cudnn_attention): the
  causal, packed and masked forms, parts merged by their log-sum-exp, and the context-parallel
  split attention, against XLA's attention (which the CPU tests check against float64), forward
  and backward.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from maxfp4.config import load_config
from maxfp4.kernels import grouped_gemm
from maxfp4.model.attention import attend
from maxfp4.parallel.context import context_attention, zigzag_order
from maxfp4.parallel.mesh import make_mesh, traced_in_mesh

pytestmark = pytest.mark.gpu


def _groups(rng, m, g):
    experts = np.sort(rng.integers(0, g + 1, m))  # g: past every group (a dropped assignment)
    experts[experts == 3] = 4  # group 3 empty
    return np.bincount(experts, minlength=g + 1)[:g].astype(np.int32)


def test_mosaic_grouped_gemms_match_a_float64_product_per_group():
    assert grouped_gemm.available()
    rng = np.random.default_rng(0)
    m, k, n, g = 2000, 256, 384, 8
    sizes = _groups(rng, m, g)
    x = rng.standard_normal((m, k)).astype(np.float32)
    dy = rng.standard_normal((m, n)).astype(np.float32)
    w = (0.1 * rng.standard_normal((g, k, n))).astype(np.float32)
    x, dy, w = (np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64) for a in (x, dy, w))  # what the kernels see
    ends = np.cumsum(sizes)
    starts = ends - sizes
    want_y, want_dx = np.zeros((m, n)), np.zeros((m, k))
    want_dw = np.zeros((g, k, n))
    for e in range(g):
        rows = slice(starts[e], ends[e])
        want_y[rows] = x[rows] @ w[e]
        want_dx[rows] = dy[rows] @ w[e].T
        want_dw[e] = x[rows].T @ dy[rows]
    b16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    got_y = jax.jit(grouped_gemm.ragged)(b16(x), b16(w), jnp.asarray(sizes))
    got_dx = jax.jit(grouped_gemm.ragged_t)(b16(dy), b16(w), jnp.asarray(sizes))
    got_dw = jax.jit(grouped_gemm.ragged_wgrad)(b16(x), b16(dy), jnp.asarray(sizes))
    for got, want in ((got_y, want_y), (got_dx, want_dx), (got_dw, want_dw)):
        got = np.asarray(got, np.float64)
        # FP32 accumulation, one BF16 rounding of the output: 2^-8 of each value, plus summation
        # order, within 2^-7 of the largest.
        assert np.max(np.abs(got - want)) <= 2.0**-7 * np.max(np.abs(want))
    assert not np.any(np.asarray(got_y)[ends[-1]:]) and not np.any(np.asarray(got_dx)[ends[-1]:])
    assert not np.any(np.asarray(got_dw)[3])  # the empty group's gradient


def _inputs(seed, b=2, t=256, n=8, kv=2, h=64):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(b, t, kv, h)), jnp.bfloat16)
    seg = np.ones((b, t), np.int32)
    seg[0, 40:41], seg[0, 41:170], seg[0, 170:] = 2, 3, 4  # four documents in row 0, one in row 1
    return q, k, v, jnp.asarray(seg)


def _agree(got, want):
    # BF16 inputs and outputs: 2e-2 in relative L2 norm (tests/test_gpu_attention.py's bound).
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)


def _loss(attention):
    def f(q, k, v):
        out = attention(q, k, v).astype(jnp.float32)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
    return jax.value_and_grad(f, argnums=(0, 1, 2))


# runs_per_row 1: the causal kernel; 4: the packed layout; 17: the masked (bias) kernel.
@pytest.mark.parametrize("runs_per_row", [1, 4, 17])
def test_cudnn_attention_under_shard_map_matches_xla(runs_per_row):
    q, k, v, seg = _inputs(1)
    if runs_per_row == 1:
        seg = jnp.ones_like(seg)
    mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])

    def manual(q, k, v):
        return jax.shard_map(lambda q, k, v, s: attend(q, k, v, s, "cudnn", 16, runs_per_row), mesh=mesh,
                             in_specs=(PartitionSpec("x"),) * 4, out_specs=PartitionSpec("x"),
                             check_vma=False)(q, k, v, seg)

    hlo = jax.jit(_loss(manual)).lower(q, k, v).compile().as_text()
    assert sum("__cudnn$fmha" in line for line in hlo.splitlines()) == 2  # the fused kernels ran
    _agree(jax.jit(_loss(manual))(q, k, v), jax.jit(_loss(lambda q, k, v: attend(q, k, v, seg, "xla")))(q, k, v))


def test_context_attention_on_cudnn_matches_the_whole_row():
    """The split attention (zigzag order, keys gathered, each chunk's own keys and the keys of
    its document before it as two cuDNN calls merged by their log-sum-exp) on every GPU here as
    context ranks, against XLA's attention of the unsplit row. Documents cross the chunks."""
    c = len(jax.devices())
    q, k, v, seg = _inputs(2, t=128 * c)
    t = q.shape[1]
    cfg = load_config(None, ["model.d_model=64", "model.n_heads=8", "model.n_kv_heads=2", "mesh.data=1",
                             f"mesh.context={c}", f"data.seq_len={t}"])
    mesh = make_mesh(cfg.mesh, jax.devices())
    order = zigzag_order(t, c)

    def split(q, k, v):
        out = context_attention(q[:, order], k[:, order], v[:, order], seg[:, order], "cudnn")
        return out[:, np.argsort(order)]

    on_mesh = [jax.device_put(x, NamedSharding(mesh, PartitionSpec())) for x in (q, k, v)]
    got = jax.jit(traced_in_mesh(_loss(split), mesh))(*on_mesh)
    _agree(got, jax.jit(_loss(lambda q, k, v: attend(q, k, v, seg, "xla")))(q, k, v))


def test_parts_merged_by_log_sum_exp_equal_one_attention():
    """Keys cut into a causal diagonal block and a padded prefix (lengths 0, partial and whole
    per row), merged: the attention of the whole row, forward and backward."""
    from maxfp4.kernels.cudnn_attention import Mask, attention_merged
    q, k, v, _ = _inputs(3, b=3, t=256)
    s = 128
    q_lengths, kv_lengths = jnp.asarray([0, 50, 128]), jnp.asarray([0, 100, 128])
    # Row b's second-half queries see their own half causally and the first kv_lengths[b] keys
    # of the first half if they are among its first q_lengths[b] queries.
    allowed = np.zeros((3, 1, s, 2 * s), bool)
    for b in range(3):
        allowed[b, 0, :, s:] = np.tril(np.ones((s, s), bool))
        allowed[b, 0, :int(q_lengths[b]), :int(kv_lengths[b])] = True

    def merged(q, k, v):
        return attention_merged(q[:, s:], [(k[:, s:], v[:, s:], Mask(causal=True)),
                                           (k[:, :s], v[:, :s], Mask(q_lengths_B=q_lengths, kv_lengths_B=kv_lengths))])

    def whole(q, k, v):
        return jax.nn.dot_product_attention(q[:, s:], k, v, mask=jnp.asarray(allowed), implementation="xla")

    _agree(jax.jit(_loss(merged))(q, k, v), jax.jit(_loss(whole))(q, k, v))
