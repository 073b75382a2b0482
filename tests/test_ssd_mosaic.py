"""The SSD's Mosaic GPU kernels (maxfp4.kernels.ssd_mosaic) without a GPU: under Mosaic GPU's
interpreter the forward gives the Triton kernel's output (interpreted) and, through ``ssd_fused``,
the sequential scan's to the BF16 operands' bound; the backward's two kernels give the Triton
``_backward_dx_kernel``'s and ``_backward_scores_kernel``'s outputs; the gradients through them
are the Triton path's; and all three lower for CUDA at mamba2-1p3b's shapes, which checks their register layouts and
shared-memory budgets as the GPU compile would. The compiled kernels against the Triton ones:
tests/test_gpu_mamba_kernels.py (GPU).

Bounds: the two kernels add a row's 128 products in different orders (FP32) before one BF16
rounding, so an output may differ by one BF16 step: max |a - b| <= 2^-8 max |b| (a step of
values up to half the largest; near zero a step is relative to the products summed, not to the
output), and nearly all are equal (>= 99% asserted). Against the FP32 reference, BF16 operands: 2e-2 of
max |y|, the bound of test_ssd_kernel.py's BF16 test.
"""

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.config import ConfigError, load_config
from maxfp4.kernels import ssd as triton_ssd
from maxfp4.kernels import ssd_mosaic, state_passing, state_passing_mosaic
from maxfp4.kernels.ssd import (Tiling, chunk_entry_states, chunk_outputs, kernel_inputs, mosaic_forward_takes,
                               ssd_fused)
from maxfp4.model.ssd import ssd_reference
from tests.test_ssd import ARG_NAMES, _inputs, _rel

B, T, H, P, G, N, Q = 1, 256, 4, 64, 1, 32, 128
# Two documents in the row, the second starting inside the first chunk, so masks and the
# entry-state factor are exercised.
IDS = np.repeat(np.array([[1, 2]], np.int32), [100, T - 100], axis=1)


# (heads, groups): one program a chunk walking 4 heads, and 2 groups of 6 heads in programs of 2
# heads (3 a group), so each program must find its group's C.B tile.
HEAD_LAYOUTS = pytest.mark.parametrize("h, g", [(H, G), (12, 2)])


def _kernel_inputs(h=H, g=G):
    x, dt, A, Bm, C = _inputs(3, B, T, h, P, g, N, dtype=np.float32, dt_range=(0.01, 0.3))
    inputs = kernel_inputs(x, dt, A, Bm, C, jnp.asarray(IDS), Q, jnp.bfloat16, interpret=True)
    d = jnp.broadcast_to(jnp.linspace(0.5, 1.5, h, dtype=jnp.float32)[:, None], (h, P))
    return (*inputs, d)


@HEAD_LAYOUTS
def test_interpreted_kernel_gives_the_triton_kernels_output(h, g):
    inputs = _kernel_inputs(h, g)
    y_triton = chunk_outputs(*inputs, jnp.bfloat16, jnp.bfloat16, True, Tiling(heads=2))
    y_mosaic = ssd_mosaic.chunk_outputs_forward(*inputs, jnp.bfloat16, interpret=True)
    a, b = np.asarray(y_mosaic, np.float64), np.asarray(y_triton, np.float64)
    assert a.shape == (B, T, h, P) and np.abs(b).max() > 1
    assert np.abs(a - b).max() <= 2.0 ** -8 * np.abs(b).max()
    assert np.mean(a == b) >= 0.99


def _close_to(got, want):
    """The module docstring's bound: one BF16 step of values up to half the largest, >= 99% equal."""
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert a.shape == b.shape and np.abs(b).max() > 0
    assert np.abs(a - b).max() <= 2.0 ** -8 * np.abs(b).max()
    assert np.mean(a == b) >= 0.99


