"""On GPU: the fused cuDNN attention kernel respects packed-segment boundaries.

A fused kernel that drops the mask would let documents attend to each other while the loss
still looks plausible. This compares the cuDNN path with the XLA path (which the CPU tests check
against a float64 reference) on packed rows, forward and backward, and checks that leaving the
segment mask out would have been caught.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.model.attention import attend

pytestmark = pytest.mark.gpu


def _inputs(seed=0, B=2, T=256, N=8, K=2, H=64):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.bfloat16)
    k = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.bfloat16)
    v = jnp.asarray(rng.normal(size=(B, T, K, H)), jnp.bfloat16)
    bounds = [[0, 40, 41, 170, T], [0, T]]  # row 0: four documents (one of length 1); row 1: one
    seg = np.zeros((B, T), np.int32)
    for b, cuts in enumerate(bounds):
        for i, (s, e) in enumerate(zip(cuts[:-1], cuts[1:])):
            seg[b, s:e] = i + 1
    return q, k, v, jnp.asarray(seg)


# max_segments 16: the packed kernel with 4 run slots (row 0 holds four documents); 5: the
# 5-slot packed kernel; 2: too few slots, the masked kernel; "cudnn_mask": always masked.
@pytest.mark.parametrize("impl,max_segments", [("cudnn", 16), ("cudnn", 5), ("cudnn", 2), ("cudnn_mask", 16)])
def test_cudnn_attention_respects_segments_forward_and_backward(impl, max_segments):
    assert jax.devices()[0].platform in ("gpu", "cuda")
    q, k, v, seg = _inputs()

    def loss(impl):
        def f(q, k, v):
            out = attend(q, k, v, seg, impl, max_segments).astype(jnp.float32)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
        return f

    out_cudnn = attend(q, k, v, seg, impl, max_segments).astype(jnp.float32)
    out_xla = attend(q, k, v, seg, "xla").astype(jnp.float32)
    # BF16 inputs and output: agreement to 2e-2 absolute on outputs of order 1.
    np.testing.assert_allclose(np.asarray(out_cudnn), np.asarray(out_xla), atol=2e-2, rtol=0)

    g_cudnn = jax.grad(loss(impl), argnums=(0, 1, 2))(q, k, v)
    g_xla = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_cudnn, g_xla):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)

    # Changing the second document changes nothing in the others.
    v2 = v.at[0, 41:170].set(-v[0, 41:170])
    out2 = attend(q, k, v2, seg, impl, max_segments).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(out2[0, :41]), np.asarray(out_cudnn[0, :41]))
    np.testing.assert_array_equal(np.asarray(out2[0, 170:]), np.asarray(out_cudnn[0, 170:]))
    assert np.abs(np.asarray(out2[0, 41:170] - out_cudnn[0, 41:170])).max() > 0.1

    # Without the segment mask the fused kernel gives a different answer: the check above bites.
    unmasked = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    assert np.abs(np.asarray(unmasked.astype(jnp.float32)[0, 41:]) - np.asarray(out_cudnn[0, 41:])).max() > 0.1


# The data's bound on runs per row picks the kernel when tracing: 1 (plain causal, no packed
# layout), 4 (the packed kernel of 4 slots), 16 (16 slots), 17 (more than max_segments: the
# masked kernel).
@pytest.mark.parametrize("runs_per_row", [1, 4, 16, 17])
def test_kernel_chosen_from_the_bound_matches_the_switch(runs_per_row):
    q, k, v, seg = _inputs(2)
    if runs_per_row == 1:
        seg = jnp.ones_like(seg)  # one document a row: what synthetic data gives

    def loss(bound):
        def f(q, k, v):
            out = attend(q, k, v, seg, "cudnn", 16, bound).astype(jnp.float32)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
        return f

    hlo = jax.jit(jax.grad(loss(runs_per_row), argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    assert "conditional" not in hlo  # no switch: nothing for the host to wait on
    fmha = [line for line in hlo.splitlines() if "__cudnn$fmha" in line]
    assert len(fmha) == 2, fmha  # one forward kernel, one backward kernel
    # Only the packed layout passes run lengths and offsets (cuDNN's PADDING_CAUSAL mask).
    packed = 1 < runs_per_row <= 16
    assert all(("PADDING" in line) == packed for line in fmha), [line[-300:] for line in fmha]
    out_static = attend(q, k, v, seg, "cudnn", 16, runs_per_row).astype(jnp.float32)
    out_xla = attend(q, k, v, seg, "xla").astype(jnp.float32)
    # BF16 inputs and output: agreement to 2e-2 absolute on outputs of order 1 (as above).
    np.testing.assert_allclose(np.asarray(out_static), np.asarray(out_xla), atol=2e-2, rtol=0)
    g_static = jax.grad(loss(runs_per_row), argnums=(0, 1, 2))(q, k, v)
    g_switch = jax.grad(loss(None), argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g_static, g_switch):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)


def test_cudnn_is_what_auto_picks_on_gpu():
    from maxfp4.model.attention import resolve_implementation
    assert resolve_implementation("auto") == "cudnn"
    q, k, v, seg = _inputs(1)
    hlo = jax.jit(lambda q, k, v: attend(q, k, v, seg, "cudnn")).lower(q, k, v).compile().as_text()
    assert "cudnn" in hlo.lower() or "__cudnn$fmha" in hlo


@pytest.mark.parametrize("remat,forward_kernels", [("none", 1), ("save_gemm", 1), ("full", 2)])
def test_save_gemm_remat_does_not_rerun_the_attention_forward_kernel(remat, forward_kernels):
    """train.remat=save_gemm keeps cuDNN attention's outputs and softmax statistics, so the
    backward pass runs no second forward kernel (full remat does, by design). Each kernel
    appears once per branch of the packed/masked switch (maxfp4.model.attention)."""
    from maxfp4.model.attention import packed_capacities
    from maxfp4.model.remat import remat_body

    branches = len(packed_capacities(16)) + 1

    q, k, v, seg = _inputs()

    def loss(q, seg):  # seg an argument: as constants, XLA would fold the switch to one branch
        def body(x, _):
            return jnp.tanh(attend(x, k, v, seg, "cudnn")), None

        y, _ = jax.lax.scan(remat_body(body, remat), q, None, length=2)
        return jnp.sum(y.astype(jnp.float32))

    hlo = jax.jit(jax.grad(loss)).lower(q, seg).compile().as_text()
    calls = [line for line in hlo.splitlines() if "custom_call_target=\"__cudnn$fmha" in line]
    forward = [c for c in calls if "Backward" not in c]
    backward = [c for c in calls if "Backward" in c]
    counts = f"{len(forward)} forward, {len(backward)} backward kernels, {branches} branches"
    assert len(backward) == branches, counts  # one per branch in the scan body
    assert len(forward) == branches * forward_kernels, counts


# On a mesh of two devices (nvidia-h200-x2), rows split over fsdp or heads over tensor: the
# kernels run on each device's block (maxfp4.model.attention._cudnn_on_each_device). jax's
# GSPMD-partitioned entry failed to build the masked kernel's cuDNN graph for split rows.
@pytest.mark.parametrize("axis", ["fsdp", "tensor"])
@pytest.mark.parametrize("max_segments", [16, 2])  # the packed kernel; too few slots: masked
def test_cudnn_attention_on_two_devices_matches_xla_forward_and_backward(axis, max_segments):
    from jax.sharding import NamedSharding, PartitionSpec

    from maxfp4.config import MeshConfig
    from maxfp4.parallel.mesh import make_mesh, traced_in_mesh

    assert len(jax.devices()) >= 2, "run on two GPUs (nvidia-h200-x2)"
    mesh = make_mesh(MeshConfig(data=1, **{axis: 2}), jax.devices()[:2])
    split = PartitionSpec("fsdp") if axis == "fsdp" else PartitionSpec(None, None, "tensor")
    q, k, v, seg = _inputs(3)
    q, k, v = (jax.device_put(x, NamedSharding(mesh, split)) for x in (q, k, v))
    seg = jax.device_put(seg, NamedSharding(mesh, PartitionSpec("fsdp" if axis == "fsdp" else None)))

    def loss(impl):
        def f(q, k, v, seg):
            out = attend(q, k, v, seg, impl, max_segments).astype(jnp.float32)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
        return jax.jit(traced_in_mesh(jax.value_and_grad(f, argnums=(0, 1, 2)), mesh))

    (l_cudnn, g_cudnn), (l_xla, g_xla) = loss("cudnn")(q, k, v, seg), loss("xla")(q, k, v, seg)
    # BF16 inputs and outputs, as the one-device test: 2e-2 relative.
    assert abs(float(l_cudnn) - float(l_xla)) <= 2e-2 * max(abs(float(l_xla)), 1.0)
    for a, b in zip(g_cudnn, g_xla):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)
