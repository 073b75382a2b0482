"""Mamba-2's causal depthwise convolution + SiLU as Mosaic GPU kernels: the forward and the
backward's two (the pre-activation's gradient with the weights' and bias's partial sums; the
input gradient, alone, into a wider array or stored as FP8), the values of the Triton kernels
of ``maxfp4.kernels.conv`` (read its module docstring first) from the same operands (x padded
with W - 1 rows in front, its segment ids with -1).

One program per (batch row, 64 rows of T, 128 channels). The W windows of x that its outputs
read (the rows ``lag`` positions back, lag = 0 .. W-1) arrive by W TMA copies into W untiled
shared-memory buffers (a copy into tiled, swizzled memory must start on a whole 8-row tile of
the source); the copies after the first mostly come from L2. Which window rows are in the
row's document comes as one bit a window (``_window_masks``, from the segment ids before the
launch), the weights' and the bias's columns by TMA too. The pre-activation is summed in FP32
in the Triton kernel's order (bias, then lags 0 .. W-1), SiLU applied, and the tile leaves by
TMA. The backward's first kernel recomputes it, forms the pre-activation's gradient and sums
its columns (and the inputs' times it, one sum per weight row) over the tile's 64 rows; the
second reads W windows of that gradient, forward in T, as the first reads x's, into a fresh
array that XLA sets into in_proj's gradient (``input_gradient``). ``approx_math``: the
sigmoid's ``exp`` is ``ex2.approx``, as in ``maxfp4.kernels.ssd_mosaic``.

Shapes it takes (``supported``): T a multiple of 64 and the channels of 128 (Mosaic GPU's wgmma
register layout of [64, N] tiles, the one layout whose row and column vectors broadcast). Off a
GPU they run under Mosaic GPU's interpreter, where the tests hold them to the Triton kernels'
values; on an H200 they match them too (tests/test_gpu_mamba_kernels.py) but run slower
(mamba2-1p3b's layer, ``benchmarks/conv_layer.py``, 2026-11-29: forward 0.463 against 0.416 ms,
backward 1.094 against 0.832 ms; both ~7x their memory floor): the window reads conflict in
shared-memory banks, and each tile waits for its copies alone. So only
``model.mamba.kernel_backend=mosaic`` takes them, never ``auto``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maxfp4.kernels.epilogue import Quantized
from maxfp4.kernels.ssd_mosaic import ROWS, Ops, launch_params, lowers, tiles

COLUMNS = 128  # channels a program: one 128-byte swizzle row of BF16 is 64, so two tiles across


def supported(t: int, channels: int) -> bool:
    return t % ROWS == 0 and channels % COLUMNS == 0


def _by_row(v: jax.Array) -> jax.Array:
    return lax.broadcast_in_dim(v, (ROWS, COLUMNS), [0])


def _by_col(v: jax.Array) -> jax.Array:
    return lax.broadcast_in_dim(v.astype(jnp.float32), (ROWS, COLUMNS), [1])


def _checked_length(name: str, t_pad: int, width: int, c: int) -> int:
    """T from a padded length, if the kernels tile it and the channels."""
    t = t_pad - (width - 1)
    if not supported(t, c):
        raise ValueError(f"{name}: T {t} and channels {c} must be multiples of {ROWS} and {COLUMNS}")
    return t


def _window_masks(ids_pad: jax.Array, width: int, own: int) -> jax.Array:
    """[B, T] int32 whose bit k says whether window k's row (padded row s + k) is in row s's
    document (the one at padded row s + ``own``): the Triton kernels' test of segment ids, made
    once here. A TMA copy starting inside a 16-byte word of the source faults on Hopper, so the
    kernels cannot fetch the ids' W windows one row apart as they fetch x's; they fetch these
    masks, 64 aligned rows a tile."""
    ids = ids_pad.astype(jnp.int32)
    t = ids.shape[1] - (width - 1)
    now = ids[:, own:own + t]
    return sum((ids[:, k:k + t] == now).astype(jnp.int32) << k for k in range(width))


def _call(kernel, out_type, grid, scratch, interpret: bool):
    """``plgpu.kernel`` over a (batch row, 64 rows, 128 channels) grid."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.kernel(kernel, out_type=out_type, grid=grid, grid_names=("b", "t", "c"), scratch_types=scratch,
                        **launch_params(interpret))


