"""The SSD's intra-chunk forward (``maxfp4.kernels.ssd.chunk_outputs``) as a Mosaic GPU kernel.

The same output as the Triton kernel of ``maxfp4.kernels.ssd`` (read its module docstring first):

    y_i = sum_{j<=i, same segment} (C_i . B_j) exp(cs_i - cs_j) dt_j x_j
        + [no segment starts in 0..i] exp(cs_i) c_entry_i  +  d * x_i

Mosaic GPU is the Pallas GPU backend jax supports (the Triton one is deprecated). Its programs are
Hopper warpgroups with explicit shared memory: one program per (batch row, chunk, block of heads)
copies the group's [Q, Q] C.B tile into shared memory once, then two warpgroups take alternate
heads. Each head's x, C_i . entry, dt and cumulative sums arrive by TMA into the warpgroup's own
buffers (the next head's copy starts as soon as the current head's operands have been read);
the [Q, Q] decayed scores are built in registers, 64 rows at a time (one wgmma's M), cast to the
operands' dtype and multiplied with x by a wgmma from registers, and y leaves by TMA.
Two warpgroups, not one: one warpgroup a program left the SM's schedulers idle on the long
elementwise chain (one H200, mamba2-1p3b's shapes: 240.6 us with one, 162.7 with two, against
311.9 for the Triton kernel; 2026-11-29). ``approx_math``: ``exp`` is PTX's ``ex2.approx`` (2 ulp
in FP32), which changed 1 in 25,000 BF16 outputs against the Triton kernel's ``expf`` (each by 1
ulp), as summation order alone did 1 in 33,000.

Shapes it takes (``forward_supported``): chunks of 128 and head dim 64 (the [Q, Q] FP32 tile
and two warpgroups' [Q, P] buffers fill the 227 KB of shared memory; with chunks of 64, jax
0.11.2's Mosaic GPU found no register layouts for the [64, 64] tiles), BF16 x and C_i . entry,
FP32 C.B, dt and cumulative sums, and an even number of heads per group. Off a GPU
it runs under Mosaic GPU's interpreter (``interpret``), which stages the scores through shared
memory (its wgmma reads shared memory only): the tests hold it to the Triton kernel there.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

ROWS = 64  # rows of one wgmma: the scores are built and multiplied 64 rows at a time
WARPGROUPS = 2  # compute warpgroups a program, taking alternate heads
_MAX_HEADS_PER_PROGRAM = 16  # heads a program walks (16: 162.7 us, 8: 168.6; H200, 2026-11-29)
_TMA_ARRIVALS = 5  # copies a head's buffers wait for: x, C_i . entry, dt, cumulative sums, D


def forward_supported(chunk_size: int, head_dim: int, heads_per_group: int) -> bool:
    """Shapes the kernel tiles (see the module docstring)."""
    return chunk_size == 128 and head_dim == 64 and heads_per_group % WARPGROUPS == 0


def heads_per_program(heads_per_group: int) -> int:
    """The largest power of two up to _MAX_HEADS_PER_PROGRAM dividing the heads per group (a
    program's heads share one C.B tile), at least one head a warpgroup."""
    heads = WARPGROUPS
    while heads < _MAX_HEADS_PER_PROGRAM and heads_per_group % (2 * heads) == 0:
        heads *= 2
    return heads


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """A Hopper GPU (sm_90, whose wgmma the kernel uses) and Pallas's Mosaic GPU module."""
    try:
        device = jax.devices()[0]
        if device.platform != "gpu" or getattr(device, "compute_capability", "") != "9.0":
            return False
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception:  # any import or backend failure: the Triton kernel stays
        return False
    return True


class _Ops:
    """Loads and iotas with the register layouts the compiled kernel needs; plain ones under the
    interpreter, which runs neither ``plgpu.load`` nor layout casts."""

    def __init__(self, interpret: bool):
        from jax.experimental.pallas import mosaic_gpu as plgpu
        self.plgpu = plgpu
        self.interpret = interpret
        self.tile = plgpu.Layout.WGMMA  # [64 rows, columns], the wgmma's accumulator layout
        self.rows = self.tile.reduce(1)  # a column vector of it: one value per row
        self.cols = self.tile.reduce(0)  # a row vector of it: one value per column
        # jax 0.11 takes the index on the reference (``ref.at[idx]``) and warns when it is passed
        # to ``load`` as well; jax 0.10 requires the argument.
        load_index = inspect.signature(plgpu.load).parameters.get("idx")
        self.load_takes_index = load_index is not None and load_index.default is inspect.Parameter.empty

    def load(self, ref, idx, layout):
        if self.interpret:
            return ref[idx]
        ref = ref.at[idx] if idx else ref
        if self.load_takes_index:
            return self.plgpu.load(ref, (), layout=layout)
        return self.plgpu.load(ref, layout=layout)

    def iota(self, shape, dim):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return self.plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=self.tile)


