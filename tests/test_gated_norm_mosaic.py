"""The Mamba-2 gated norm's Mosaic GPU kernels (maxfp4.kernels.gated_norm_mosaic) under Mosaic
GPU's interpreter against the Triton kernels under theirs (maxfp4.kernels.gated_norm), forward
and backward, BF16 and the FP8 stores; that they lower for CUDA at the shipped Mamba-2 shapes;
and when the mixer takes them. The row sums run in another order than Triton's (a tree over
the warpgroup against Triton's): a value may differ by one BF16 step, a sum over rows (the
scale's gradient) by FP32 rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.kernels import gated_norm as triton_norm
from maxfp4.kernels import gated_norm_mosaic as mosaic_norm
from maxfp4.kernels.epilogue import Quantize

B, T, E, GROUPS, EXTRA = 2, 16, 2048, 2, 512  # groups of 1,024 (the smallest the kernels tile)
BF16_STEP = 2.0 ** -7  # one BF16 step, relative to the largest value


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    u = jnp.asarray(rng.standard_normal((B, T, E)), jnp.bfloat16)
    zx = jnp.asarray(rng.standard_normal((B, T, E + EXTRA)), jnp.bfloat16)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(E), jnp.float32)
    dout = jnp.asarray(rng.standard_normal((B, T, E)), jnp.bfloat16)
    return u, zx, scale, dout


def _close(got, want, share=0.999):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.abs(want).max() > 1
    assert np.mean(got == want) >= share
    assert np.abs(got - want).max() <= BF16_STEP * np.abs(want).max()


def _backward_close(got, want, e: int, fp8: bool):
    """The Mosaic backward's (du, dz, dscale[, max |dz|]) against the Triton kernels': du and dz's
    first ``e`` columns within one step of their format, the scale's gradient within 1e-5."""
    _close(got[0], want[0])
    if fp8:
        dz, want_dz = np.asarray(got[1][..., :e], np.float32), np.asarray(want[1][..., :e], np.float32)
        assert np.mean(dz == want_dz) >= 0.999 and np.abs(dz - want_dz).max() <= 2.0 ** -2 * np.abs(want_dz).max()
        assert abs(float(got[3]) - float(want[3])) <= BF16_STEP * float(want[3])
    else:
        _close(got[1][..., :e], want[1][..., :e])
    dscale, want_dscale = np.asarray(got[2], np.float64), np.asarray(want[2], np.float64)
    assert np.abs(want_dscale).max() > 1
    assert np.abs(dscale - want_dscale).max() <= 1e-5 * np.abs(want_dscale).max()


def test_forward_gives_the_triton_kernels_values_bf16_and_fp8():
    u, zx, scale, _ = _operands()
    want, residuals = triton_norm.gated_norm_forward(u, zx, scale, GROUPS, 1e-5, jnp.bfloat16, True)
    got, same_residuals = mosaic_norm.gated_norm_forward(u, zx, scale, GROUPS, 1e-5, jnp.bfloat16, True)
    _close(got, want)
    for a, e in zip(same_residuals, residuals):
        assert a is e
    quantize = Quantize(jnp.float32(8.0), jnp.float8_e4m3fn)
    (want_q, want_max), _ = triton_norm.gated_norm_forward(u, zx, scale, GROUPS, 1e-5, jnp.bfloat16, True, quantize)
    (got_q, got_max), _ = mosaic_norm.gated_norm_forward(u, zx, scale, GROUPS, 1e-5, jnp.bfloat16, True, quantize)
    assert got_q.dtype == jnp.float8_e4m3fn
    # one BF16 step before the cast moves an E4M3 value by at most one of its steps (2^-3)
    got_q, want_q = np.asarray(got_q, np.float32), np.asarray(want_q, np.float32)
    assert np.mean(got_q == want_q) >= 0.999 and np.abs(got_q - want_q).max() <= 2.0 ** -3 * np.abs(want_q).max()
    assert abs(float(got_max) - float(want_max)) <= BF16_STEP * float(want_max)


@pytest.mark.parametrize("fp8,rows", [(False, 16), (True, 16), (False, 2), (True, 1)])
def test_backward_gives_the_triton_kernels_values(fp8, rows):
    """du and dz (the first E columns of the in_proj-wide array, BF16 or E5M2 with max |dz|) within
    one step of the Triton kernels'; the scale's gradient, a sum over every row, within 1e-5;
    with 16 rows a program (the default), 2 and 1."""
    u, zx, scale, dout = _operands(1)
    residuals = (u, zx, scale)
    quantize = Quantize(jnp.float32(8.0), jnp.float8_e5m2) if fp8 else None
    want = triton_norm.gated_norm_backward(residuals, dout, GROUPS, 1e-5, True, quantize)
    got = mosaic_norm.gated_norm_backward(residuals, dout, GROUPS, 1e-5, True, quantize, rows_per_program=rows)
    assert got[1].shape == (B, T, E + EXTRA) and got[1].dtype == want[1].dtype
    _backward_close(got, want, E, fp8)


