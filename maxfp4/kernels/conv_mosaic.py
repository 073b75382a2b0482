"""Mamba-2's causal depthwise convolution + SiLU as Mosaic GPU kernels: the forward and the
backward's first kernel (the pre-activation's gradient with the weights' and bias's partial
sums), the values of the Triton kernels of ``maxfp4.kernels.conv`` (read its module docstring
first) from the same operands (x padded with W - 1 rows in front, its segment ids with -1).

One program per (batch row, 64 rows of T, 128 channels). The W windows of x that its outputs
read (the rows ``lag`` positions back, lag = 0 .. W-1) arrive by W TMA copies into W untiled
shared-memory buffers (a copy into tiled, swizzled memory must start on a whole 8-row tile of
the source); the copies after the first mostly come from L2. Their
segment ids, the weights' and the bias's columns arrive alike. The pre-activation is summed in
FP32 in the Triton kernel's order (bias, then lags 0 .. W-1), SiLU applied, and the tile leaves by
TMA. The backward's kernel recomputes it, forms the pre-activation's gradient and sums its
columns (and the inputs' times it, one sum per weight row) over the tile's 64 rows. ``approx_math``: the sigmoid's ``exp`` is ``ex2.approx``, as in ``maxfp4.kernels.ssd_mosaic``.

Shapes it takes (``supported``): T a multiple of 64 and the channels of 128 (Mosaic GPU's wgmma
register layout of [64, N] tiles, the one layout whose row and column vectors broadcast). Off a
GPU they run under Mosaic GPU's interpreter, where the tests hold them to the Triton kernels'
values. Not yet measured on a GPU: ``conv.conv_forward(..., kernel="mosaic")`` and
``conv.conv_backward(..., kernel="mosaic")`` select them, the model never does
(``benchmarks/conv_layer.py`` measures them).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maxfp4.kernels.ssd_mosaic import ROWS, Ops, launch_params, tiles

COLUMNS = 128  # channels a program: one 128-byte swizzle row of BF16 is 64, so two tiles across


def supported(t: int, channels: int) -> bool:
    return t % ROWS == 0 and channels % COLUMNS == 0


@functools.partial(jax.jit, static_argnames=("interpret",))
def conv_silu_forward(x_pad: jax.Array, ids_pad: jax.Array, w_WC: jax.Array, b_C: jax.Array,
                      interpret: bool = False) -> jax.Array:
    """silu(causal conv + b) [B, T, C] in x's dtype from x_pad [B, T + W - 1, C] (W - 1 zero rows in
    front), ids_pad [B, T + W - 1] (-1 in front), the weights [W, C] and bias [C]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, t_pad, c = x_pad.shape
    width = w_WC.shape[0]
    t = t_pad - (width - 1)
    if not supported(t, c):
        raise ValueError(f"conv_silu_forward: T {t} and channels {c} must be multiples of {ROWS} and {COLUMNS}")
    ops = Ops(interpret)
    f32 = jnp.float32
    # TMA needs each row of a copy's source to start on 16 bytes: the ids' rows padded to 4 words.
    ids_rows = jnp.pad(ids_pad.astype(jnp.int32), ((0, 0), (0, -t_pad % 4)), constant_values=-1)

    def by_row(v):
        return lax.broadcast_in_dim(v, (ROWS, COLUMNS), [0])

    def by_col(v):
        return lax.broadcast_in_dim(v.astype(f32), (ROWS, COLUMNS), [1])

    def kernel(x_g, ids_g, w_g, b_g, out_g, x_s, ids_s, w_s, bias_s, out_s, loaded):
        bi, ti, ci = lax.axis_index("b"), lax.axis_index("t"), lax.axis_index("c")
        t0 = ti * ROWS
        cols = pl.ds(ci * COLUMNS, COLUMNS)
        for offset in range(width):  # window `offset` holds the rows W - 1 - offset positions back
            plgpu.copy_gmem_to_smem(x_g.at[bi, pl.ds(t0 + offset, ROWS), cols], x_s.at[offset], loaded)
            plgpu.copy_gmem_to_smem(ids_g.at[bi, pl.ds(t0 + offset, ROWS)], ids_s.at[offset], loaded)
        plgpu.copy_gmem_to_smem(w_g.at[:, cols], w_s, loaded)
        plgpu.copy_gmem_to_smem(b_g.at[cols], bias_s, loaded)
        plgpu.barrier_wait(loaded)
        ids_now = by_row(ops.load(ids_s.at[width - 1], (), ops.rows))
        pre_RC = by_col(ops.load(bias_s, (), ops.cols))
        for lag in range(width):
            offset = width - 1 - lag
            # Untiled: the WGMMA layout's 2-element reads conflict in shared-memory banks.
            x_RC = ops.load(x_s.at[offset], (), ops.tile, optimized=False).astype(f32)
            keep_RC = by_row(ops.load(ids_s.at[offset], (), ops.rows)) == ids_now
            pre_RC = pre_RC + jnp.where(keep_RC, x_RC, 0.0) * by_col(ops.load(w_s.at[width - 1 - lag], (), ops.cols))
        out_s[...] = (pre_RC * jax.nn.sigmoid(pre_RC)).astype(out_s.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g.at[bi, pl.ds(t0, ROWS), cols])
        plgpu.wait_smem_to_gmem(0)

    # The windows start at any row: TMA copies into tiled (swizzled) shared memory need rows in
    # whole 8-row tiles of the source, so they land untiled.
    scratch = [plgpu.SMEM((width, ROWS, COLUMNS), x_pad.dtype),
               plgpu.SMEM((width, ROWS), jnp.int32),
               plgpu.SMEM((width, COLUMNS), w_WC.dtype),
               plgpu.SMEM((COLUMNS,), b_C.dtype),
               plgpu.SMEM((ROWS, COLUMNS), x_pad.dtype, transforms=tiles(x_pad.dtype)),
               plgpu.Barrier(num_arrivals=2 * width + 2)]
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((b, t, c), x_pad.dtype),
                        grid=(b, t // ROWS, c // COLUMNS), grid_names=("b", "t", "c"), scratch_types=scratch,
                        **launch_params(interpret))(x_pad, ids_rows, w_WC, b_C)


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
    t = t_pad - (width - 1)
    if not supported(t, c):
        raise ValueError(f"preactivation_gradients: T {t} and channels {c} must be multiples of {ROWS} and {COLUMNS}")
    ops = Ops(interpret)
    f32 = jnp.float32
    ids_rows = jnp.pad(ids_pad.astype(jnp.int32), ((0, 0), (0, -t_pad % 4)), constant_values=-1)

    def by_row(v):
        return lax.broadcast_in_dim(v, (ROWS, COLUMNS), [0])

    def by_col(v):
        return lax.broadcast_in_dim(v.astype(f32), (ROWS, COLUMNS), [1])

    def kernel(x_g, ids_g, w_g, b_g, dout_g, dpre_g, db_g, dw_g, x_s, ids_s, w_s, bias_s, dout_s, dpre_s, sums_s,
               loaded):
        bi, ti, ci = lax.axis_index("b"), lax.axis_index("t"), lax.axis_index("c")
        t0 = ti * ROWS
        cols = pl.ds(ci * COLUMNS, COLUMNS)
        for offset in range(width):
            plgpu.copy_gmem_to_smem(x_g.at[bi, pl.ds(t0 + offset, ROWS), cols], x_s.at[offset], loaded)
            plgpu.copy_gmem_to_smem(ids_g.at[bi, pl.ds(t0 + offset, ROWS)], ids_s.at[offset], loaded)
        plgpu.copy_gmem_to_smem(w_g.at[:, cols], w_s, loaded)
        plgpu.copy_gmem_to_smem(b_g.at[cols], bias_s, loaded)
        plgpu.copy_gmem_to_smem(dout_g.at[bi, pl.ds(t0, ROWS), cols], dout_s, loaded)
        plgpu.barrier_wait(loaded)
        ids_now = by_row(ops.load(ids_s.at[width - 1], (), ops.rows))

        def masked_input(lag):
            offset = width - 1 - lag
            x_RC = ops.load(x_s.at[offset], (), ops.tile, optimized=False).astype(f32)
            return jnp.where(by_row(ops.load(ids_s.at[offset], (), ops.rows)) == ids_now, x_RC, 0.0)

        pre_RC = by_col(ops.load(bias_s, (), ops.cols))
        for lag in range(width):
            pre_RC = pre_RC + masked_input(lag) * by_col(ops.load(w_s.at[width - 1 - lag], (), ops.cols))
        sig_RC = jax.nn.sigmoid(pre_RC)
        dpre_RC = ops.load(dout_s, (), ops.tile).astype(f32) * sig_RC * (1.0 + pre_RC * (1.0 - sig_RC))
        dpre_s[...] = dpre_RC.astype(dpre_s.dtype)
        sums_s[0] = jnp.sum(dpre_RC, axis=0)
        for row in range(width):  # weight row W-1-lag multiplies the input lag positions back
            sums_s[1 + row] = jnp.sum(masked_input(width - 1 - row) * dpre_RC, axis=0)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dpre_s, dpre_g.at[bi, pl.ds(t0, ROWS), cols])
        plgpu.copy_smem_to_gmem(sums_s.at[0], db_g.at[bi, ti, cols])
        for row in range(width):
            plgpu.copy_smem_to_gmem(sums_s.at[1 + row], dw_g.at[row, bi, ti, cols])
        plgpu.wait_smem_to_gmem(0)

    dtype = x_pad.dtype
    scratch = [plgpu.SMEM((width, ROWS, COLUMNS), dtype),
               plgpu.SMEM((width, ROWS), jnp.int32),
               plgpu.SMEM((width, COLUMNS), w_WC.dtype),
               plgpu.SMEM((COLUMNS,), b_C.dtype),
               plgpu.SMEM((ROWS, COLUMNS), dout_BTC.dtype, transforms=tiles(dout_BTC.dtype)),
               plgpu.SMEM((ROWS, COLUMNS), dtype, transforms=tiles(dtype)),
               plgpu.SMEM((1 + width, COLUMNS), f32),
               plgpu.Barrier(num_arrivals=2 * width + 3)]
    out_type = [jax.ShapeDtypeStruct((b, t + 8, c), dtype), jax.ShapeDtypeStruct((b, t // ROWS, c), f32),
                jax.ShapeDtypeStruct((width, b, t // ROWS, c), f32)]
    dpre, db_parts, dw_parts = plgpu.kernel(
        kernel, out_type=out_type, grid=(b, t // ROWS, c // COLUMNS), grid_names=("b", "t", "c"),
        scratch_types=scratch, **launch_params(interpret))(x_pad, ids_rows, w_WC, b_C, dout_BTC)
    return dpre, db_parts, list(dw_parts)