def _head_outputs(ops: _Ops, cb_ref, scores_ref, x_ref, dt_ref, cs_ref, seg_ref, c_entry_ref, d_ref, y_ref):
    """y [Q, P] of one head of the chunk, 64 rows at a time, from its buffers in shared memory."""
    plgpu = ops.plgpu
    q, p = x_ref.shape
    cs_c, dt_c = ops.load(cs_ref, (), ops.cols), ops.load(dt_ref, (), ops.cols)
    seg_c, d_c = ops.load(seg_ref, (), ops.cols), ops.load(d_ref, (), ops.cols)
    for r0 in range(0, q, ROWS):
        rows = pl.ds(r0, ROWS)
        cb_RQ = ops.load(cb_ref, (rows, slice(None)), ops.tile)
        cs_r, seg_r = ops.load(cs_ref, (rows,), ops.rows), ops.load(seg_ref, (rows,), ops.rows)
        by_row = functools.partial(lax.broadcast_in_dim, shape=(ROWS, q), broadcast_dimensions=[0])
        by_col = functools.partial(lax.broadcast_in_dim, shape=(ROWS, q), broadcast_dimensions=[1])
        # exp(cs_i - cs_j) on j <= i in one segment, else exactly 0 (the mask inside the exp)
        keep = (ops.iota((ROWS, q), 0) + r0 >= ops.iota((ROWS, q), 1)) & (by_row(seg_r) == by_col(seg_c))
        decay_RQ = jnp.exp(jnp.where(keep, by_row(cs_r) - by_col(cs_c), -jnp.inf))
        scores_RQ = (cb_RQ * decay_RQ * by_col(dt_c)).astype(x_ref.dtype)
        if not ops.interpret:
            a = scores_RQ
        else:
            scores_ref[...] = scores_RQ
            plgpu.commit_smem()
            a = scores_ref

        def matmul(acc_ref, a=a):  # acc_ref starts zeroed
            plgpu.wgmma(acc_ref, a, x_ref)
            return acc_ref[...]

        y_RP = pl.run_scoped(matmul, plgpu.ACC((ROWS, p), jnp.float32))
        entry_r = jnp.exp(jnp.where(seg_r == 0, cs_r, -jnp.inf))
        c_entry_RP = ops.load(c_entry_ref, (rows, slice(None)), ops.tile).astype(jnp.float32)
        x_RP = ops.load(x_ref, (rows, slice(None)), ops.tile).astype(jnp.float32)
        y_RP += lax.broadcast_in_dim(entry_r, (ROWS, p), [0]) * c_entry_RP
        y_RP += lax.broadcast_in_dim(d_c, (ROWS, p), [1]) * x_RP  # the D skip
        y_ref[rows, :] = y_RP.astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def chunk_outputs_forward(cb, x, dt, cs, seg, c_entry, d, out_dtype, interpret: bool = False) -> jax.Array:
    """``maxfp4.kernels.ssd.chunk_outputs``'s value (same arguments and layouts: C.B [B, K, G, Q, Q],
    x [B, T, W, P] with W >= H, dt and cs [B, H, T], segment counts [B, T], C_i . entry [B, T, H, P],
    d [H, P]); y [B, T, H, P] in out_dtype.

    Jitted, so that the layers of a step call one lowered kernel: lowered once a layer, it took
    37 of mamba2-1p3b's 42 s of lowering and gave XLA 48 kernels to build (one H200, 2026-11-29)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, k, g, q, _ = cb.shape
    h, p = c_entry.shape[2:]
    if not forward_supported(q, p, h // g):
        raise ValueError(f"the Mosaic GPU SSD kernel needs a chunk of 128, head dim 64 and an even number "
                         f"of heads per group, got {q}, {p}, {h // g}")
    hb = heads_per_program(h // g)
    steps = hb // WARPGROUPS
    ops = _Ops(interpret)
    if x.dtype != jnp.bfloat16 or c_entry.dtype != jnp.bfloat16 or {cb.dtype, dt.dtype, cs.dtype} != {jnp.dtype(jnp.float32)}:
        raise ValueError(f"the Mosaic GPU SSD kernel needs BF16 x and C . entry and FP32 C.B, dt and cumulative sums, "
                         f"got {x.dtype}, {c_entry.dtype}, {cb.dtype}, {dt.dtype}, {cs.dtype}")

    def tiles(dtype):  # the shared-memory layout wgmma and TMA use: 8-row tiles of 128 bytes, swizzled
        return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128))
    operand = tiles(x.dtype)

    def kernel(cb_g, x_g, dt_g, cs_g, seg_g, c_entry_g, d_g, y_g, cb_s, scores_s, seg_s, x_s, c_entry_s, dt_s,
               cs_s, d_s, y_s, once, loaded):
        bi, ki, hi = lax.axis_index("b"), lax.axis_index("k"), lax.axis_index("h")
        w = lax.axis_index("wg")
        tokens = pl.ds(ki * q, q)

        @pl.when(w == 0)
        def _():
            plgpu.copy_gmem_to_smem(cb_g.at[bi, ki, hi * hb // (h // g)], cb_s, once)
            plgpu.copy_gmem_to_smem(seg_g.at[bi, tokens], seg_s, once)

        def fetch(j):  # head j of the program into warpgroup w's buffers
            head = hi * hb + j
            plgpu.copy_gmem_to_smem(x_g.at[bi, tokens, head], x_s.at[w], loaded.at[w])
            plgpu.copy_gmem_to_smem(c_entry_g.at[bi, tokens, head], c_entry_s.at[w], loaded.at[w])
            plgpu.copy_gmem_to_smem(dt_g.at[bi, head, tokens], dt_s.at[w], loaded.at[w])
            plgpu.copy_gmem_to_smem(cs_g.at[bi, head, tokens], cs_s.at[w], loaded.at[w])
            plgpu.copy_gmem_to_smem(d_g.at[head], d_s.at[w], loaded.at[w])

        fetch(w)
        plgpu.barrier_wait(once)

        def step(i, carry):
            j = w + WARPGROUPS * i
            plgpu.barrier_wait(loaded.at[w])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # y_s[w]'s previous store has read it
            _head_outputs(ops, cb_s, scores_s.at[w], x_s.at[w], dt_s.at[w], cs_s.at[w], seg_s, c_entry_s.at[w],
                          d_s.at[w], y_s.at[w])

            @pl.when(i + 1 < steps)
            def _():
                fetch(j + WARPGROUPS)  # the operands of head j have been read

            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(y_s.at[w], y_g.at[bi, tokens, hi * hb + j])
            return carry

        lax.fori_loop(0, steps, step, 0)
        plgpu.wait_smem_to_gmem(0)

    n = WARPGROUPS
    scratch = [plgpu.SMEM((q, q), cb.dtype, transforms=tiles(cb.dtype)),
               plgpu.SMEM((n, ROWS, q), x.dtype, transforms=operand),  # the interpreter's scores
               plgpu.SMEM((q,), seg.dtype),
               plgpu.SMEM((n, q, p), x.dtype, transforms=operand),
               plgpu.SMEM((n, q, p), c_entry.dtype, transforms=operand),
               plgpu.SMEM((n, q), dt.dtype), plgpu.SMEM((n, q), cs.dtype), plgpu.SMEM((n, p), d.dtype),
               plgpu.SMEM((n, q, p), out_dtype, transforms=tiles(out_dtype)),
               plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=_TMA_ARRIVALS, num_barriers=n)]
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        launch = {"interpret": InterpretGPUParams()}
    else:
        launch = {"compiler_params": plgpu.CompilerParams(approx_math=True)}
    return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct(c_entry.shape, out_dtype), grid=(b, k, h // hb),
                        grid_names=("b", "k", "h"), num_threads=n, thread_name="wg", scratch_types=scratch,
                        **launch)(cb, x, dt, cs, seg, c_entry, d)