def _fetch_windows(plgpu, src_g, masks_g, bi, t0, cols, src_s, masks_s, loaded, width: int) -> None:
    """Window ``k`` of a tile: rows t0 + k .. t0 + k + 63 of ``src`` (its columns ``cols``), by
    TMA into buffer k, and the tile's window masks (``_window_masks``)."""
    for k in range(width):
        plgpu.copy_gmem_to_smem(src_g.at[bi, pl.ds(t0 + k, ROWS), cols], src_s.at[k], loaded)
    plgpu.copy_gmem_to_smem(masks_g.at[bi, pl.ds(t0, ROWS)], masks_s, loaded)


def _fetch_conv_operands(plgpu, x_g, masks_g, w_g, b_g, x_s, masks_s, w_s, bias_s, loaded, width: int):
    """A program's (batch row, first row, columns) and the copies of what the pre-activation
    reads: x's W windows with their masks, the weights' and the bias's columns."""
    bi, ti, ci = lax.axis_index("b"), lax.axis_index("t"), lax.axis_index("c")
    t0, cols = ti * ROWS, pl.ds(ci * COLUMNS, COLUMNS)
    # window k holds the rows W - 1 - k positions back
    _fetch_windows(plgpu, x_g, masks_g, bi, t0, cols, x_s, masks_s, loaded, width)
    plgpu.copy_gmem_to_smem(w_g.at[:, cols], w_s, loaded)
    plgpu.copy_gmem_to_smem(b_g.at[cols], bias_s, loaded)
    return bi, ti, t0, cols


def _masked_window(ops: Ops, src_s, k: int, masks_RC: jax.Array) -> jax.Array:
    """Window k in FP32, zero in rows of another document than the row's. Untiled buffers:
    the WGMMA layout's 2-element reads conflict in shared-memory banks."""
    v_RC = ops.load(src_s.at[k], (), ops.tile, optimized=False).astype(jnp.float32)
    return jnp.where((masks_RC & (1 << k)) != 0, v_RC, 0.0)


def _pre_activation(ops: Ops, x_s, masks_s, w_s, bias_s, width: int) -> tuple[jax.Array, jax.Array]:
    """(conv + b over the tile in FP32, bias first then lags 0 .. W-1 as the Triton kernel sums,
    the tile's window masks by row)."""
    masks_RC = _by_row(ops.load(masks_s, (), ops.rows))
    pre_RC = _by_col(ops.load(bias_s, (), ops.cols))
    for lag in range(width):
        pre_RC = pre_RC + (_masked_window(ops, x_s, width - 1 - lag, masks_RC)
                           * _by_col(ops.load(w_s.at[width - 1 - lag], (), ops.cols)))
    return pre_RC, masks_RC