def test_lowers_for_cuda_at_the_shipped_mamba_shapes():
    """mamba2-1p3b (E 4,096 in one group, in_proj 8,512 wide) and nemotron-h-8b (8,192 in 8
    groups, 18,560): all four kernels, BF16 and FP8."""
    for direction in ("forward", "backward"):
        for fp8 in (False, True):
            assert mosaic_norm.lowers_at(8, 2048, 4096, 1, 8512, jnp.bfloat16, jnp.float32, direction, fp8)
            assert mosaic_norm.lowers_at(2, 8192, 8192, 8, 18560, jnp.bfloat16, jnp.float32, direction, fp8)


def test_shapes_it_takes():
    assert mosaic_norm.supported(2048, 4096, 1, 8512) and mosaic_norm.supported(16, 2048, 2, 2560)
    assert not mosaic_norm.supported(2048, 4096, 8, 8512)  # groups of 512
    assert not mosaic_norm.supported(2048, 4096, 1, 8500)  # in_proj width not of 64
    assert not mosaic_norm.supported(2040, 4096, 1, 8512)  # T not of 16
    u, zx, scale, _ = _operands()
    with pytest.raises(ValueError, match="E 2048 in 4 groups"):
        mosaic_norm.gated_norm_forward(u, zx, scale, 4, 1e-5, jnp.bfloat16, True)


def test_the_mixer_takes_them_only_under_kernel_backend_mosaic():
    from maxfp4.config import load_config
    from maxfp4.model import mamba
    from tests.test_hybrid import TINY

    overrides = ["model.d_model=1024", "model.mamba.n_groups=1"]
    u, zx = jnp.zeros((1, 32, 2048), jnp.bfloat16), jnp.zeros((1, 32, 2048 + 512), jnp.bfloat16)
    for backend, want in (("mosaic", mosaic_norm), ("auto", triton_norm), ("triton", triton_norm)):
        cfg = load_config(TINY, [*overrides, f"model.mamba.kernel_backend={backend}"]).model
        assert mamba.dims(cfg)["E"] == 2048
        assert mamba._norm_kernels(cfg, u, zx, jnp.zeros((2048,))) is want
    cfg = load_config(TINY, ["model.mamba.kernel_backend=mosaic"]).model  # its groups do not tile
    e = mamba.dims(cfg)["E"]
    assert mamba._norm_kernels(cfg, u[..., :e], zx, jnp.zeros((e,))) is triton_norm


def _mixer_core(backend):
    """The mixer core (tests/test_conv_mosaic.py) whose norm the Mosaic kernels tile (E = 1,024
    in one group, in_proj 2,176 wide), with model.mamba.kernel_backend."""
    from maxfp4.model import mamba
    from tests.test_conv_mosaic import mixer_core_value_and_grads
    cfg, p, result = mixer_core_value_and_grads(
        ["model.d_model=512", "model.mamba.n_groups=1", "model.mamba.head_dim=16", "model.mamba.d_state=32",
         f"model.mamba.kernel_backend={backend}"], 32, (13, 19))
    d = mamba.dims(cfg)
    u, zx = jnp.zeros((2, 32, d["E"]), jnp.bfloat16), jnp.zeros((2, 32, d["in"]), jnp.bfloat16)
    assert (mamba._norm_kernels(cfg, u, zx, p["norm"]) is mosaic_norm) == (backend == "mosaic")
    return result


def test_the_mixer_core_with_kernel_backend_mosaic_runs_the_mosaic_norm():
    """Through the whole mixer core: the loss and every gradient within the kernels' rounding of
    the Triton norm's (the in_proj gradient within a BF16 step of its largest value, 99% of it
    equal; the parameters' gradients within 1e-3 of their largest, as one BF16 step of du
    propagates through the SSD's backward)."""
    value, (dz, dparams) = _mixer_core("mosaic")
    value_ref, (dz_ref, dparams_ref) = _mixer_core("triton")
    assert abs(float(value) - float(value_ref)) <= 1e-4 * abs(float(value_ref))
    _close(dz, dz_ref, share=0.99)
    for name in dparams_ref:
        got, want = np.asarray(dparams[name], np.float64), np.asarray(dparams_ref[name], np.float64)
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max(), name
