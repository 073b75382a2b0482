"""The SSD's intra-chunk forward (``maxfp4.kernels.ssd.chunk_outputs``) and its input gradients as
Mosaic GPU kernels.

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

The backward is two kernels, as the Triton one. The gradients through dy alone
(``chunk_input_gradients``: dx, the intra-chunk dt gradient and the entry term's) run the same
program shape (``_run_per_head``): S^T is built from C.B^T (formed in XLA, so no register tile
is transposed) and multiplied with dy by a wgmma; dx and d(C_i . entry) go into x's and
C_i . entry's buffers, over the rows just read, which keeps the kernel inside shared memory. The
scores' gradients (``chunk_score_gradients``: d(C.B) summed over a program's heads, the rows
sums behind the cumulative sums' gradient, the D skip's) keep d(C.B) in registers, so there the
two warpgroups split the rows and share each head's buffers. With the recurrence between chunks
(``maxfp4.kernels.state_passing_mosaic``), the whole SSD of a mamba2-1p3b layer takes 2.08 ms
forward and backward against 2.55 on Triton (one H200, 2026-11-29): ``ssd_fused``'s auto takes them.

Shapes they take (``forward_supported``): chunks of 128 and head dim 64 (the [Q, Q] FP32 tile
and two warpgroups' [Q, P] buffers fill the 227 KB of shared memory; with chunks of 64, jax
0.11.2's Mosaic GPU found no register layouts for the [64, 64] tiles), BF16 x and C_i . entry,
FP32 C.B, dt and cumulative sums, and an even number of heads per group. Off a GPU
it runs under Mosaic GPU's interpreter (``interpret``), which stages the scores through shared
memory (its wgmma reads shared memory only): the tests hold it to the Triton kernel there.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maxfp4.kernels import lowering_verdicts
from maxfp4.kernels.epilogue import Quantized
from maxfp4.kernels.launch import on_hopper

ROWS = 64  # rows of one wgmma: the scores are built and multiplied 64 rows at a time
WARPGROUPS = 2  # compute warpgroups a program, taking alternate heads
_MAX_HEADS_PER_PROGRAM = 16  # heads a program walks (16: 162.7 us, 8: 168.6; H200, 2026-11-29)


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
    """A Hopper GPU (sm_90, whose wgmma the kernels use) and Pallas's Mosaic GPU module."""
    try:
        if not on_hopper():
            return False
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except Exception:  # any import or backend failure: the Triton kernels stay
        return False
    return True


def tiles(dtype) -> tuple:
    """The shared-memory layout wgmma and TMA use for a 2D block: 8-row tiles of 128 bytes, swizzled."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(128)


def launch_params(interpret: bool) -> dict:
    """``plgpu.kernel`` arguments: Mosaic GPU's interpreter off a GPU (jax exports its parameters
    only under jax._src for now), else the compiler's with ``approx_math`` (module docstring)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        return {"interpret": InterpretGPUParams()}
    return {"compiler_params": plgpu.CompilerParams(approx_math=True)}


def sigmoid(x: jax.Array, interpret: bool) -> jax.Array:
    """sigmoid(x) in a Mosaic GPU kernel. Compiled: rsqrt(1 + exp(-x))^2, ``rsqrt.approx`` under
    ``approx_math`` (one instruction, 2^-22.9 relative), where Mosaic lowers
    ``1 / (1 + exp(-x))``'s division exactly (``div.rn``, ~10 instructions; Triton's ``/`` is the
    approximate ``div.full``): the elementwise kernels that use it are bound by instructions.
    Squaring after the root keeps the small values (x down to -103) that squaring 1 + exp(-x)
    first would overflow to 0. Under the interpreter, jax's own sigmoid, so the tests there
    compare with the Triton kernels bit for bit."""
    if interpret:
        return jax.nn.sigmoid(x)
    r = lax.rsqrt(1.0 + jnp.exp(-x))
    return r * r