@HEAD_LAYOUTS
def test_interpreted_input_gradients_give_the_triton_kernels(h, g):
    cb, x, dt, cs, seg, c_entry, d = _kernel_inputs(h, g)
    dy = jnp.cos(jnp.arange(x.size, dtype=jnp.float32).reshape(c_entry.shape)).astype(jnp.bfloat16)
    launch = triton_ssd._Launch(c_entry, cb, True, Tiling(heads=2))
    want = launch.call(
        functools.partial(triton_ssd._backward_dx_kernel, matmul_dtype=jnp.bfloat16, cdt=jnp.float32),
        [launch.group_QQ, launch.heads_Q, launch.heads_Q, launch.seg_Q, launch.heads_QP, launch.heads_P,
         launch.heads_QP, launch.heads_QP],
        [launch.heads_QP, launch.heads_QP, launch.heads_Q, launch.heads_Q],
        [jax.ShapeDtypeStruct(c_entry.shape, x.dtype), jax.ShapeDtypeStruct(c_entry.shape, c_entry.dtype),
         jax.ShapeDtypeStruct(cs.shape, jnp.float32), jax.ShapeDtypeStruct(cs.shape, jnp.float32)],
        cb, dt, cs, seg, c_entry, d, dy, x)
    got = ssd_mosaic.chunk_input_gradients(cb, dt, cs, seg, c_entry, d, dy, x, interpret=True)
    for g, w in zip(got, want):
        _close_to(g, w)


