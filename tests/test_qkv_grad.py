"""The qkv GEMM's output gradient assembled from dq, dk and dv (RoPE's backward and the
[B, T, K, G+2, H] interleaving): the Pallas kernel (interpret mode here) against XLA's
assembly, bit for bit, and against a NumPy float64 reading of the rotation; FP8 delayed scaling
on attn_qkv as one VJP whose backward stores dY in E5M2 itself, against ``lp.dot`` and
``split_heads``; the kernel split over a mesh's batch axes against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from maxfp4.config import load_config
from maxfp4.parallel.mesh import batch_split_axes
from maxfp4.kernels import qkv_grad as qkv_grad_kernel
from maxfp4.model.attention import assemble_qkv_grad, qkv_heads, split_heads
from maxfp4.kernels.epilogue import Quantize
from maxfp4.model.layers import rope_tables
from maxfp4.precision import LayerPrecision, resolve_policy
from maxfp4.precision.formats import FP8_E5M2

B, T, K, G, H = 2, 32, 2, 2, 32
THETA = 1e4
E5M2_MAX = 57344.0


def _cotangents(b=B, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    shapes = [(b, T, K * G, H), (b, T, K, H), (b, T, K, H)]
    return [(3.0 * jax.random.normal(k, s, jnp.float32)).astype(jnp.bfloat16) for k, s in zip(keys, shapes)]


def _tables(theta, b=B):
    positions = jnp.tile(jnp.arange(T, dtype=jnp.int32)[None], (b, 1)) * 37
    return None if theta is None else rope_tables(positions, theta, H)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint16)


@pytest.mark.parametrize("theta", [THETA, None])
def test_kernel_equals_xla_assembly_bit_for_bit(theta):
    """BF16, and E5M2 with a scale that makes both rounding and the clip at 57344 occur."""
    d = _cotangents()
    tables = _tables(theta)
    want = assemble_qkv_grad(*d, tables, kernel=False)
    got = assemble_qkv_grad(*d, tables, kernel=True)
    assert got.shape == (B, T, K, G + 2, H) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(_bits(got), _bits(want))
    quantize = Quantize(jnp.float32(7000.0), FP8_E5M2)
    q_want, amax_want = assemble_qkv_grad(*d, tables, quantize, kernel=False)
    q_got, amax_got = assemble_qkv_grad(*d, tables, quantize, kernel=True)
    assert q_got.dtype == FP8_E5M2
    np.testing.assert_array_equal(_bits(q_got), _bits(q_want))
    assert float(amax_got) == float(amax_want) == float(jnp.max(jnp.abs(want.astype(jnp.float32))))
    assert float(amax_got) * 7000.0 > E5M2_MAX  # the largest values clip


def test_kernel_against_numpy_rotation_transpose():
    """dq and dk rotated back by RoPE's transpose, in float64 from the formula: the angle of
    position p and pair i is p / theta^(2i/H); (x1, x2) -> (x1 cos + x2 sin, x2 cos - x1 sin).
    The kernel rounds each value once to BF16 (2^-8 relative) from FP32 arithmetic on FP32
    tables, whose angles (up to 1147 radians) carry the roundings of the inverse frequency and
    of the product, a few ulps of 2^-13 radians: bound 2^-8 |value| + 2^-11 |pair|."""
    dq, dk, dv = _cotangents()
    got = np.asarray(assemble_qkv_grad(dq, dk, dv, _tables(THETA), kernel=True), np.float64)
    p = np.arange(T, dtype=np.float64)[None, :, None, None] * 37
    angle = p / THETA ** (np.arange(H // 2, dtype=np.float64) * 2.0 / H)

    def back(x):
        x = np.asarray(x, np.float64)
        x1, x2 = x[..., :H // 2], x[..., H // 2:]
        return np.concatenate([x1 * np.cos(angle) + x2 * np.sin(angle), x2 * np.cos(angle) - x1 * np.sin(angle)],
                              axis=-1), np.concatenate([np.hypot(x1, x2)] * 2, axis=-1)

    q_ref, q_mag = back(dq)
    k_ref, k_mag = back(dk)
    for got_part, ref, mag in [(got[:, :, :, :G].reshape(B, T, K * G, H), q_ref, q_mag),
                               (got[:, :, :, G], k_ref, k_mag)]:
        assert np.all(np.abs(got_part - ref) <= 2.0 ** -8 * np.abs(ref) + 2.0 ** -11 * mag + 1e-30)
    np.testing.assert_array_equal(got[:, :, :, G + 1], np.asarray(dv, np.float64))  # v: copied


def _lp(scales):
    cfg = load_config(None, ["precision.default=fp8_delayed"])
    return LayerPrecision(resolve_policy(cfg.precision, 1), 0, {"attn_qkv": scales})


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("theta", [THETA, None])
def test_fp8_qkv_heads_equals_dot_then_split_bit_for_bit(kernel, theta):
    """q, k, v and the gradients of x, w and the scales (this step's amaxes x, w, dY) of the
    one-VJP form against ``lp.dot`` then ``split_heads``, whose recipe casts a BF16 dY."""
    d = 24
    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (B, T, d), jnp.float32).astype(jnp.bfloat16)
    w = 0.3 * jax.random.normal(keys[1], (d, K, G + 2, H), jnp.float32)
    scales = jnp.array([3.7, 51.3, 5.1e5], jnp.float32)  # not powers of two; dY's clips
    positions = jnp.tile(jnp.arange(T, dtype=jnp.int32)[None], (B, 1)) * 37
    lp = _lp(scales)
    weights = [jax.random.normal(k, s, jnp.float32) for k, s in
               zip(keys[2:], [(B, T, K * G, H), (B, T, K, H), (B, T, K, H)])]

    def loss(heads_fn):
        def f(x, w, scales):
            outs = heads_fn(x, w, scales)
            return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, weights)), outs
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))

    def fused(x, w, scales):
        from maxfp4.model.attention import fused_qkv_heads
        return fused_qkv_heads(x, w.reshape(d, -1), scales, positions, (K, G + 2, H), theta,
                               lp.options("attn_qkv"), kernel, lp.fused("attn_qkv"))

    def reference(x, w, scales):
        ref_lp = _lp(scales)
        qkv = ref_lp.dot(x, w.reshape(d, -1), "attn_qkv")
        return split_heads(qkv.reshape(B, T, K, G + 2, H), positions, theta)

    got, want = loss(fused)(x, w, scales), loss(reference)(x, w, scales)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    amax_dy = float(got[1][2][2])
    assert amax_dy * 5.1e5 > E5M2_MAX and np.mean(np.asarray(got[1][1]) != 0) > 0.99
    # qkv_heads takes the one-VJP form for this policy (on CPU it assembles in XLA).
    via_dispatch = jax.jit(lambda x, w: qkv_heads(x, w, positions, theta, lp))(x, w)
    for a, b in zip(via_dispatch, want[0][1]):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_kernel_split_over_a_mesh_equals_one_device_bitwise():
    """8 devices (data 2 x fsdp 4), 8 rows: each device assembles its row; the amax is the max
    over the mesh. A mesh that also splits ``tensor`` is left to XLA (None)."""
    mesh = jax.make_mesh((2, 4, 1), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))
    d = [jax.device_put(a, rows) for a in _cotangents(b=8, seed=4)]
    tables = jax.device_put(_tables(THETA, b=8), rows)
    quantize = Quantize(jnp.float32(9000.0), FP8_E5M2)

    def split(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            assert batch_split_axes(8) == (mesh.abstract_mesh, ("data", "fsdp"))
            return assemble_qkv_grad(*args[:3], args[3:], quantize, kernel=True)

    q, amax = jax.jit(split)(*d, *tables)
    q_ref, amax_ref = jax.jit(lambda *a: assemble_qkv_grad(*a[:3], a[3:], quantize, kernel=False))(*d, *tables)
    np.testing.assert_array_equal(_bits(q), _bits(q_ref))
    assert float(amax) == float(amax_ref)
    tensor_mesh = jax.make_mesh((2, 1, 4), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    with jax.sharding.use_abstract_mesh(tensor_mesh.abstract_mesh):
        assert batch_split_axes(8) is None


@pytest.mark.gpu
@pytest.mark.parametrize("theta", [5e5, None])
def test_compiled_kernel_equals_xla_assembly_on_gpu(theta):
    """Through Triton (not interpret mode), Llama-3-8B's heads (G 4, H 128) and dense-1p3b's
    (H 64): the kernel's FP32 arithmetic and rounding are XLA's, so the bits are the same."""
    for h in (128, 64):
        dq, dk, dv = [(3.0 * jax.random.normal(jax.random.key(i), (2, 512, n, h), jnp.float32)).astype(jnp.bfloat16)
                      for i, n in enumerate((32, 8, 8))]
        tables = None if theta is None else rope_tables(
            jnp.tile(jnp.arange(512, dtype=jnp.int32)[None], (2, 1)) * 13, theta, h)
        quantize = Quantize(jnp.float32(9000.0), FP8_E5M2)
        for q in (None, quantize):
            got = jax.jit(lambda *a, q=q: assemble_qkv_grad(*a[:3], a[3], q, kernel=True))(dq, dk, dv, tables)
            want = jax.jit(lambda *a, q=q: assemble_qkv_grad(*a[:3], a[3], q, kernel=False))(dq, dk, dv, tables)
            for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                np.testing.assert_array_equal(_bits(a) if a.ndim else np.asarray(a), _bits(b) if b.ndim else np.asarray(b))