class StridedLoads:
    """Loads of ``shape`` from shared memory in Mosaic GPU's strided register layout, ``vec_size``
    consecutive values a thread (plain reads under the interpreter): the layout of the kernels
    whose work is elementwise, 16-byte vectors without bank conflicts."""

    def __init__(self, shape: tuple[int, ...], interpret: bool, vec_size: int = 8):
        from jax.experimental.pallas import mosaic_gpu as plgpu
        self.ops = Ops(interpret)
        self.interpret = interpret
        self.shape = shape
        self.layout = None if interpret else plgpu.Layout.WG_STRIDED(shape, vec_size=vec_size)

    def load(self, ref) -> jax.Array:
        return self.ops.load(ref, (), self.layout)

    def zeros(self) -> jax.Array:
        """FP32 zeros of ``shape`` in the loads' layout (what a loop carrying loaded values starts
        from: Mosaic GPU's loops keep one layout a carry)."""
        zeros = jnp.zeros(self.shape, jnp.float32)
        return zeros if self.interpret else self.ops.plgpu.layout_cast(zeros, self.layout)


def scale_operand(scale: jax.Array) -> jax.Array:
    """An FP8 scale as a kernel's TMA copy moves it: a multiple of 128 bytes (one per thread of
    the warpgroup), so padded to 32 words."""
    return jnp.pad(jnp.reshape(scale, (1,)).astype(jnp.float32), (0, 31))


def store_maybe_quantized(value: jax.Array, dst, quantized: Quantized | None, scale_s) -> jax.Array | None:
    """Stores FP32 ``value`` in ``dst``'s dtype, or with ``quantized`` as the FP8 recipes store
    it (rounded to the activation dtype, scaled by ``scale_s[0]``, cast). Returns the rounded
    value, whose max |.| the recipes keep (None without ``quantized``)."""
    if quantized is None:
        dst[...] = value.astype(dst.dtype)
        return None
    value = quantized.round(value)
    dst[...] = quantized.cast(value, scale_s[0], dst.dtype)
    return value


def store_keeping_max(value: jax.Array, dst, quantized: Quantized | None, scale_s, amax):
    """``store_maybe_quantized``, and the running elementwise max |value rounded| with ``amax``
    (None without ``quantized``): a kernel reduces it to one number once, at its end."""
    rounded = store_maybe_quantized(value, dst, quantized, scale_s)
    if rounded is None:
        return None
    return jnp.abs(rounded) if amax is None else jnp.maximum(amax, jnp.abs(rounded))


def kernel_on_grid(kernel, out_type, grid: tuple[int, ...], grid_names: tuple[str, ...], scratch: list,
                   interpret: bool):
    """``pl.kernel`` over ``grid``, the scratch buffers allocated around the body as
    ``plgpu.kernel`` does; unlike ``plgpu.kernel`` it takes a mutable ``jax.Ref`` operand, aliased
    to its buffer (what writing into a wider array in place needs)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def body(*refs):
        pl.run_scoped(functools.partial(kernel, *refs), *scratch)
    return pl.kernel(body, out_type=out_type, mesh=plgpu.Mesh(grid=grid, grid_names=grid_names),
                     **launch_params(interpret))


class Ops:
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

    def matmul(self, a_RK: jax.Array, b_ref, staging_ref) -> jax.Array:
        """``a @ b`` in FP32 by a wgmma: ``a`` from registers; under the interpreter, whose wgmma
        reads shared memory only, through ``staging_ref`` (a's shape and dtype)."""
        plgpu = self.plgpu
        if self.interpret:
            staging_ref[...] = a_RK
            plgpu.commit_smem()
            a_RK = staging_ref

        def run(acc_ref):  # acc_ref starts zeroed
            plgpu.wgmma(acc_ref, a_RK, b_ref)
            return acc_ref[...]
        return pl.run_scoped(run, plgpu.ACC((a_RK.shape[0], b_ref.shape[1]), jnp.float32))

    def iota(self, shape, dim):
        if self.interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return self.plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=self.tile)


def _head_outputs(ops: Ops, cb_ref, scores_ref, x_ref, dt_ref, cs_ref, seg_ref, c_entry_ref, d_ref, y_ref):
    """y [Q, P] of one head of the chunk, 64 rows at a time, from its buffers in shared memory."""
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
        y_RP = ops.matmul(scores_RQ, x_ref, scores_ref)
        entry_r = jnp.exp(jnp.where(seg_r == 0, cs_r, -jnp.inf))
        c_entry_RP = ops.load(c_entry_ref, (rows, slice(None)), ops.tile).astype(jnp.float32)
        x_RP = ops.load(x_ref, (rows, slice(None)), ops.tile).astype(jnp.float32)
        y_RP += lax.broadcast_in_dim(entry_r, (ROWS, p), [0]) * c_entry_RP
        y_RP += lax.broadcast_in_dim(d_c, (ROWS, p), [1]) * x_RP  # the D skip
        y_ref[rows, :] = y_RP.astype(y_ref.dtype)