@HEAD_LAYOUTS
def test_interpreted_score_gradients_give_the_triton_kernels(h, g):
    cb, x, dt, cs, seg, c_entry, d = _kernel_inputs(h, g)
    dy = jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(c_entry.shape)).astype(jnp.bfloat16)
    heads = ssd_mosaic.heads_per_program(h // g)
    launch = triton_ssd._Launch(c_entry, cb, True, Tiling(heads=heads))
    b, k, g, q, _ = cb.shape
    want = launch.call(
        functools.partial(triton_ssd._backward_scores_kernel, matmul_dtype=jnp.bfloat16, cdt=jnp.float32),
        [launch.group_QQ, launch.heads_QP, launch.heads_Q, launch.heads_Q, launch.seg_Q, launch.heads_QP],
        [launch.block_QQ, launch.heads_Q, launch.block_heads_P],
        [jax.ShapeDtypeStruct((b, k, h // heads, q, q), jnp.float32), jax.ShapeDtypeStruct(cs.shape, jnp.float32),
         jax.ShapeDtypeStruct((b, k, h, P), jnp.float32)],
        cb, x, dt, cs, seg, dy)
    dcb, g_rows, dd_parts = ssd_mosaic.chunk_score_gradients(cb, x, dt, cs, seg, dy, interpret=True)
    assert dd_parts.shape == (b, k, 2, h, P)  # a part per warpgroup's rows
    # FP32 outputs: the D skip's gradient is summed in two parts of 64 rows here, over 128 rows
    # there; a reordered FP32 sum of 128 terms is within 1e-5 of the largest.
    for got, w in zip((dcb, g_rows, dd_parts.sum(axis=2)), want):
        a, b_ = np.asarray(got, np.float64), np.asarray(w, np.float64)
        assert a.shape == b_.shape and np.abs(a - b_).max() <= 1e-5 * np.abs(b_).max()
    np.testing.assert_array_equal(np.asarray(dcb), np.asarray(want[0]))  # the same sums in the same order


def test_ssd_fused_with_the_mosaic_forward_matches_the_scan_and_the_triton_gradients():
    args = _inputs(5, B, T, H, P, G, N, dtype=np.float32, dt_range=(0.01, 0.3))
    ids = jnp.asarray(IDS)
    w = jnp.cos(jnp.arange(B * T * H * P, dtype=jnp.float32).reshape(B, T, H, P))

    def fused(forward):
        return lambda *a: ssd_fused(*a, ids, Q, matmul_dtype=jnp.bfloat16, interpret=True, forward=forward)

    y_ref = ssd_reference(*args, ids)
    assert 0 < _rel(fused("mosaic")(*args), y_ref) < 2e-2

    def grads(fn):
        return jax.grad(lambda *a: jnp.sum(fn(*a) * w), argnums=range(5))(*args)
    # The backward kernels read the forward's inputs, not its output: the same gradients.
    want = grads(fused("triton"))
    for name, got, w_ in zip(ARG_NAMES, grads(fused("mosaic")), want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w_), err_msg=name)
    # With the Mosaic input-gradient kernel too (BF16 activations, so a BF16 dy, as in the model):
    # its outputs within the bound, so the gradients within the BF16 operands' bound
    # (test_ssd_kernel.py) of the Triton path's.
    args = (args[0].astype(jnp.bfloat16),) + args[1:]

    def both(*a):
        return ssd_fused(*a, ids, Q, matmul_dtype=jnp.bfloat16, interpret=True, forward="mosaic", backward="mosaic")
    for name, got, w_ in zip(ARG_NAMES, grads(both), grads(fused("triton"))):
        assert _rel(got, w_) < 2e-2, name


def test_kernel_lowers_for_cuda_at_the_benchmark_shapes():
    """mamba2-1p3b a layer: 2 of its 8 rows, 64 heads of 64 in one group, chunks of 128."""
    b, t, h, p, g = 2, 2048, 64, 64, 1
    k = t // Q
    f32, bf16 = jnp.float32, jnp.bfloat16
    shapes = [((b, k, g, Q, Q), f32), ((b, t, h, p), bf16), ((b, h, t), f32), ((b, h, t), f32), ((b, t), jnp.int32),
              ((b, t, h, p), bf16), ((h, p), f32)]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    lowered = jax.jit(lambda *a: ssd_mosaic.chunk_outputs_forward(*a, bf16)).trace(*args).lower(
        lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    cb, x, dt, cs, seg, c_entry, d = args
    for kernel, operands in ((ssd_mosaic.chunk_input_gradients, (cb, dt, cs, seg, c_entry, d, x, x)),
                             (ssd_mosaic.chunk_score_gradients, (cb, x, dt, cs, seg, x))):
        lowered = jax.jit(kernel).trace(*operands).lower(lowering_platforms=("cuda",))
        assert "mosaic_gpu" in lowered.as_text()
    # The recurrence between chunks: [B, K, G, N, R, P] states, N = 128.
    states = jax.ShapeDtypeStruct((b, k, g, 128, h, p), f32)
    decay = jax.ShapeDtypeStruct((b, k, g, h), f32)
    entry = jax.ShapeDtypeStruct(states.shape, bf16)
    assert ssd_mosaic.lowers(state_passing_mosaic.entry_states_forward, states, decay, out_dtype=bf16)
    assert ssd_mosaic.lowers(state_passing_mosaic.entry_states_backward, decay, entry, entry, dstates_dtype=bf16)


def test_shapes_dtypes_and_program_size():
    assert ssd_mosaic.forward_supported(128, 64, 64) and ssd_mosaic.forward_supported(128, 64, 2)
    assert not ssd_mosaic.forward_supported(256, 64, 64)  # the [Q, Q] FP32 tile would not fit
    assert not ssd_mosaic.forward_supported(64, 64, 2)  # no register layouts for [64, 64] tiles (jax 0.11.2)
    assert not ssd_mosaic.forward_supported(128, 128, 64) and not ssd_mosaic.forward_supported(128, 64, 3)
    assert [ssd_mosaic.heads_per_program(r) for r in (2, 6, 8, 64)] == [2, 2, 8, 16]
    assert mosaic_forward_takes(128, 64, 64, jnp.bfloat16, jnp.float32, jnp.bfloat16)
    assert not mosaic_forward_takes(128, 64, 64, jnp.float32, jnp.float32, jnp.bfloat16)  # ssd_matmul=fp32
    assert not mosaic_forward_takes(128, 64, 64, jnp.bfloat16, jnp.float32, jnp.float32)  # FP32 activations
    if jax.devices()[0].platform == "cpu":  # off a Hopper GPU, auto keeps the Triton forward
        assert not ssd_mosaic.available()
    with pytest.raises(ValueError, match="forward: expected auto, triton or mosaic, got 'cuda'"):
        ssd_fused(*_inputs(1, 1, 16, 4, 4, 2, 4, dtype=np.float32), jnp.ones((1, 16), jnp.int32), 8,
                  interpret=True, forward="cuda")
    with pytest.raises(ValueError, match="backward: expected auto, triton or mosaic, got 'cuda'"):
        ssd_fused(*_inputs(1, 1, 16, 4, 4, 2, 4, dtype=np.float32), jnp.ones((1, 16), jnp.int32), 8,
                  interpret=True, backward="cuda")


def test_kernel_backend_key():
    for backend in ("triton", "auto", "mosaic"):
        cfg = load_config(None, ["model.kind=hybrid", "model.pattern=M*", f"model.mamba.kernel_backend={backend}"])
        assert cfg.model.mamba.kernel_backend == backend
    with pytest.raises(ConfigError, match=r"model\.mamba\.kernel_backend.*'mosaik'.*auto, mosaic or triton"):
        load_config(None, ["model.kind=hybrid", "model.pattern=M*", "model.mamba.kernel_backend=mosaik"])


def test_a_kernel_that_does_not_lower_leaves_auto_on_triton(caplog):
    """``lowers`` is what ``ssd_fused``'s auto asks before it picks a Mosaic kernel on a GPU."""
    f32, bf16 = jnp.float32, jnp.bfloat16

    def operands(q):
        b, t, h, p, g = 1, 2 * q, 4, 64, 1
        shapes = [((b, t // q, g, q, q), f32), ((b, t, h, p), bf16), ((b, h, t), f32), ((b, h, t), f32),
                  ((b, t), jnp.int32), ((b, t, h, p), bf16), ((h, p), f32)]
        return [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    assert ssd_mosaic.lowers(ssd_mosaic.chunk_outputs_forward, *operands(128), out_dtype=bf16)
    with caplog.at_level(logging.WARNING, logger="maxfp4.kernels.ssd_mosaic"):
        assert not ssd_mosaic.lowers(ssd_mosaic.chunk_outputs_forward, *operands(256), out_dtype=bf16)
    assert "chunk_outputs_forward does not lower" in caplog.text and "the Triton kernel runs instead" in caplog.text


def _same_bits_but_contractions(got, want):
    """Equal bits, but where XLA fused a multiply and an add into one FMA in one interpreter and
    not the other (jax 0.11's CPU compiler: 2 of 32,768 entries one BF16 step apart; jax 0.10:
    none): at most 0.1% of the values, each within one step of its format's 8-bit mantissa."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.mean(got == want) >= 0.999
    assert np.all(np.abs(got - want) <= 2.0 ** -7 * np.maximum(np.abs(want), np.abs(got)))


def test_interpreted_recurrence_kernels_give_the_triton_kernels_and_the_same_gradients():
    """The recurrence runs the same operations in the same order in both (and the decays' row
    sums are XLA's under both interpreters): equal bits up to XLA's contractions, entries, their
    gradients and, through ``chunk_entry_states``, the chunk states' gradients."""
    rng = np.random.default_rng(0)
    b, kp, g, n, r, p = 1, 4, 1, 2, 64, 64  # one 64-head block
    states = jnp.asarray(rng.standard_normal((b, kp, g, n, r, p)), jnp.float32)
    decay = jnp.asarray(rng.uniform(0, 1, (b, kp, g, r)), jnp.float32)
    entry = state_passing.entry_states_forward(states, decay, jnp.bfloat16, True)
    _same_bits_but_contractions(
        state_passing_mosaic.entry_states_forward(states, decay, jnp.bfloat16, interpret=True), entry)
    dentry = jnp.asarray(rng.standard_normal(states.shape), jnp.bfloat16)
    want = state_passing.entry_states_backward(decay, entry, dentry, jnp.bfloat16, True)
    got = state_passing_mosaic.entry_states_backward(decay, entry, dentry, jnp.bfloat16, interpret=True)
    for a, w in zip(got, want):
        _same_bits_but_contractions(a, w)

    q = 8
    Bm = jnp.asarray(rng.standard_normal((b, 3, q, g, n)), jnp.bfloat16)
    wx = jnp.asarray(rng.standard_normal((b, 3, q, g, r, p)), jnp.bfloat16)
    decay3 = decay[:, :3]
    w_ = jnp.asarray(rng.standard_normal((b, 3, g, n, r, p)), jnp.float32)

    def loss(kernel):
        return lambda *a: jnp.sum(chunk_entry_states(*a, True, kernel).astype(jnp.float32) * w_)
    for a, w in zip(jax.grad(loss("mosaic"), argnums=range(3))(Bm, wx, decay3),
                    jax.grad(loss("triton"), argnums=range(3))(Bm, wx, decay3)):
        _same_bits_but_contractions(a, w)
    assert state_passing_mosaic.supported(64, 64) and not state_passing_mosaic.supported(16, 64)
