"""The Mosaic GPU kernels of the causal convolution + SiLU (maxfp4.kernels.conv_mosaic: the forward
and the backward's first kernel) under Mosaic GPU's interpreter against the Triton kernels under
theirs: the same bits (both sum the bias and the W lags in the same order in FP32, and the
interpreter's sigmoid is the exact one), with packed documents that cross the 64-row tiles. And
that they lower for CUDA at mamba2-1p3b's shapes (register layouts, TMA strides)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.kernels import conv_mosaic
from maxfp4.kernels.conv import _padded_ids, conv_backward, conv_forward


def _operands(width, seed=0, b=2, t=128, c=256):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((b, t, c)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((width, c)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(c), jnp.float32)
    # Row 0: documents of 3 tokens (shorter than the kernel), 60 (ending at the first tile's
    # last rows), 2, then one across the rest; row 1 one document.
    ids = jnp.asarray(np.array([[1] * 3 + [2] * 60 + [3] * 2 + [4] * 63, [7] * 128], np.int32))
    return x, w, bias, ids


@pytest.mark.parametrize("width", [4, 2])
def test_interpreted_mosaic_forward_gives_the_triton_kernels_bits(width):
    x, w, bias, ids = _operands(width)
    want, residuals = conv_forward(x, w, bias, ids, True)
    got, same_residuals = conv_forward(x, w, bias, ids, True, kernel="mosaic")
    assert np.abs(np.asarray(want, np.float32)).max() > 1
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for a, e in zip(jax.tree.leaves(same_residuals), jax.tree.leaves(residuals)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
    # And what the backward reads from them is the same: dx, dw, db of one cotangent.
    dout = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.bfloat16)
    for a, e in zip(conv_backward(same_residuals, dout, True), conv_backward(residuals, dout, True)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(e, np.float32))


@pytest.mark.parametrize("width", [4, 2])
def test_interpreted_mosaic_preactivation_gradients_give_the_triton_kernels_bits(width):
    """The backward's first kernel on Mosaic GPU, the input gradient's on Triton: dx equal to both
    Triton kernels' (the same pre-activation gradient, elementwise); dw and db, FP32 column sums
    of a 64 x 128 tile each reduced by its interpreter in its own order, within 1e-5 of the
    largest (as tests/test_conv_kernel.py bounds orders of summation)."""
    x, w, bias, ids = _operands(width, seed=3)
    _, residuals = conv_forward(x, w, bias, ids, True)
    dout = jnp.asarray(np.random.default_rng(4).standard_normal(x.shape), jnp.bfloat16)
    want = conv_backward(residuals, dout, True)
    got = conv_backward(residuals, dout, True, kernel="mosaic")
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    for name, a, e in zip(("dw", "db"), got[1:], want[1:]):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert np.abs(e).max() > 1, name
        assert np.abs(a - e).max() <= 1e-5 * np.abs(e).max(), name


def test_an_earlier_document_never_reaches_a_later_one():
    """Changing the previous document's tokens leaves a document's outputs as they were."""
    x, w, bias, ids = _operands(4, seed=2)
    x_pad = jnp.pad(x, ((0, 0), (3, 0), (0, 0)))
    ids_pad = _padded_ids(ids, 3, 0)
    out = np.asarray(conv_mosaic.conv_silu_forward(x_pad, ids_pad, w, bias, interpret=True), np.float32)
    changed = x.at[0, :63].set(100.0)  # documents 1 and 2 of row 0
    out2 = np.asarray(conv_mosaic.conv_silu_forward(jnp.pad(changed, ((0, 0), (3, 0), (0, 0))), ids_pad, w, bias,
                                                    interpret=True), np.float32)
    np.testing.assert_array_equal(out2[0, 63:], out[0, 63:])
    np.testing.assert_array_equal(out2[1], out[1])
    assert not np.array_equal(out2[0, :63], out[0, :63])


def test_lowers_for_cuda_at_mamba2_1p3b_shapes():
    b, t, c, width = 8, 2048, 4352, 4
    args = [jax.ShapeDtypeStruct((b, t + width - 1, c), jnp.bfloat16), jax.ShapeDtypeStruct((b, t + width - 1), jnp.int32),
            jax.ShapeDtypeStruct((width, c), jnp.float32), jax.ShapeDtypeStruct((c,), jnp.float32)]
    lowered = jax.jit(conv_mosaic.conv_silu_forward).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    dout = jax.ShapeDtypeStruct((b, t, c), jnp.bfloat16)
    lowered = jax.jit(conv_mosaic.preactivation_gradients).trace(*args, dout).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()


def test_shapes_it_takes_and_bad_choices():
    assert conv_mosaic.supported(2048, 4352) and not conv_mosaic.supported(2048, 4336)
    assert not conv_mosaic.supported(2000, 4352)
    x, w, bias, ids = _operands(4)
    with pytest.raises(ValueError, match="multiples of 64 and 128"):
        conv_mosaic.conv_silu_forward(jnp.zeros((1, 35, 128), jnp.bfloat16), jnp.zeros((1, 35), jnp.int32), w[:, :128],
                                      bias[:128], interpret=True)
    with pytest.raises(ValueError, match="kernel must be triton or mosaic, got 'cuda'"):
        conv_forward(x, w, bias, ids, True, kernel="cuda")
    with pytest.raises(ValueError, match="kernel must be triton or mosaic, got 'cuda'"):
        conv_backward(conv_forward(x, w, bias, ids, True)[1], x, True, kernel="cuda")
