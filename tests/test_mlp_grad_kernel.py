"""The MLP activation's FP8 backward as one kernel (``maxfp4.kernels.mlp_grad``): mlp_up's
output gradient in E5M2 in both layouts and mlp_down's input in E4M3 transposed, from one read.
In interpret mode (CPU) the same bits as the XLA functions it replaces, and the whole MLP's
gradients the same with it as without; compiled on the GPU, the same bits as the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from maxfp4.config import load_config
from maxfp4.model import fp8_mlp
from maxfp4.kernels import mlp_grad as mlp_grad_kernel
from maxfp4.precision import LayerPrecision, resolve_policy

B, T, D, F = 2, 64, 32, 128
BLOCKS = {"block_m": 32, "block_f": 32}
DY_SCALE, H_SCALE = 3.1e6, 47.1  # not powers of two; DY_SCALE large enough that E5M2 clips
KINDS = ["swiglu", "relu2"]
E5M2_MAX = 57344.0


def _gates(kind):
    return 2 if kind == "swiglu" else 1


def _inputs(kind, b=B, seed=0, f=F):
    k1, k2 = jax.random.split(jax.random.key(seed))
    y = (2.0 * jax.random.normal(k1, (b, T, _gates(kind) * f), jnp.float32)).astype(jnp.bfloat16)
    dh = (1e-3 * jax.random.normal(k2, (b, T, f), jnp.float32)).astype(jnp.bfloat16)
    return y, dh


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8))


def _xla_reference(y, dh, kind):
    """What the MLP computes without the kernel: the E5M2 gradient and its amax, and the E4M3
    activation, transposed as the wgrad GEMMs read them."""
    b, t, k = y.shape
    if kind == "swiglu":
        qdy, amax = fp8_mlp.swiglu_grad_e5m2(y.reshape(b, t, k // 2, 2), dh, jnp.float32(DY_SCALE))
    else:
        qdy, amax = fp8_mlp.relu2_grad_e5m2(y, dh, jnp.float32(DY_SCALE))
    qh, _ = fp8_mlp.activation_e4m3(y, kind, jnp.float32(H_SCALE))
    f = dh.shape[-1]
    return qdy.reshape(b, t, k), qdy.reshape(b * t, k).T, qh.reshape(b * t, f).T, amax


def _kernel(kind, interpret=True, **blocks):
    return jax.jit(lambda y, dh: mlp_grad_kernel.activation_grad_fp8(y, dh, DY_SCALE, H_SCALE, kind, interpret,
                                                                      **blocks))


def _assert_same(got, want):
    for a, w in zip(got[:3], want[:3]):
        assert a.dtype == w.dtype and a.shape == w.shape
        np.testing.assert_array_equal(_bits(a), _bits(w))
    assert float(got[3]) == float(want[3])


@pytest.mark.parametrize("kind", KINDS)
def test_interpreted_kernel_equals_the_xla_functions_bit_for_bit(kind):
    y, dh = _inputs(kind)
    got = _kernel(kind, **BLOCKS)(y, dh)
    _assert_same(got, jax.jit(lambda y, dh: _xla_reference(y, dh, kind))(y, dh))
    dy = np.asarray(got[0].astype(jnp.float32))
    assert np.any(np.abs(dy) == E5M2_MAX)  # the clip occurs
    nonzero = 0.9 if kind == "swiglu" else 0.4  # the squared ReLU is zero for about half its inputs
    assert np.mean(dy != 0) > nonzero and np.mean(np.asarray(got[2].astype(jnp.float32)) != 0) > nonzero


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_split_over_a_mesh_equals_one_device_bitwise(kind):
    """Under an 8-device mesh that splits only the batch, each device runs its own tokens; the
    transposed outputs are split along their token (last) dimension."""
    y, dh = _inputs(kind, b=8, seed=1, f=64)
    mesh = jax.make_mesh((2, 4, 1), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp")))

    def split(y, dh):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return mlp_grad_kernel.activation_grad_fp8(y, dh, DY_SCALE, H_SCALE, kind, True, **BLOCKS)

    got = jax.jit(split)(jax.device_put(y, rows), jax.device_put(dh, rows))
    _assert_same(got, jax.jit(lambda y, dh: _xla_reference(y, dh, kind))(y, dh))


def _lp(scales) -> LayerPrecision:
    cfg = load_config(None, ["precision.default=fp8_delayed"])
    return LayerPrecision(resolve_policy(cfg.precision, 1), 0, scales)


@pytest.mark.parametrize("kind", KINDS)
def test_mlp_with_the_kernel_equals_without(kind):
    """The whole FP8 MLP's output and gradients (x, both weights, both layers' amaxes) with the
    activation's backward as the kernel and as XLA's passes: the wgrads read the kernel's
    transposed operands, so any mislaid element changes them."""
    keys = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(keys[0], (B, T, D), jnp.float32).astype(jnp.bfloat16)
    w_up = 0.3 * jax.random.normal(keys[1], (D, _gates(kind) * F), jnp.float32)
    w_down = 0.3 * jax.random.normal(keys[2], (F, D), jnp.float32)
    weights = jax.random.normal(keys[3], (B, T, D), jnp.float32)
    scales = {"mlp_up": jnp.array([3.7, 51.3, 3.1e6], jnp.float32),
              "mlp_down": jnp.array([2.9, 47.1, 2.3e5], jnp.float32)}

    def value_and_grads(kernel):
        def loss(x, w_up, w_down, s):
            out = fp8_mlp.mlp(x, w_up, w_down, _lp(s), kind, kernel=kernel)
            return jnp.sum(out.astype(jnp.float32) * weights)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, w_up, w_down, scales)

    (loss, (dx, dw_up, dw_down, dscales)), (loss_ref, (dx_ref, dw_up_ref, dw_down_ref, dscales_ref)) = (
        value_and_grads(True), value_and_grads(False))
    for a, b in [(loss, loss_ref), (dx, dx_ref)] + list(zip(jax.tree_util.tree_leaves(dscales),
                                                            jax.tree_util.tree_leaves(dscales_ref))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # The weight gradients' GEMMs read the same FP8 values in another layout; XLA's CPU dot may
    # then sum the 128 FP32 products in another order (a few elements moved by 1 ulp here). A
    # mislaid element would move a sum by one of its terms, far above this bound.
    for a, b in [(dw_up, dw_up_ref), (dw_down, dw_down_ref)]:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(b))))
        assert np.mean(np.asarray(a) != 0) > 0.5
    assert float(dscales["mlp_up"][2]) * 3.1e6 > E5M2_MAX  # mlp_up's dY clips in E5M2


def test_kernel_is_picked_on_gpu_in_whole_tiles_of_the_kinds_size():
    on_gpu = jax.devices()[0].platform in ("gpu", "cuda")
    assert fp8_mlp._kernel_applies(4096, 14336, 2, "swiglu") == on_gpu
    assert fp8_mlp._kernel_applies(4096, 8192, 2, "relu2") == on_gpu
    assert not fp8_mlp._kernel_applies(4000, 14336, 2, "swiglu")
    # 14368 features fill tiles of 32 (SwiGLU's) but not of 64 (the squared ReLU's).
    assert not fp8_mlp._kernel_applies(4096, 14368, 2, "relu2")
    assert mlp_grad_kernel.supported(4096, 14368, *mlp_grad_kernel.TILES["swiglu"])
    assert not mlp_grad_kernel.supported(4096, 14368, *mlp_grad_kernel.TILES["relu2"])
    assert mlp_grad_kernel.supported(4096, 14336, *mlp_grad_kernel.TILES["swiglu"])
    assert not mlp_grad_kernel.supported(4096, 14330, *mlp_grad_kernel.TILES["swiglu"])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("b", [2, 4])
def test_compiled_kernel_equals_the_xla_path_on_gpu(kind, b):
    """Compiled for the GPU, the same bits as XLA's compiled passes (on an H200 both use
    libdevice's expf and IEEE division, and both keep the BF16 rounding)."""
    y, dh = _inputs(kind, b=b, seed=b, f=512)
    _assert_same(_kernel(kind, interpret=False)(y, dh), jax.jit(lambda y, dh: _xla_reference(y, dh, kind))(y, dh))
