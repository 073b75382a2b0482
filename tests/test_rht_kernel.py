"""The Hadamard + NVFP4 column kernels (Pallas, interpret mode on CPU) against the XLA path they
replace, bit for bit, and against a float64 NumPy Hadamard (the transform's own check lives in
test_formats.py)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from maxfp4.precision import formats as F
from maxfp4.kernels.rht import hadamard_block_dequantize_nvfp4_columns, rht_columns_supported


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


def _operand(shape, seed, dtype=jnp.bfloat16):
    """Magnitudes spread over a few decades row by row and column by column, some exact zeros,
    a negative zero: blocks with very different scales."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, (shape[0], 1)) + rng.uniform(-2, 2, (1, shape[1])))
    x[:16, :16] = 0.0
    x[16, 0] = -0.0
    return jnp.asarray(x.astype(np.float32), dtype)


@pytest.mark.parametrize("shape", [(32, 560), (48, 16)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_kernels_equal_hadamard_then_column_quantization_bitwise(shape, stochastic):
    x = _operand(shape, 1)
    key = jax.random.key(7) if stochastic else None
    v, s_dec = jax.jit(lambda x, k: hadamard_block_dequantize_nvfp4_columns(x, k, interpret=True))(x, key)
    v_ref, s_ref = jax.jit(lambda x, k: F.block_dequantize_nvfp4_columns(F.hadamard16(x, axis=0), k))(x, key)
    assert v.dtype == jnp.bfloat16 and v.shape == shape
    np.testing.assert_array_equal(_bits(v), _bits(v_ref))
    assert _bits(s_dec) == _bits(s_ref)


def test_float32_input_and_output():
    x = _operand((32, 64), 2, jnp.float32)
    v, s_dec = hadamard_block_dequantize_nvfp4_columns(x, dtype=jnp.float32, interpret=True)
    v_ref, _ = F.block_dequantize_nvfp4_columns(F.hadamard16(x, axis=0), dtype=jnp.float32)
    assert v.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(v), _bits(v_ref))


def test_dequantized_values_are_close_to_the_float64_transform():
    """v * S_dec approximates M @ x per group of 16 rows (M the orthonormal Hadamard): E2M1
    keeps 1 mantissa bit, so each element is within half a grid step of its block, i.e. at
    most 1/6 of the block amax after the E4M3 scale (the scale's own rounding adds up to 2^-4
    of it): bound (1/6 + 2^-4) * block amax, plus 1e-6 of the tensor amax for float32 noise."""
    x = _operand((64, 32), 3, jnp.float32)
    v, s_dec = hadamard_block_dequantize_nvfp4_columns(x, dtype=jnp.float32, interpret=True)
    hx = np.einsum("ij,gjk->gik", F.hadamard16_matrix(), np.asarray(x, np.float64).reshape(4, 16, 32))
    block_amax = np.abs(hx).max(axis=1, keepdims=True)
    err = np.abs(np.asarray(v, np.float64).reshape(4, 16, 32) * float(s_dec) - hx)
    assert np.all(err <= (1 / 6 + 2.0**-4) * block_amax + 1e-6 * np.abs(hx).max())


def test_supported_shapes_and_the_error_otherwise():
    assert rht_columns_supported(16384, 5632) and rht_columns_supported(32, 48)
    assert not rht_columns_supported(40, 64) and not rht_columns_supported(32, 40)
    with pytest.raises(ValueError, match=r"\(40, 64\)"):
        hadamard_block_dequantize_nvfp4_columns(jnp.ones((40, 64)), interpret=True)


@pytest.mark.parametrize("stochastic", [False, True])
def test_kernels_split_over_a_mesh_equal_one_device_bitwise(stochastic):
    """On 8 devices (data 2 x fsdp 4) each device runs the kernels on its 32 rows: the tensor
    amax is reduced over the mesh and each row draws the random words of its global position,
    so v and S_dec equal the XLA path over the whole tensor bit for bit; v stays split by rows."""
    mesh = jax.make_mesh((2, 4, 1), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    rows = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), None))
    x = jax.device_put(_operand((256, 48), 5), rows)
    key = jax.random.key(11) if stochastic else None
    v, s_dec = jax.jit(lambda x, k: hadamard_block_dequantize_nvfp4_columns(
        x, k, interpret=True, mesh=mesh, row_axes=("data", "fsdp")))(x, key)
    v_ref, s_ref = jax.jit(lambda x, k: F.block_dequantize_nvfp4_columns(F.hadamard16(x, axis=0), k))(x, key)
    np.testing.assert_array_equal(_bits(v), _bits(v_ref))
    assert _bits(s_dec) == _bits(s_ref)
    assert v.sharding.is_equivalent_to(rows, 2)
    with pytest.raises(ValueError, match=r"16 x 8 device"):
        hadamard_block_dequantize_nvfp4_columns(x[:64], interpret=True, mesh=mesh, row_axes=("data", "fsdp"))