@functools.partial(jax.jit, static_argnames=("interpret",))
def conv_silu_forward(x_pad: jax.Array, ids_pad: jax.Array, w_WC: jax.Array, b_C: jax.Array,
                      interpret: bool = False) -> jax.Array:
    """silu(causal conv + b) [B, T, C] in x's dtype from x_pad [B, T + W - 1, C] (W - 1 zero rows in
    front), ids_pad [B, T + W - 1] (-1 in front), the weights [W, C] and bias [C]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, t_pad, c = x_pad.shape
    width = w_WC.shape[0]
    t = _checked_length("conv_silu_forward", t_pad, width, c)
    ops = Ops(interpret)

    def kernel(x_g, masks_g, w_g, b_g, out_g, x_s, masks_s, w_s, bias_s, out_s, loaded):
        bi, _, t0, cols = _fetch_conv_operands(plgpu, x_g, masks_g, w_g, b_g, x_s, masks_s, w_s, bias_s, loaded,
                                               width)
        plgpu.barrier_wait(loaded)
        pre_RC, _ = _pre_activation(ops, x_s, masks_s, w_s, bias_s, width)
        out_s[...] = (pre_RC * jax.nn.sigmoid(pre_RC)).astype(out_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g.at[bi, pl.ds(t0, ROWS), cols])
        plgpu.wait_smem_to_gmem(0)

    # The windows start at any row: TMA copies into tiled (swizzled) shared memory need rows in
    # whole 8-row tiles of the source, so they land untiled.
    scratch = [plgpu.SMEM((width, ROWS, COLUMNS), x_pad.dtype),
               plgpu.SMEM((ROWS,), jnp.int32),
               plgpu.SMEM((width, COLUMNS), w_WC.dtype),
               plgpu.SMEM((COLUMNS,), b_C.dtype),
               plgpu.SMEM((ROWS, COLUMNS), x_pad.dtype, transforms=tiles(x_pad.dtype)),
               plgpu.Barrier(num_arrivals=width + 3)]
    return _call(kernel, jax.ShapeDtypeStruct((b, t, c), x_pad.dtype), (b, t // ROWS, c // COLUMNS), scratch,
                 interpret)(x_pad, _window_masks(ids_pad, width, width - 1), w_WC, b_C)


@functools.partial(jax.jit, static_argnames=("interpret",))
def preactivation_gradients(x_pad: jax.Array, ids_pad: jax.Array, w_WC: jax.Array, b_C: jax.Array,
                            dout_BTC: jax.Array, interpret: bool = False):
    """The backward's first kernel (``conv._preactivation_grad_kernel``): the pre-activation's
    gradient in x's dtype, as rows 0..T-1 of a [B, T + 8, C] buffer (the input gradient's kernel
    reads W - 1 rows past T there, masked; 8 so that its rows tile for TMA), and per 64-row tile
    the FP32 column sums of the bias's gradient [B, T/64, C] and of each weight row's (W of them)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, t_pad, c = x_pad.shape
    width = w_WC.shape[0]
    t = _checked_length("preactivation_gradients", t_pad, width, c)
    ops = Ops(interpret)
    f32 = jnp.float32

    def kernel(x_g, masks_g, w_g, b_g, dout_g, dpre_g, db_g, dw_g, x_s, masks_s, w_s, bias_s, dout_s, dpre_s,
               sums_s, loaded):
        bi, ti, t0, cols = _fetch_conv_operands(plgpu, x_g, masks_g, w_g, b_g, x_s, masks_s, w_s, bias_s, loaded,
                                                width)
        plgpu.copy_gmem_to_smem(dout_g.at[bi, pl.ds(t0, ROWS), cols], dout_s, loaded)
        plgpu.barrier_wait(loaded)
        pre_RC, masks_RC = _pre_activation(ops, x_s, masks_s, w_s, bias_s, width)
        sig_RC = jax.nn.sigmoid(pre_RC)
        dpre_RC = ops.load(dout_s, (), ops.tile).astype(f32) * sig_RC * (1.0 + pre_RC * (1.0 - sig_RC))
        dpre_s[...] = dpre_RC.astype(dpre_s.dtype)
        sums_s[0] = jnp.sum(dpre_RC, axis=0)
        for row in range(width):  # weight row k multiplies window k (the input W - 1 - k positions back)
            sums_s[1 + row] = jnp.sum(_masked_window(ops, x_s, row, masks_RC) * dpre_RC, axis=0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dpre_s, dpre_g.at[bi, pl.ds(t0, ROWS), cols])
        plgpu.copy_smem_to_gmem(sums_s.at[0], db_g.at[bi, ti, cols])
        for row in range(width):
            plgpu.copy_smem_to_gmem(sums_s.at[1 + row], dw_g.at[row, bi, ti, cols])
        plgpu.wait_smem_to_gmem(0)

    dtype = x_pad.dtype
    scratch = [plgpu.SMEM((width, ROWS, COLUMNS), dtype),
               plgpu.SMEM((ROWS,), jnp.int32),
               plgpu.SMEM((width, COLUMNS), w_WC.dtype),
               plgpu.SMEM((COLUMNS,), b_C.dtype),
               plgpu.SMEM((ROWS, COLUMNS), dout_BTC.dtype, transforms=tiles(dout_BTC.dtype)),
               plgpu.SMEM((ROWS, COLUMNS), dtype, transforms=tiles(dtype)),
               plgpu.SMEM((1 + width, COLUMNS), f32),
               plgpu.Barrier(num_arrivals=width + 4)]
    out_type = [jax.ShapeDtypeStruct((b, t + 8, c), dtype), jax.ShapeDtypeStruct((b, t // ROWS, c), f32),
                jax.ShapeDtypeStruct((width, b, t // ROWS, c), f32)]
    dpre, db_parts, dw_parts = _call(kernel, out_type, (b, t // ROWS, c // COLUMNS), scratch, interpret)(
        x_pad, _window_masks(ids_pad, width, width - 1), w_WC, b_C, dout_BTC)
    return dpre, db_parts, list(dw_parts)


def input_gradient(dpre_pad: jax.Array, ids_back: jax.Array, w_WC: jax.Array, interpret: bool = False,
                   into_BTI: jax.Array | None = None, column_offset: int = 0,
                   quantize: tuple[jax.Array, Any] | None = None):
    """The backward's second kernel (``conv._input_grad``): dx[s] = sum over lag of
    dpre[s + lag] w[W-1-lag] where s + lag is in s's document, from ``preactivation_gradients``'s
    buffer (at least T + W - 1 rows) and the segment ids padded with W - 1 rows of -1 at the end
    ([B, T + W - 1]).

    Returns dx [B, T, C] in dpre's dtype; with ``into_BTI`` ([B, T, I]) dx set into its columns
    [column_offset, column_offset + C) and the whole array returned; with ``quantize`` = (scale,
    FP8 dtype), into an FP8 ``into_BTI``, stored as ``epilogue.Quantized`` does, and (dx, max |dx
    rounded|) returned. The kernel writes a [B, T, C] array that XLA then sets into the wider one
    (in place): writing the wider array's buffer itself needs ``input_output_aliases``, which
    ``plgpu.kernel`` does not take and jax 0.11's ``pallas_call`` no longer lowers for Mosaic GPU."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, t_pad, c = ids_back.shape[0], ids_back.shape[1], w_WC.shape[1]
    width = w_WC.shape[0]
    t = _checked_length("input_gradient", t_pad, width, c)
    if quantize is not None and into_BTI is None:
        raise ValueError("input_gradient: quantize needs into_BTI")
    ops = Ops(interpret)
    f32 = jnp.float32
    out_dtype = dpre_pad.dtype if into_BTI is None else into_BTI.dtype
    quantized = None if quantize is None else Quantized(dpre_pad.dtype)

    def kernel(dpre_g, masks_g, w_g, *refs):
        refs = list(refs)
        scale_g = refs.pop(0) if quantize is not None else None
        out_g = refs.pop(0)
        amax_g = refs.pop(0) if quantize is not None else None
        d_s, masks_s, w_s = refs[:3]
        scale_s, out_s, amax_s, loaded = refs[3:] if quantize is not None else (None, refs[3], None, refs[4])
        bi, ti, ci = lax.axis_index("b"), lax.axis_index("t"), lax.axis_index("c")
        t0, cols = ti * ROWS, pl.ds(ci * COLUMNS, COLUMNS)
        _fetch_windows(plgpu, dpre_g, masks_g, bi, t0, cols, d_s, masks_s, loaded, width)  # window lag: lag ahead
        plgpu.copy_gmem_to_smem(w_g.at[:, cols], w_s, loaded)
        if scale_g is not None:
            plgpu.copy_gmem_to_smem(scale_g, scale_s, loaded)
        plgpu.barrier_wait(loaded)
        masks_RC = _by_row(ops.load(masks_s, (), ops.rows))
        zeros = jnp.zeros((ROWS, COLUMNS), f32)
        dx_RC = zeros if interpret else plgpu.layout_cast(zeros, ops.tile)
        for lag in range(width):
            dx_RC = dx_RC + (_masked_window(ops, d_s, lag, masks_RC)
                             * _by_col(ops.load(w_s.at[width - 1 - lag], (), ops.cols)))
        if quantized is None:
            out_s[...] = dx_RC.astype(out_s.dtype)
        else:
            dx_RC = quantized.round(dx_RC)
            out_s[...] = quantized.cast(dx_RC, scale_s[0], out_s.dtype)
            amax_s[...] = jnp.max(jnp.abs(dx_RC), axis=0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g.at[bi, pl.ds(t0, ROWS), cols])
        if amax_g is not None:
            plgpu.copy_smem_to_gmem(amax_s, amax_g.at[bi, ti, cols])
        plgpu.wait_smem_to_gmem(0)

    operands = [dpre_pad, _window_masks(ids_back, width, 0), w_WC]
    outs = [jax.ShapeDtypeStruct((b, t, c), out_dtype)]
    scratch = [plgpu.SMEM((width, ROWS, COLUMNS), dpre_pad.dtype),
               plgpu.SMEM((ROWS,), jnp.int32),
               plgpu.SMEM((width, COLUMNS), w_WC.dtype)]
    if quantize is not None:
        # A copy moves a multiple of 128 bytes (one per thread of the warpgroup): the scale padded.
        operands.append(jnp.pad(jnp.reshape(quantize[0], (1,)).astype(f32), (0, 31)))
        outs.append(jax.ShapeDtypeStruct((b, t // ROWS, c), f32))
        scratch.append(plgpu.SMEM((32,), f32))
    scratch.append(plgpu.SMEM((ROWS, COLUMNS), out_dtype, transforms=tiles(out_dtype)))
    if quantize is not None:
        scratch.append(plgpu.SMEM((COLUMNS,), f32))
    scratch.append(plgpu.Barrier(num_arrivals=width + 2 + (quantize is not None)))
    results = _call(kernel, outs, (b, t // ROWS, c // COLUMNS), scratch, interpret)(*operands)
    dx = results[0]
    if into_BTI is not None:
        dx = lax.dynamic_update_slice_in_dim(into_BTI, dx, column_offset, axis=2)
    if quantize is None:
        return dx
    return dx, jnp.max(results[1])


def _gradient_into(dpre_pad, ids_back, w_WC, into_BTI, scale, column_offset: int, fp8: bool):
    """``input_gradient`` as the Mamba-2 mixer calls it: into in_proj's gradient, BF16 or FP8."""
    return input_gradient(dpre_pad, ids_back, w_WC, False, into_BTI, column_offset,
                          (scale, into_BTI.dtype) if fp8 else None)


def lowers_at(b: int, t: int, c: int, width: int, x_dtype, w_dtype, b_dtype, into_columns: int,
              column_offset: int) -> bool:
    """Whether this jax lowers the kernels for CUDA as the mixer runs them at these shapes (dx into
    in_proj's [B, T, into_columns] gradient at ``column_offset``, in x's dtype and in E5M2 for FP8
    delayed scaling) (``ssd_mosaic.lowers``: one warning and False where it does not, so the
    caller keeps the Triton kernels)."""
    sds = jax.ShapeDtypeStruct
    x_pad, ids = sds((b, t + width - 1, c), x_dtype), sds((b, t + width - 1), jnp.int32)
    w, bias = sds((width, c), w_dtype), sds((c,), b_dtype)
    dpre, scale = sds((b, t + 8, c), x_dtype), sds((), jnp.float32)
    return (lowers(conv_silu_forward, x_pad, ids, w, bias)
            and lowers(preactivation_gradients, x_pad, ids, w, bias, sds((b, t, c), x_dtype))
            and all(lowers(_gradient_into, dpre, ids, w, sds((b, t, into_columns), dtype), scale,
                           column_offset=column_offset, fp8=fp8)
                    for dtype, fp8 in ((x_dtype, False), (jnp.float8_e5m2, True))))
