"""The SSD's recurrence between chunks (``maxfp4.kernels.state_passing``, read it first) as Mosaic
GPU kernels, forward and backward: the same arithmetic in the same order.

One program per (batch row, group and state index n, block of 64 heads) walks the K chunks with
its [64, P] slice of the state in registers, as the Triton kernel does. Each chunk's slice
arrives by TMA into one of two buffers (the next chunk's copy starts before the current one is
used) and each result leaves by TMA from one of two, so the walk waits on memory only where a
copy is late. Forward: one read of the states, one write of the entries; backward: reads of
the entries and their gradient, writes of the states' gradient and of the decays' gradient per
n (summed over N by XLA).

Shapes they take (``supported``): 64-head blocks (heads per group a multiple of 64) and head
dim 64. Off a GPU they run under Mosaic GPU's interpreter. ``maxfp4.kernels.ssd.ssd_fused``
takes them with the SSD's Mosaic backward (``model.mamba.kernel_backend: auto``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maxfp4.kernels.ssd_mosaic import ROWS, Ops, launch_params, tiles


def supported(heads_per_group: int, head_dim: int) -> bool:
    """64-head blocks (a wgmma tile's rows) and head dim 64."""
    return heads_per_group % ROWS == 0 and head_dim == 64


def _launch(kernel, out_shapes, grid, scratch, interpret, *operands):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.kernel(kernel, out_type=list(out_shapes), grid=grid, grid_names=("b", "gn", "r"),
                        scratch_types=scratch, **launch_params(interpret))(*operands)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def entry_states_forward(states, decay, out_dtype, interpret: bool = False) -> jax.Array:
    """``state_passing.entry_states_forward``: the entries [B, Kp, G, N, R, P] in out_dtype from
    the K-padded states (FP32) and decays [B, Kp, G, R]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, kp, g, n, r, p = states.shape
    ops = Ops(interpret)

    def kernel(states_g, decay_g, entry_g, states_s, decay_s, entry_s, loaded):
        bi, gn, ri = lax.axis_index("b"), lax.axis_index("gn"), lax.axis_index("r")
        gi, ni = gn // n, lax.rem(gn, n)
        heads = pl.ds(ri * ROWS, ROWS)

        def fetch(z, slot):
            plgpu.copy_gmem_to_smem(states_g.at[bi, z, gi, ni, heads], states_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(decay_g.at[bi, z, gi, heads], decay_s.at[slot], loaded.at[slot])

        fetch(0, 0)

        def step(z, end_RP):
            slot = lax.rem(z, 2)

            @pl.when(z + 1 < kp)
            def _():
                fetch(z + 1, 1 - slot)

            plgpu.wait_smem_to_gmem(1, wait_read_only=True)  # entry_s[slot]'s store of chunk z - 2 has read it
            entry_s[slot] = end_RP.astype(entry_s.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(entry_s.at[slot], entry_g.at[bi, z, gi, ni, heads])
            plgpu.barrier_wait(loaded.at[slot])
            decay_R = ops.load(decay_s.at[slot], (), ops.rows)
            return (ops.load(states_s.at[slot], (), ops.tile)
                    + lax.broadcast_in_dim(decay_R, (ROWS, p), [0]) * end_RP)

        zeros = jnp.zeros((ROWS, p), states.dtype)
        lax.fori_loop(0, kp, step, zeros if interpret else plgpu.layout_cast(zeros, ops.tile))
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((2, ROWS, p), states.dtype, transforms=tiles(states.dtype)),
               plgpu.SMEM((2, ROWS), decay.dtype),
               plgpu.SMEM((2, ROWS, p), out_dtype, transforms=tiles(out_dtype)),
               plgpu.Barrier(num_arrivals=2, num_barriers=2)]
    (entry,) = _launch(kernel, [jax.ShapeDtypeStruct(states.shape, out_dtype)], (b, g * n, r // ROWS), scratch,
                       interpret, states, decay)
    return entry


@functools.partial(jax.jit, static_argnames=("dstates_dtype", "interpret"))
def entry_states_backward(decay, entry, dentry, dstates_dtype, interpret: bool = False):
    """``state_passing.entry_states_backward``: (the states' gradient in dstates_dtype, the decays'
    gradient [B, Kp, G, R]) from the K-padded decays, entries and the entries' gradient."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, kp, g, n, r, p = entry.shape
    ops = Ops(interpret)
    f32 = decay.dtype

    def kernel(decay_g, entry_g, dentry_g, dstates_g, ddecay_g, decay_s, entry_s, dentry_s, dstates_s, ddecay_s,
               loaded):
        bi, gn, ri = lax.axis_index("b"), lax.axis_index("gn"), lax.axis_index("r")
        gi, ni = gn // n, lax.rem(gn, n)
        heads = pl.ds(ri * ROWS, ROWS)

        def fetch(z, slot):
            plgpu.copy_gmem_to_smem(decay_g.at[bi, z, gi, heads], decay_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(entry_g.at[bi, z, gi, ni, heads], entry_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(dentry_g.at[bi, z, gi, ni, heads], dentry_s.at[slot], loaded.at[slot])

        fetch(kp - 1, 0)

        def step(i, dend_RP):  # chunk z = kp - 1 - i, from the last back
            z = kp - 1 - i
            slot = lax.rem(i, 2)

            @pl.when(i + 1 < kp)
            def _():
                fetch(z - 1, 1 - slot)

            plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # chunk z + 2's two stores have read slot's buffers
            dstates_s[slot] = dend_RP.astype(dstates_s.dtype)
            plgpu.barrier_wait(loaded.at[slot])
            entry_RP = ops.load(entry_s.at[slot], (), ops.tile).astype(f32)
            ddecay_s[slot] = jnp.sum(dend_RP * entry_RP, axis=1)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(dstates_s.at[slot], dstates_g.at[bi, z, gi, ni, heads])
            plgpu.copy_smem_to_gmem(ddecay_s.at[slot], ddecay_g.at[bi, z, gi, ni, heads])
            decay_R = ops.load(decay_s.at[slot], (), ops.rows)
            return (ops.load(dentry_s.at[slot], (), ops.tile).astype(f32)
                    + lax.broadcast_in_dim(decay_R, (ROWS, p), [0]) * dend_RP)

        zeros = jnp.zeros((ROWS, p), f32)  # d end[K-1]: the last end is unused
        lax.fori_loop(0, kp, step, zeros if interpret else plgpu.layout_cast(zeros, ops.tile))
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((2, ROWS), f32),
               plgpu.SMEM((2, ROWS, p), entry.dtype, transforms=tiles(entry.dtype)),
               plgpu.SMEM((2, ROWS, p), dentry.dtype, transforms=tiles(dentry.dtype)),
               plgpu.SMEM((2, ROWS, p), dstates_dtype, transforms=tiles(dstates_dtype)),
               plgpu.SMEM((2, ROWS), f32),
               plgpu.Barrier(num_arrivals=3, num_barriers=2)]
    dstates, ddecay_partial = _launch(
        kernel, [jax.ShapeDtypeStruct(entry.shape, dstates_dtype), jax.ShapeDtypeStruct((b, kp, g, n, r), f32)],
        (b, g * n, r // ROWS), scratch, interpret, decay, entry, dentry)
    return dstates, ddecay_partial.sum(axis=3)
