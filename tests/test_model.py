"""Dense decoder: causality, packed-document isolation, attention against a float64 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.model.attention import attend, packed_capacities, static_kernel
from maxfp4.model.decoder import forward, forward_embedded, init_params
from maxfp4.model.layers import ACT_DTYPE
from maxfp4.precision import resolve_policy


def _setup(tiny_cfg):
    cfg = tiny_cfg()
    params = init_params(cfg.model, jax.random.key(0))
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    return cfg, params, policy


def test_output_at_t_does_not_depend_on_later_tokens(tiny_cfg):
    cfg, params, policy = _setup(tiny_cfg)
    T = 16
    x = 0.5 * jax.random.normal(jax.random.key(1), (1, T, cfg.model.d_model), jnp.float32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    seg = jnp.ones((1, T), jnp.int32)

    # One compiled gradient, the probed position passed as data.
    grad_at = jax.jit(jax.grad(lambda x_BTD, t: jnp.take(forward_embedded(
        params, x_BTD.astype(ACT_DTYPE), pos, seg, cfg=cfg.model, policy=policy)[0], t, axis=0)
        .astype(jnp.float32).sum()))
    for t in (0, 5, T - 2):
        g = grad_at(x, t)  # [1, T, D]
        per_pos = np.abs(np.asarray(g[0])).sum(-1)
        assert np.all(per_pos[t + 1:] == 0.0), f"position {t} sees the future"
        assert np.all(per_pos[: t + 1] > 0.0), f"position {t} ignores its past"


def test_packed_documents_do_not_see_each_other(tiny_cfg):
    cfg, params, policy = _setup(tiny_cfg)
    rng = np.random.default_rng(0)
    # Row: doc A (10 tokens) | doc B (14 tokens) | padding (8)
    seg = np.array([[1] * 10 + [2] * 14 + [0] * 8], np.int32)
    pos = np.array([list(range(10)) + list(range(14)) + list(range(8))], np.int32)
    tokens = rng.integers(4, cfg.model.vocab_size, size=(1, 32)).astype(np.int32)
    changed = tokens.copy()
    changed[0, :10] = rng.integers(4, cfg.model.vocab_size, size=10)  # rewrite doc A only

    def logits(tok):
        return np.asarray(forward(params, tok, pos, seg, cfg=cfg.model, policy=policy).astype(jnp.float32))

    a, b = logits(tokens), logits(changed)
    np.testing.assert_array_equal(a[0, 10:24], b[0, 10:24])  # doc B bit-identical
    assert np.abs(a[0, :10] - b[0, :10]).max() > 1e-3  # doc A did change

    # Doc B alone in its own row (positions restarting at 0) gives the same logits as packed.
    alone = forward(params, tokens[:, 10:24], pos[:, 10:24], np.ones((1, 14), np.int32),
                    cfg=cfg.model, policy=policy)
    np.testing.assert_allclose(np.asarray(alone.astype(jnp.float32))[0], a[0, 10:24], atol=2e-2, rtol=0)


def _reference_attention(q, k, v, seg):
    """float64 NumPy: causal softmax attention within segments, GQA (query head n uses kv n // G)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    out = np.zeros_like(q)
    for b in range(B):
        for n in range(N):
            s = q[b, :, n] @ k[b, :, n // G].T / np.sqrt(H)
            allowed = (seg[b][:, None] == seg[b][None, :]) & np.tril(np.ones((T, T), bool))
            s = np.where(allowed, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[b, :, n] = p @ v[b, :, n // G]
    return out


@pytest.mark.parametrize("n_heads, n_kv", [(4, 4), (4, 2), (4, 1)])
def test_attention_matches_float64_reference(n_heads, n_kv):
    rng = np.random.default_rng(n_kv)
    B, T, H = 2, 24, 16
    q = rng.normal(size=(B, T, n_heads, H)).astype(np.float32)
    k = rng.normal(size=(B, T, n_kv, H)).astype(np.float32)
    v = rng.normal(size=(B, T, n_kv, H)).astype(np.float32)
    seg = np.array([[1] * 7 + [2] * 9 + [3] * 8, [1] * 24], np.int32)
    out = np.asarray(attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seg), "xla"))
    ref = _reference_attention(q, k, v, seg)
    # float32 inputs and arithmetic: error bound 1e-5 relative to the output scale (~1).
    np.testing.assert_allclose(out, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("max_segments", [1, 2, 5, 16, 64])
def test_static_attention_kernel_holds_the_bound(max_segments):
    """With a bound on runs per row known when tracing, cuDNN attention is chosen without a
    switch: plain causal for one run a row, else the smallest compiled packed capacity that
    holds the bound, else the masked kernel.
    A packed capacity below the bound would describe the rows wrongly."""
    capacities = packed_capacities(max_segments)
    for runs in range(1, max_segments + 3):
        kernel = static_kernel(max_segments, runs)
        if runs == 1:  # every row one document: plain causal attention, no packed layout
            assert kernel == "causal"
            continue
        if runs > max_segments:
            assert kernel == "masked"
            continue
        assert kernel in capacities and kernel >= runs
        assert all(c < runs for c in capacities if c < kernel)  # no smaller capacity holds them
    with pytest.raises(ValueError, match="runs_per_row=0"):
        static_kernel(max_segments, 0)


def test_pipeline_stages_keep_cudnn_only_for_rows_of_one_document():
    """Inside a pipeline stage (shard_map over the pipeline axis) cuDNN's causal kernel is kept
    for rows known to hold one document; every other row, and any row of unknown runs, takes
    XLA's attention (cuDNN's packed and masked kernels do not compile there). Outside a stage
    nothing changes."""
    from maxfp4.model.attention import stage_implementation

    mesh = jax.make_mesh((1,), ("pipeline",), axis_types=(jax.sharding.AxisType.Auto,))
    seen = {}

    def stage(x):
        for impl, runs in [("cudnn", 1), ("cudnn", 2), ("cudnn", None), ("cudnn_mask", 1), ("xla", 1)]:
            seen[impl, runs] = stage_implementation(impl, runs)
        return x

    jax.shard_map(stage, mesh=mesh, in_specs=jax.sharding.PartitionSpec("pipeline"),
                  out_specs=jax.sharding.PartitionSpec("pipeline"))(jnp.zeros(1))
    assert seen == {("cudnn", 1): "cudnn", ("cudnn", 2): "xla", ("cudnn", None): "xla",
                    ("cudnn_mask", 1): "xla", ("xla", 1): "xla"}
    assert stage_implementation("cudnn", None) == "cudnn" and stage_implementation("cudnn_mask", 3) == "cudnn_mask"