def _head_input_gradients(ops: Ops, cbT_ref, scores_ref, dt_ref, cs_ref, seg_ref, c_entry_ref, d_ref, dy_ref, x_ref,
                          dx_ref, dc_entry_ref, dcs_entry_ref, ddt_ref):
    """The gradients that flow through dy alone, for one head, 64 rows (tokens j) at a time: with
    S^T[j, i] = (C_i . B_j) exp(cs_i - cs_j) on i >= j in one segment (built from C.B^T, so no
    register tile is transposed) and sdy = S^T dy, dx_j = dt_j sdy_j + d dy_j, the intra-chunk dt
    gradient x_j . sdy_j; the entry term's C_i . entry and cumulative-sum gradients (the Triton
    kernel ``_backward_dx_kernel``'s arithmetic)."""
    q, p = dy_ref.shape
    cs_c, seg_c, d_c = ops.load(cs_ref, (), ops.cols), ops.load(seg_ref, (), ops.cols), ops.load(d_ref, (), ops.cols)
    by_row = functools.partial(lax.broadcast_in_dim, shape=(ROWS, q), broadcast_dimensions=[0])
    by_col = functools.partial(lax.broadcast_in_dim, shape=(ROWS, q), broadcast_dimensions=[1])
    rows_p = functools.partial(lax.broadcast_in_dim, shape=(ROWS, p), broadcast_dimensions=[0])
    for r0 in range(0, q, ROWS):
        rows = pl.ds(r0, ROWS)
        cbT_RQ = ops.load(cbT_ref, (rows, slice(None)), ops.tile)
        cs_r, seg_r = ops.load(cs_ref, (rows,), ops.rows), ops.load(seg_ref, (rows,), ops.rows)
        keep = (ops.iota((ROWS, q), 1) >= ops.iota((ROWS, q), 0) + r0) & (by_row(seg_r) == by_col(seg_c))
        sT_RQ = (cbT_RQ * jnp.exp(jnp.where(keep, by_col(cs_c) - by_row(cs_r), -jnp.inf))).astype(dy_ref.dtype)
        sdy_RP = ops.matmul(sT_RQ, dy_ref, scores_ref)
        dy_RP = ops.load(dy_ref, (rows, slice(None)), ops.tile).astype(jnp.float32)
        x_RP = ops.load(x_ref, (rows, slice(None)), ops.tile).astype(jnp.float32)
        dt_r = ops.load(dt_ref, (rows,), ops.rows)
        dx_ref[rows, :] = (rows_p(dt_r) * sdy_RP + lax.broadcast_in_dim(d_c, (ROWS, p), [1]) * dy_RP
                           ).astype(dx_ref.dtype)
        ddt_ref[rows] = jnp.sum(sdy_RP * x_RP, axis=1)
        entry_r = jnp.exp(jnp.where(seg_r == 0, cs_r, -jnp.inf))
        c_entry_RP = ops.load(c_entry_ref, (rows, slice(None)), ops.tile).astype(jnp.float32)
        dcs_entry_ref[rows] = entry_r * jnp.sum(dy_RP * c_entry_RP, axis=1)
        dc_entry_ref[rows, :] = (rows_p(entry_r) * dy_RP).astype(dc_entry_ref.dtype)


class Block(NamedTuple):
    """An operand's block in shared memory: its shape and dtype, and where it lies in the operand's
    global array, ``view(ref, bi, ki, index, tokens)`` (``index``: the head for per-head blocks,
    the program's head block for per-program ones; ``tokens``: the chunk's slice of T)."""
    shape: tuple[int, ...]
    dtype: Any
    view: Callable


