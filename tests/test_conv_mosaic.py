"""The Mosaic GPU kernels of the causal convolution + SiLU (maxfp4.kernels.conv_mosaic: the forward
and the backward's first kernel) under Mosaic GPU's interpreter against the Triton kernels under
theirs: the same bits (both sum the bias and the W lags in the same order in FP32, and the
interpreter's sigmoid is the exact one), with packed documents that cross the 32-row spans (and
spans that no document starts in, whose programs skip the masks). And
that they lower for CUDA at mamba2-1p3b's shapes (register layouts, TMA strides)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.kernels import conv_mosaic
from maxfp4.kernels.conv import _padded_ids, conv_backward, conv_forward
from maxfp4.kernels.epilogue import Quantize


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
    got, mosaic_residuals = conv_forward(x, w, bias, ids, True, kernel="mosaic")
    assert np.abs(np.asarray(want, np.float32)).max() > 1
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    # The Mosaic kernels keep x itself (read in place), where the Triton ones keep a padded copy.
    assert mosaic_residuals[0] is x and residuals[0].shape == (x.shape[0], x.shape[1] + width - 1, x.shape[2])
    # Read from the columns of a wider array (the in_proj output) at an offset: the same bits.
    wide = jnp.concatenate([jnp.full((*x.shape[:2], 64), 9.0, x.dtype), x, jnp.zeros((*x.shape[:2], 8), x.dtype)],
                           axis=2)
    in_place, wide_residuals = conv_forward(x, w, bias, ids, True, kernel="mosaic", source_BTI=wide,
                                            source_offset=64)
    np.testing.assert_array_equal(np.asarray(in_place, np.float32), np.asarray(want, np.float32))
    assert wide_residuals[0] is wide
    dout = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape), jnp.bfloat16)
    # and the backward reads it there too: dx the same bits, dw and db to FP32 rounding (XLA may
    # contract the interpreted sums of the two layouts into FMAs differently)
    got = conv_backward(wide_residuals, dout, True, kernel="mosaic", source_offset=64)
    want = conv_backward(mosaic_residuals, dout, True, kernel="mosaic")
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    for a, e in zip(got[1:], want[1:]):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert np.abs(a - e).max() <= 1e-5 * np.abs(e).max()


@pytest.mark.parametrize("width", [4, 2])
def test_interpreted_mosaic_backward_gives_the_triton_kernels_values(width):
    """The backward's two kernels on Mosaic GPU: dx equal to the Triton kernels' (the same
    elementwise pre-activation gradient, the same W-tap sums); dw and db, FP32 column sums in
    another order (per program, rows 8 apart, then XLA's sum), within 1e-5 of the largest
    (as tests/test_conv_kernel.py bounds orders of summation)."""
    x, w, bias, ids = _operands(width, seed=3)
    _, residuals = conv_forward(x, w, bias, ids, True)
    _, mosaic_residuals = conv_forward(x, w, bias, ids, True, kernel="mosaic")
    dout = jnp.asarray(np.random.default_rng(4).standard_normal(x.shape), jnp.bfloat16)
    want = conv_backward(residuals, dout, True)
    got = conv_backward(mosaic_residuals, dout, True, kernel="mosaic")
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    for name, a, e in zip(("dw", "db"), got[1:], want[1:]):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert np.abs(e).max() > 1, name
        assert np.abs(a - e).max() <= 1e-5 * np.abs(e).max(), name


@pytest.mark.parametrize("fp8", [False, True])
def test_interpreted_mosaic_input_gradient_into_a_wider_array(fp8):
    """dx written into columns [128, 384) of a wider array (the in_proj output's gradient), in BF16
    or stored as E5M2 with its scale as epilogue.Quantized does, with max |dx|: the Triton kernel's
    bits, and the other columns the wider array's own."""
    x, w, bias, ids = _operands(4, seed=5)
    _, residuals = conv_forward(x, w, bias, ids, True)
    _, mosaic_residuals = conv_forward(x, w, bias, ids, True, kernel="mosaic")
    dout = jnp.asarray(np.random.default_rng(6).standard_normal(x.shape), jnp.bfloat16)
    into = jnp.full((2, 128, 512), 3.0, jnp.float8_e5m2 if fp8 else jnp.bfloat16)
    quantize = Quantize(jnp.float32(4.0), jnp.float8_e5m2) if fp8 else None
    want = conv_backward(residuals, dout, True, into_BTI=into, column_offset=128, quantize=quantize)
    got = conv_backward(mosaic_residuals, dout, True, into_BTI=into, column_offset=128, quantize=quantize,
                        kernel="mosaic")
    assert np.abs(np.asarray(want[0][..., 128:384], np.float32)).max() > 1
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    assert (np.asarray(got[0][..., :128], np.float32) == 3.0).all()
    if fp8:
        assert float(got[3]) == float(want[3]) > 0


def test_window_masks_and_the_programs_that_skip_them():
    """Bit k of a row's mask: window k (the input W - 1 - k rows back) is in the row's document.
    A program (32 rows) skips the masks only where every window of its rows is: not the first
    rows of a batch row (the front padding), not a span with a document's start."""
    _, _, _, ids = _operands(4)
    masks, flags = conv_mosaic._window_masks(_padded_ids(ids, 3, 0), 4, 3)
    masks, flags = np.asarray(masks), np.asarray(flags)
    assert masks.shape == (2, 128, 128) and (masks == masks[..., :1]).all()
    bits = masks[..., 0].astype(np.int64)
    # row 0: documents start at 0, 3, 63, 65; row 1 at 0
    assert bits[0, 0] == 0b1000 and bits[0, 1] == 0b1100 and bits[0, 3] == 0b1000 and bits[0, 5] == 0b1110
    assert bits[0, 64] == 0b1100 and bits[0, 127] == 0b1111 and bits[1, 2] == 0b1110 and bits[1, 3] == 0b1111
    np.testing.assert_array_equal(flags[..., 0], [[1, 1, 1, 0], [1, 0, 0, 0]])
    assert (flags[..., 1:] == 0).all()


def test_an_earlier_document_never_reaches_a_later_one():
    """Changing the previous document's tokens leaves a document's outputs as they were."""
    x, w, bias, ids = _operands(4, seed=2)
    ids_pad = _padded_ids(ids, 3, 0)
    out = np.asarray(conv_mosaic.conv_silu_forward(x, ids_pad, w, bias, interpret=True), np.float32)
    changed = x.at[0, :63].set(100.0)  # documents 1 and 2 of row 0
    out2 = np.asarray(conv_mosaic.conv_silu_forward(changed, ids_pad, w, bias, interpret=True), np.float32)
    np.testing.assert_array_equal(out2[0, 63:], out[0, 63:])
    np.testing.assert_array_equal(out2[1], out[1])
    assert not np.array_equal(out2[0, :63], out[0, :63])


def test_lowers_for_cuda_at_mamba2_1p3b_shapes():
    b, t, c, width = 8, 2048, 4352, 4
    # x read in place from in_proj's [B, T, 8512] output at column 4096
    args = [jax.ShapeDtypeStruct((b, t, 8512), jnp.bfloat16), jax.ShapeDtypeStruct((b, t + width - 1), jnp.int32),
            jax.ShapeDtypeStruct((width, c), jnp.float32), jax.ShapeDtypeStruct((c,), jnp.float32)]
    forward = functools.partial(conv_mosaic.conv_silu_forward, column_offset=4096)
    lowered = jax.jit(forward).trace(*args).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    dout = jax.ShapeDtypeStruct((b, t, c), jnp.bfloat16)
    backward = functools.partial(conv_mosaic.preactivation_gradients, column_offset=4096)
    lowered = jax.jit(backward).trace(*args, dout).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    # The input gradient: alone, into in_proj's [B, T, I] gradient at column E (in place: the
    # launch aliases the wider array's buffer), and stored as E5M2 there.
    dpre = jax.ShapeDtypeStruct((b, t + 8, c), jnp.bfloat16)
    ids_back, w = args[1], args[2]
    for into_dtype, fp8 in ((None, False), (jnp.bfloat16, False), (jnp.float8_e5m2, True)):
        into = None if into_dtype is None else jax.ShapeDtypeStruct((b, t, 8512), into_dtype)

        def grad(dpre, ids, w, into, scale, fp8=fp8):
            return conv_mosaic.input_gradient(dpre, ids, w, False, into, 0 if into is None else 4096,
                                              (scale, jnp.float8_e5m2) if fp8 else None)
        lowered = jax.jit(grad).trace(dpre, ids_back, w, into, jax.ShapeDtypeStruct((), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in lowered
        if into is not None:  # dx lands in the wider array's own buffer: no copy of it after
            assert "output_operand_alias" in lowered and "dynamic_update_slice" not in lowered


def test_lowering_check_at_mamba2_1p3b_shapes_and_where_it_fails(caplog):
    """What kernel_backend=mosaic asks on a GPU before it takes the kernels: true at mamba2-1p3b's
    shapes; where the kernels cannot take them (a 64-tap kernel: more windows than the int8 masks
    hold), one warning and false."""
    import logging
    for fp8 in (False, True):  # the input gradient's BF16 and E5M2 stores
        assert conv_mosaic.lowers_at(8, 2048, 4352, 4, jnp.bfloat16, jnp.float32, jnp.float32, 8512, 4096, fp8)
    with caplog.at_level(logging.WARNING, logger="maxfp4.kernels.ssd_mosaic"):
        assert not conv_mosaic.lowers_at(1, 64, 128, 64, jnp.bfloat16, jnp.float32, jnp.float32, 256, 128)
    assert "does not lower" in caplog.text


def test_shapes_it_takes_and_bad_choices():
    assert conv_mosaic.supported(2048, 4352) and not conv_mosaic.supported(2048, 4336)
    assert not conv_mosaic.supported(2000, 4352)
    x, w, bias, ids = _operands(4)
    with pytest.raises(ValueError, match="multiples of 32 and 128"):
        conv_mosaic.conv_silu_forward(jnp.zeros((1, 48, 128), jnp.bfloat16), jnp.zeros((1, 51), jnp.int32), w[:, :128],
                                      bias[:128], interpret=True)
    with pytest.raises(ValueError, match="8-tap kernel has more windows than the int8 masks hold"):
        conv_mosaic.conv_silu_forward(jnp.zeros((1, 64, 128), jnp.bfloat16), jnp.zeros((1, 71), jnp.int32),
                                      jnp.zeros((8, 128)), bias[:128], interpret=True)
    with pytest.raises(ValueError, match=r"columns \[4, 132\) of a 256-wide x \(the offset a multiple of 8"):
        conv_mosaic.conv_silu_forward(jnp.zeros((1, 64, 256), jnp.bfloat16), jnp.zeros((1, 67), jnp.int32),
                                      w[:, :128], bias[:128], interpret=True, column_offset=4)
    with pytest.raises(ValueError, match="kernel must be triton or mosaic, got 'cuda'"):
        conv_forward(x, w, bias, ids, True, kernel="cuda")
    with pytest.raises(ValueError, match="kernel must be triton or mosaic, got 'cuda'"):
        conv_backward(conv_forward(x, w, bias, ids, True)[1], x, True, kernel="cuda")


def mixer_core_value_and_grads(overrides, t: int, documents: tuple[int, int]):
    """One Mamba-2 mixer core (maxfp4.model.mamba's ``_kernel_core``, the kernels interpreted)
    of the tiny hybrid with ``overrides``, two rows of ``t`` tokens (the first two packed
    documents of those lengths): (its config, its parameters, (the value of a weighted sum of its
    output, the gradients of the in_proj output and of the core's parameters))."""
    from maxfp4.config import load_config
    from maxfp4.model import mamba
    from tests.test_hybrid import TINY

    cfg = load_config(TINY, ["model.mamba.kernels=pallas", *overrides]).model
    d = mamba.dims(cfg)
    p = {k: v[0] for k, v in mamba.init_mamba(cfg, jax.random.key(2), 1).items()}
    core_params = {k: p[k] for k in ("conv_w", "conv_b", "A_log", "D_skip", "dt_bias", "norm")}
    zxbcdt = jax.random.normal(jax.random.key(3), (2, t, d["in"]), jnp.float32).astype(jnp.bfloat16)
    seg = jnp.asarray(np.repeat(np.array([[1, 2], [3, 3]], np.int32), documents, axis=1))
    weights = jax.random.normal(jax.random.key(4), (2, t, d["E"]), jnp.float32)

    def loss(zxbcdt, params):
        return jnp.sum(mamba._kernel_core(zxbcdt, seg, params, cfg).astype(jnp.float32) * weights)
    return cfg, p, jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(zxbcdt, core_params)


def _mixer_core(backend):
    """The mixer core at shapes the Mosaic convolution tiles (64 tokens, 256 convolution
    channels, E = 128) with model.mamba.kernel_backend."""
    from maxfp4.model import mamba
    cfg, p, result = mixer_core_value_and_grads(
        ["model.mamba.head_dim=16", "model.mamba.d_state=32", f"model.mamba.kernel_backend={backend}"], 64, (23, 41))
    d = mamba.dims(cfg)
    assert conv_mosaic.supported(64, d["conv"]) and d["E"] % conv_mosaic.COLUMNS == 0
    x = jnp.zeros((2, 64, d["conv"]), jnp.bfloat16)
    assert mamba._conv_kernels(cfg, x, p["conv_w"], p["conv_b"]) == ("mosaic" if backend == "mosaic" else "triton")
    return result


def test_the_mixer_core_with_kernel_backend_mosaic_runs_the_mosaic_convolution():
    """kernel_backend=mosaic puts the convolution on Mosaic GPU (forward and both backward kernels,
    dx into the in_proj gradient): the same output and in_proj gradient as triton, bit for bit,
    the convolution weights' and bias's gradients within 1e-5 (FP32 summation order)."""
    value, (dz, dparams) = _mixer_core("mosaic")
    value_ref, (dz_ref, dparams_ref) = _mixer_core("triton")
    assert value == value_ref
    np.testing.assert_array_equal(np.asarray(dz, np.float32), np.asarray(dz_ref, np.float32))
    for name in dparams_ref:
        got, want = np.asarray(dparams[name], np.float64), np.asarray(dparams_ref[name], np.float64)
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), name


def test_the_compiled_kernels_sigmoid_formula():
    """``ssd_mosaic.sigmoid``'s compiled formula, rsqrt(1 + exp(-x))^2, against float64's sigmoid
    over FP32 inputs from -100 to 100 and past, evaluated here in FP32: within 8 FP32 ulp (exp's
    error carried through, the root's rounding doubled by the square: 5.5 ulp at worst here; the
    GPU's ex2.approx and rsqrt.approx add a few more, still ~2^-20 against BF16's 2^-8, and
    tests/test_gpu_mamba_kernels.py holds the kernels to the Triton ones there), or at most FP32's
    smallest normal where the value is below it (x below -87.3: subnormal or flushed to 0); 0 and
    1 at the ends."""
    from maxfp4.kernels.ssd_mosaic import sigmoid
    x = np.concatenate([np.linspace(-100, 100, 200_001), [-1e30, 0.0, 1e30]]).astype(np.float32)
    got = np.asarray(jax.jit(lambda v: sigmoid(v, interpret=False))(jnp.asarray(x)), np.float64)
    with np.errstate(over="ignore"):
        want = 1.0 / (1.0 + np.exp(-x.astype(np.float64)))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    normal = want >= np.finfo(np.float32).tiny
    assert (np.abs(got - want) <= 8 * ulp)[normal].all()
    assert (got[~normal] <= np.finfo(np.float32).tiny).all()
    assert got[-3] == 0.0 and got[-1] == 1.0 and abs(got[-2] - 0.5) <= 2.0 ** -24