def _run_per_head(body: Callable, once: list[tuple[jax.Array, Block]], inputs: list[tuple[jax.Array, Block]],
                  outputs: list[Block | int], out_shapes: list[jax.ShapeDtypeStruct], grid: tuple[int, int, int],
                  heads: int, chunk: int, interpret: bool) -> list[jax.Array]:
    """One program per (batch row, chunk, block of ``heads`` heads): the ``once`` blocks are copied
    into shared memory for the program, then two warpgroups take alternate heads, each with its
    own buffers: the head's ``inputs`` arrive by TMA, ``body(ops, once_refs, input_refs,
    output_refs, scores_ref)`` computes, the ``outputs`` leave by TMA. A warpgroup starts the
    copies of its next head once ``body`` has returned (its inputs have been read), and waits for
    a buffer's previous store before ``body`` writes it again. An output given as the index of an
    input is written into that input's buffer (``body`` writes the rows it has read; shared
    memory holds no separate buffer for it): then the next head's copies wait for its store."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    ops = Ops(interpret)
    steps = heads // WARPGROUPS
    own = [block for block in outputs if not isinstance(block, int)]  # outputs with buffers of their own
    n_once, n_in, n_out = len(once), len(inputs), len(own)
    out_views = [inputs[block][1].view if isinstance(block, int) else block.view for block in outputs]

    def kernel(*refs):
        n_res = len(outputs)
        once_g, in_g, out_g = refs[:n_once], refs[n_once:n_once + n_in], refs[n_once + n_in:n_once + n_in + n_res]
        scratch = refs[n_once + n_in + n_res:]
        once_s, in_s = scratch[:n_once], scratch[n_once:n_once + n_in]
        out_s = scratch[n_once + n_in:n_once + n_in + n_out]
        scores_s, once_bar, loaded = scratch[n_once + n_in + n_out:]
        bi, ki, hi = lax.axis_index("b"), lax.axis_index("k"), lax.axis_index("h")
        w = lax.axis_index("wg")
        tokens = pl.ds(ki * chunk, chunk)

        @pl.when(w == 0)
        def _():
            for ref, buf, (_, block) in zip(once_g, once_s, once):
                plgpu.copy_gmem_to_smem(block.view(ref, bi, ki, hi, tokens), buf, once_bar)

        def fetch(j):  # head j of the program into warpgroup w's buffers
            for ref, buf, (_, block) in zip(in_g, in_s, inputs):
                plgpu.copy_gmem_to_smem(block.view(ref, bi, ki, hi * heads + j, tokens), buf.at[w], loaded.at[w])

        fetch(w)
        plgpu.barrier_wait(once_bar)

        own_s = iter(out_s)
        out_buffers = [in_s[block] if isinstance(block, int) else next(own_s) for block in outputs]
        aliased = len(outputs) > len(own)

        def step(i, carry):
            j = w + WARPGROUPS * i
            plgpu.barrier_wait(loaded.at[w])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the output buffers' previous stores have read them
            body(ops, once_s, [buf.at[w] for buf in in_s], [buf.at[w] for buf in out_buffers], scores_s.at[w])
            if not aliased:
                @pl.when(i + 1 < steps)
                def _():
                    fetch(j + WARPGROUPS)

            plgpu.commit_smem()
            for ref, buf, view in zip(out_g, out_buffers, out_views):
                plgpu.copy_smem_to_gmem(buf.at[w], view(ref, bi, ki, hi * heads + j, tokens))
            if aliased:
                @pl.when(i + 1 < steps)
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the stores have read the input buffers
                    fetch(j + WARPGROUPS)
            return carry

        lax.fori_loop(0, steps, step, 0)
        plgpu.wait_smem_to_gmem(0)

    def smem(block: Block, copies: int | None):
        shape = block.shape if copies is None else (copies, *block.shape)
        return plgpu.SMEM(shape, block.dtype, transforms=tiles(block.dtype) if len(block.shape) == 2 else ())

    n = WARPGROUPS
    # The interpreter's scores: its wgmma reads shared memory only (compiled, a placeholder).
    scores = Block((ROWS, chunk), jnp.bfloat16, None) if interpret else Block((8,), jnp.float32, None)
    scratch = ([smem(block, None) for _, block in once] + [smem(block, n) for _, block in inputs]
               + [smem(block, n) for block in own]
               + [smem(scores, n), plgpu.Barrier(num_arrivals=n_once), plgpu.Barrier(num_arrivals=n_in, num_barriers=n)])
    launch = launch_params(interpret)
    run = plgpu.kernel(kernel, out_type=list(out_shapes), grid=grid, grid_names=("b", "k", "h"), num_threads=n,
                       thread_name="wg", scratch_types=scratch, **launch)
    return run(*[a for a, _ in once], *[a for a, _ in inputs])


def _check(cb, x, dt, cs, operand_BTHP):
    """The shapes and dtypes every kernel here takes; ``operand_BTHP``: C_i . entry, or dy."""
    b, k, g, q, _ = cb.shape
    h, p = operand_BTHP.shape[2:]
    if not forward_supported(q, p, h // g):
        raise ValueError(f"the Mosaic GPU SSD kernels need a chunk of 128, head dim 64 and an even number "
                         f"of heads per group, got {q}, {p}, {h // g}")
    if (x.dtype != jnp.bfloat16 or operand_BTHP.dtype != jnp.bfloat16
            or {cb.dtype, dt.dtype, cs.dtype} != {jnp.dtype(jnp.float32)}):
        raise ValueError(f"the Mosaic GPU SSD kernels need BF16 x and C_i . entry (or dy) and FP32 C.B, dt and "
                         f"cumulative sums, got {x.dtype}, {operand_BTHP.dtype}, {cb.dtype}, {dt.dtype}, {cs.dtype}")
    return b, k, g, q, h, p, heads_per_program(h // g)


def _blocks(q: int, p: int, hb: int, r: int):
    """The blocks the kernels read: C.B of the program's group, segment counts of its chunk, and a
    head's [Q, P] tiles of x-like arrays ([B, T, H, P]) and [Q] rows of dt-like ones ([B, H, T])."""
    group_QQ = Block((q, q), jnp.float32, lambda ref, bi, ki, hi, t: ref.at[bi, ki, hi * hb // r])
    seg_Q = Block((q,), jnp.int32, lambda ref, bi, ki, hi, t: ref.at[bi, t])

    def head_QP(dtype):
        return Block((q, p), dtype, lambda ref, bi, ki, head, t: ref.at[bi, t, head])

    head_Q = Block((q,), jnp.float32, lambda ref, bi, ki, head, t: ref.at[bi, head, t])
    head_P = Block((p,), jnp.float32, lambda ref, bi, ki, head, t: ref.at[head])
    return group_QQ, seg_Q, head_QP, head_Q, head_P


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret"))
def chunk_outputs_forward(cb, x, dt, cs, seg, c_entry, d, out_dtype, interpret: bool = False) -> jax.Array:
    """``maxfp4.kernels.ssd.chunk_outputs``'s value (same arguments and layouts: C.B [B, K, G, Q, Q],
    x [B, T, W, P] with W >= H, dt and cs [B, H, T], segment counts [B, T], C_i . entry [B, T, H, P],
    d [H, P]); y [B, T, H, P] in out_dtype.

    Jitted, so that the layers of a step call one lowered kernel: lowered once a layer, it took
    37 of mamba2-1p3b's 42 s of lowering and gave XLA 48 kernels to build (one H200, 2026-11-29)."""
    b, k, g, q, h, p, hb = _check(cb, x, dt, cs, c_entry)
    group_QQ, seg_Q, head_QP, head_Q, head_P = _blocks(q, p, hb, h // g)

    def body(ops, once, ins, outs, scores):
        (cb_s, seg_s), (x_s, c_entry_s, dt_s, cs_s, d_s), (y_s,) = once, ins, outs
        _head_outputs(ops, cb_s, scores, x_s, dt_s, cs_s, seg_s, c_entry_s, d_s, y_s)

    (y,) = _run_per_head(body, [(cb, group_QQ), (seg, seg_Q)],
                         [(x, head_QP(x.dtype)), (c_entry, head_QP(c_entry.dtype)), (dt, head_Q), (cs, head_Q),
                          (d, head_P)],
                         [head_QP(out_dtype)], [jax.ShapeDtypeStruct(c_entry.shape, out_dtype)], (b, k, h // hb), hb,
                         q, interpret)
    return y


@functools.partial(jax.jit, static_argnames=("interpret",))
def chunk_input_gradients(cb, dt, cs, seg, c_entry, d, dy, x, interpret: bool = False):
    """(dx, d(C_i . entry), the entry term's cumulative-sum gradient, the intra-chunk dt gradient):
    the outputs of ``maxfp4.kernels.ssd``'s ``_backward_dx_kernel``, same arguments and layouts
    (dy [B, T, H, P] BF16); dx in x's dtype, [B, T, H, P]. C.B^T is formed here (an [B, K, G, Q, Q]
    transpose, small beside the [B, T, H, P] operands)."""
    b, k, g, q, h, p, hb = _check(cb, x, dt, cs, c_entry)
    if dy.dtype != jnp.bfloat16:
        raise ValueError(f"the Mosaic GPU SSD kernels need a BF16 dy, got {dy.dtype}")
    group_QQ, seg_Q, head_QP, head_Q, head_P = _blocks(q, p, hb, h // g)

    def body(ops, once, ins, outs, scores):
        (cbT_s, seg_s), (dt_s, cs_s, c_entry_s, d_s, dy_s, x_s), (dx_s, dc_entry_s, dcs_entry_s, ddt_s) = once, ins, outs
        _head_input_gradients(ops, cbT_s, scores, dt_s, cs_s, seg_s, c_entry_s, d_s, dy_s, x_s, dx_s, dc_entry_s,
                              dcs_entry_s, ddt_s)

    per_head_Q = jax.ShapeDtypeStruct(cs.shape, jnp.float32)
    return tuple(_run_per_head(
        body, [(jnp.swapaxes(cb, -1, -2), group_QQ), (seg, seg_Q)],
        [(dt, head_Q), (cs, head_Q), (c_entry, head_QP(c_entry.dtype)), (d, head_P), (dy, head_QP(dy.dtype)),
         (x, head_QP(x.dtype))],
        [5, 2, head_Q, head_Q],  # dx into x's buffer, d(C_i . entry) into C_i . entry's
        [jax.ShapeDtypeStruct(c_entry.shape, x.dtype), jax.ShapeDtypeStruct(c_entry.shape, c_entry.dtype),
         per_head_Q, per_head_Q], (b, k, h // hb), hb, q, interpret))


def _score_gradient_rows(ops: Ops, r0: int, cb_ref, seg_ref, x_ref, dt_ref, cs_ref, dy_ref, g_rows_ref, dd_ref,
                         xT_ref, dcb_RQ):
    """One head's contribution to rows r0..r0+63 of the scores' gradients (the Triton kernel
    ``_backward_scores_kernel``'s arithmetic): with E = (dy x^T) exp(cs_i - cs_j) masked, the row
    sums of E C.B dt_j (``g_rows``), the column sums of dy x over the rows (``dd``, the D skip's),
    and d(C.B) += E dt_j, returned. ``xT_ref``: where the interpreter, whose wgmma reads no
    transposed view, gets x^T (compiled, the wgmma reads x's buffer transposed)."""
    plgpu = ops.plgpu
    q, p = x_ref.shape
    rows = pl.ds(r0, ROWS)
    by_row = functools.partial(lax.broadcast_in_dim, shape=(ROWS, q), broadcast_dimensions=[0])
    by_col = functools.partial(lax.broadcast_in_dim, shape=(ROWS, q), broadcast_dimensions=[1])

    if ops.interpret:
        xT_ref[...] = x_ref[...].T
        plgpu.commit_smem()
        xT = xT_ref
    else:
        xT = x_ref.transpose((1, 0))

    def matmul(acc_ref):  # acc_ref starts zeroed: dy[rows] x^T
        plgpu.wgmma(acc_ref, dy_ref.at[rows], xT)
        return acc_ref[...]

    dscores_RQ = pl.run_scoped(matmul, plgpu.ACC((ROWS, q), jnp.float32))
    cs_r, seg_r = ops.load(cs_ref, (rows,), ops.rows), ops.load(seg_ref, (rows,), ops.rows)
    cs_c, seg_c, dt_c = ops.load(cs_ref, (), ops.cols), ops.load(seg_ref, (), ops.cols), ops.load(dt_ref, (), ops.cols)
    keep = (ops.iota((ROWS, q), 0) + r0 >= ops.iota((ROWS, q), 1)) & (by_row(seg_r) == by_col(seg_c))
    e_RQ = dscores_RQ * jnp.exp(jnp.where(keep, by_row(cs_r) - by_col(cs_c), -jnp.inf))
    cb_RQ = ops.load(cb_ref, (rows, slice(None)), ops.tile)
    g_rows_ref[rows] = jnp.sum(e_RQ * cb_RQ * by_col(dt_c), axis=1)
    dy_RP = ops.load(dy_ref, (rows, slice(None)), ops.tile).astype(jnp.float32)
    x_RP = ops.load(x_ref, (rows, slice(None)), ops.tile).astype(jnp.float32)
    dd_ref[...] = jnp.sum(dy_RP * x_RP, axis=0)
    return dcb_RQ + e_RQ * by_col(dt_c)


@functools.partial(jax.jit, static_argnames=("interpret",))
def chunk_score_gradients(cb, x, dt, cs, seg, dy, interpret: bool = False):
    """(d(C.B) summed over each program's heads [B, K, H / heads, Q, Q], the row sums ``g_rows``
    [B, H, T], the D skip's gradient in parts [B, K, 2, H, P] to sum over their first three axes):
    the Triton ``_backward_scores_kernel``'s outputs, all FP32, from the same arguments.

    Its program holds d(C.B) for the heads it walks, so the two warpgroups split the rows, not the
    heads: warpgroup w keeps rows 64w..64w+63 of it in registers, and both take every head from
    one pair of buffers, which the first warpgroup refills once both have read a head (a barrier
    each warpgroup arrives at). At the end each writes its rows over its rows of the C.B tile in
    shared memory (the only ones it read), and they leave from there."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, k, g, q, h, p, hb = _check(cb, x, dt, cs, dy)
    r = h // g
    f32 = jnp.float32

    def kernel(cb_g, seg_g, x_g, dt_g, cs_g, dy_g, dcb_g, g_rows_g, dd_g, cb_s, seg_s, x_s, dt_s, cs_s, dy_s,
               g_rows_s, dd_s, xT_s, once, loaded, consumed):
        bi, ki, hi = lax.axis_index("b"), lax.axis_index("k"), lax.axis_index("h")
        w = lax.axis_index("wg")
        tokens = pl.ds(ki * q, q)
        ops = Ops(interpret)

        def fetch(j, slot):  # head j of the program into buffer pair `slot`
            head = hi * hb + j
            plgpu.copy_gmem_to_smem(x_g.at[bi, tokens, head], x_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(dy_g.at[bi, tokens, head], dy_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(dt_g.at[bi, head, tokens], dt_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(cs_g.at[bi, head, tokens], cs_s.at[slot], loaded.at[slot])

        @pl.when(w == 0)
        def _():
            plgpu.copy_gmem_to_smem(cb_g.at[bi, ki, hi * hb // r], cb_s, once)
            plgpu.copy_gmem_to_smem(seg_g.at[bi, tokens], seg_s, once)
            for j in range(min(2, hb)):
                fetch(j, j)

        plgpu.barrier_wait(once)

        def rows_of(r0):
            rows = pl.ds(r0, ROWS)

            def step(j, dcb_RQ):
                slot = lax.rem(j, 2)
                head = hi * hb + j
                plgpu.barrier_wait(loaded.at[slot])
                plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # head j - 2's stores have read slot's rows
                dcb_RQ = _score_gradient_rows(ops, r0, cb_s, seg_s, x_s.at[slot], dt_s.at[slot], cs_s.at[slot],
                                              dy_s.at[slot], g_rows_s.at[slot], dd_s.at[slot, r0 // ROWS],
                                              xT_s.at[r0 // ROWS], dcb_RQ)
                plgpu.commit_smem()
                plgpu.barrier_arrive(consumed.at[slot])
                plgpu.copy_smem_to_gmem(g_rows_s.at[slot, rows], g_rows_g.at[bi, head, pl.ds(ki * q + r0, ROWS)])
                plgpu.copy_smem_to_gmem(dd_s.at[slot, r0 // ROWS], dd_g.at[bi, ki, r0 // ROWS, head])
                if r0 == 0:  # the first warpgroup refills the pair once both have read head j
                    @pl.when(j + 2 < hb)
                    def _():
                        plgpu.barrier_wait(consumed.at[slot])
                        fetch(j + 2, slot)
                return dcb_RQ

            zeros = jnp.zeros((ROWS, q), f32)
            dcb_RQ = lax.fori_loop(0, hb, step, zeros if interpret else plgpu.layout_cast(zeros, ops.tile))
            if r0 == 0:  # the reads of the last heads, whose buffers were not refilled
                for j in range(max(0, hb - 2), hb):
                    plgpu.barrier_wait(consumed.at[j % 2])
            cb_s[rows, :] = dcb_RQ  # over the C.B rows this warpgroup alone read
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(cb_s.at[rows], dcb_g.at[bi, ki, hi, rows])
            plgpu.wait_smem_to_gmem(0)

        for wg in range(WARPGROUPS):
            pl.when(w == wg)(functools.partial(rows_of, wg * ROWS))

    scratch = [plgpu.SMEM((q, q), f32, transforms=tiles(f32)), plgpu.SMEM((q,), seg.dtype),
               plgpu.SMEM((2, q, p), x.dtype, transforms=tiles(x.dtype)), plgpu.SMEM((2, q), f32),
               plgpu.SMEM((2, q), f32), plgpu.SMEM((2, q, p), dy.dtype, transforms=tiles(dy.dtype)),
               plgpu.SMEM((2, q), f32), plgpu.SMEM((2, WARPGROUPS, p), f32),
               # the interpreter's x^T (compiled, a placeholder)
               plgpu.SMEM((WARPGROUPS, p, q), x.dtype, transforms=tiles(x.dtype)) if interpret
               else plgpu.SMEM((WARPGROUPS, 8), f32),
               plgpu.Barrier(num_arrivals=2), plgpu.Barrier(num_arrivals=4, num_barriers=2),
               plgpu.Barrier(num_arrivals=WARPGROUPS, num_barriers=2)]
    out_shapes = [jax.ShapeDtypeStruct((b, k, h // hb, q, q), f32), jax.ShapeDtypeStruct(cs.shape, f32),
                  jax.ShapeDtypeStruct((b, k, WARPGROUPS, h, p), f32)]
    launch = launch_params(interpret)
    return tuple(plgpu.kernel(kernel, out_type=out_shapes, grid=(b, k, h // hb), grid_names=("b", "k", "h"),
                              num_threads=WARPGROUPS, thread_name="wg", scratch_types=scratch, **launch)(
        cb, seg, x, dt, cs, dy))


def lowers(kernel: Callable, *operands: jax.Array, **static: Any) -> bool:
    """Whether ``kernel`` (one of this module's) lowers for CUDA with this jax at these operands'
    shapes and dtypes. Mosaic GPU's lowering (register layouts, shared-memory budget) runs in
    Python, and its API moves between jax releases (jax 0.11.2 found no layouts for chunks of 64
    where 0.10.2 did): a jax that rejects a kernel says so here, before the step compiles, and
    ``auto`` keeps the Triton kernel with one warning line instead of failing the run."""
    key = (kernel.__name__, tuple((tuple(a.shape), jnp.dtype(a.dtype).name) for a in operands),
           tuple(sorted(static.items())))
    return _lowers(kernel, key)


@functools.lru_cache(maxsize=64)
def _lowers(kernel: Callable, key) -> bool:
    """The check itself, once a process (and once a cache directory: ``lowering_verdicts``)."""
    name = lowering_verdicts.verdict_name(f"{kernel.__module__}.{kernel.__name__}", key)
    verdict = lowering_verdicts.recalled(name)
    if verdict is None:
        _, operands, static = key
        args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in operands]
        try:
            jax.jit(functools.partial(kernel, **dict(static))).trace(*args).lower(lowering_platforms=("cuda",))
            verdict = {"lowers": True, "why": ""}
        except Exception as exc:  # any lowering failure: the Triton kernel runs instead
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            verdict = {"lowers": False, "why": f"{type(exc).__name__}: {first[:200]}"}
        lowering_verdicts.remember(name, verdict["lowers"], verdict["why"])
    if not verdict["lowers"]:
        logging.getLogger(__name__).warning("the Mosaic GPU kernel %s does not lower with jax %s (%s); "
                                            "the Triton kernel runs instead", kernel.__name__, jax.__version__,
                                            verdict["why"])
    return verdict["lowers"]
