"""Mamba-2's causal depthwise convolution + SiLU as Mosaic GPU kernels: the forward and the
backward's two (the pre-activation's gradient with the weights' and bias's partial sums; the
input gradient, alone, into a wider array or stored as FP8), the values of the Triton kernels
of ``maxfp4.kernels.conv`` (read its module docstring first), with the same segment ids (-1 in
front), but x read in place: the columns of the in_proj output it is, with no padded copy (a
copy XLA took 86 us a layer to make on an H200, and 6 GiB of residuals in mamba2-1p3b).

One program per (batch row, 32 rows of T, 128 channels). Its rows and the 8 before them arrive
by two TMA copies into untiled shared memory (zeros instead of the 8 before the sequence). The
work goes 8 rows at a time in Mosaic GPU's strided register layout, where an [8, 128] block is
one 16-byte vector a thread: every window (the block's rows ``lag`` positions back) is a vector
load at a row offset, with no shared-memory bank conflicts. The layout has no broadcasts, so
what is per column (weights, bias) comes as [8, C] rows repeated by XLA before the launch, and
what is per row, whether window k's row is in the row's document, as one bit a window in an
int8 [B, T, 128] array (``_window_masks``), both tiny beside x. The kernels are bound by
instructions, not memory, so a program whose windows all lie in their rows' documents (a flag a
program, made with the masks) runs a copy of its code without the masking. The pre-activation
is summed in FP32 in the Triton kernel's order (bias, then lags 0 .. W-1), SiLU applied, and the
block stored. The backward's
first kernel recomputes it, forms the pre-activation's gradient, and sums it (and the masked
windows times it, one sum per weight row) over the program's rows into one partial sum a
column that XLA adds up; the second reads W windows of that gradient, forward in T, and writes dx
straight into in_proj's gradient: the wider array goes in as a mutable ``jax.Ref``, which the
launch aliases to its buffer. ``approx_math``: the sigmoid is ``ssd_mosaic.sigmoid``
(``ex2.approx`` for its exp, an approximate ``rsqrt`` for its division).

Shapes it takes (``supported``): T a multiple of 32 and the channels of 128. Off a GPU they run
under Mosaic GPU's interpreter, where the tests hold them to the Triton kernels' values; on an
H200 the tests do too (tests/test_gpu_mamba_kernels.py). Measured there (docs/PERFORMANCE.md,
"Kernels on Mosaic GPU"): the forward 107 us a mamba2-1p3b layer against Triton's 116 and its
86 us padded copy, the backward 359 us against 442; both backends are bound by instructions
rather than memory. ``model.mamba.kernel_backend=auto`` takes them on Hopper.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maxfp4.kernels.epilogue import Quantized
from maxfp4.kernels.ssd_mosaic import (StridedLoads, kernel_on_grid, lowers, scale_operand, sigmoid,
                                      store_keeping_max)

COLUMNS = 128  # channels a program: an [8, 128] block of BF16 is one 16-byte vector a thread
SPAN = 32  # rows of T a program (measured on an H200: 112 us for the forward, 117 with 64 rows)
SUB = 8  # rows a block: the strided layout's [8, 128] shape
_MAX_WIDTH = 7  # window bits in an int8
_GRID = ("b", "t", "c")  # a program: batch row, SPAN rows, 128 channels


def supported(t: int, channels: int) -> bool:
    return t % SPAN == 0 and channels % COLUMNS == 0


def _checked_source(name: str, x_src, ids_pad, width: int, c: int, column_offset: int) -> int:
    """T of a source x [B, T, >= column_offset + C] read in place, if the kernels tile it."""
    t = x_src.shape[1]
    if ids_pad.shape[1] != t + width - 1:
        raise ValueError(f"{name}: segment ids of {ids_pad.shape[1]} positions for T {t} (want T + {width - 1})")
    if column_offset % 8 or column_offset + c > x_src.shape[2]:
        raise ValueError(f"{name}: columns [{column_offset}, {column_offset + c}) of a {x_src.shape[2]}-wide x "
                         "(the offset a multiple of 8, for TMA's 16-byte starts)")
    return _checked_length(name, t + width - 1, width, c)


def _checked_length(name: str, t_pad: int, width: int, c: int) -> int:
    """T from a padded length, if the kernels tile it and the channels."""
    t = t_pad - (width - 1)
    if not supported(t, c):
        raise ValueError(f"{name}: T {t} and channels {c} must be multiples of {SPAN} and {COLUMNS}")
    if width > _MAX_WIDTH:
        raise ValueError(f"{name}: a {width}-tap kernel has more windows than the int8 masks hold ({_MAX_WIDTH})")
    return t


def _window_masks(ids_pad: jax.Array, width: int, own: int) -> tuple[jax.Array, jax.Array]:
    """(int8 [B, T, 128] whose bit k says whether window k's row (padded row s + k) is in row s's
    document (the one at padded row s + ``own``): the Triton kernels' test of segment ids, made
    once here and repeated across a block's 128 columns (the strided layout cannot broadcast a
    row's value); int32 [B, T/32, 32], word 0 nonzero where a program's rows have a window in
    another document). The kernels are bound by instructions: a program whose windows all lie in
    its rows' documents (most, in packed pretraining data) skips the masking, with the same sums."""
    ids = ids_pad.astype(jnp.int32)
    b, t = ids.shape[0], ids.shape[1] - (width - 1)
    now = ids[:, own:own + t]
    bits = sum((ids[:, k:k + t] == now).astype(jnp.int32) << k for k in range(width))
    crossing = jnp.any(bits.reshape(b, t // SPAN, SPAN) != (1 << width) - 1, axis=2).astype(jnp.int32)
    # A TMA copy moves a multiple of 128 bytes: the flag padded to 32 words.
    flags = jnp.pad(crossing[:, :, None], ((0, 0), (0, 0), (0, 31)))
    return jnp.broadcast_to(bits.astype(jnp.int8)[:, :, None], (b, t, COLUMNS)), flags


def _rows_of(v_XC: jax.Array) -> jax.Array:
    """[..., C] in FP32 repeated as [..., 8, C]: a block's worth of each column's value."""
    v = v_XC.astype(jnp.float32)
    return jnp.broadcast_to(v[..., None, :], (*v.shape[:-1], SUB, v.shape[-1]))


class _Blocks(StridedLoads):
    """Loads of [8, 128] blocks, and of [128] rows one value a thread (``load_column``)."""

    def __init__(self, interpret: bool):
        super().__init__((SUB, COLUMNS), interpret)
        self.columns = StridedLoads((COLUMNS,), interpret, vec_size=1)

    def load_column(self, ref) -> jax.Array:
        return self.columns.load(ref)


def _columns(offset: int = 0):
    """This program's 128 channels, as columns of an array whose channels start at ``offset``."""
    return pl.ds(offset + lax.axis_index("c") * COLUMNS, COLUMNS)


def _program():
    """(batch row, first row, the channels' slice) of this program."""
    bi, ti = lax.axis_index("b"), lax.axis_index("t")
    return bi, ti, ti * SPAN, _columns()


_BEHIND = 8  # rows fetched before a program's own for the windows back (W - 1 of them used)


def _fetch_masks_and_weights(plgpu, masks_g, flags_g, w_g, program, masks_s, flag_s, w_s, loaded) -> None:
    """The program's window masks and flag (``_window_masks``) and the weights' rows repeated
    [W, 8, 128], by TMA: three copies."""
    bi, ti, t0, cols = program
    plgpu.copy_gmem_to_smem(masks_g.at[bi, pl.ds(t0, SPAN)], masks_s, loaded)
    plgpu.copy_gmem_to_smem(flags_g.at[bi, ti], flag_s, loaded)
    plgpu.copy_gmem_to_smem(w_g.at[:, :, cols], w_s, loaded)


def _fetch_behind(plgpu, x_g, program, x_cols, x_s, loaded) -> None:
    """x's rows t0 - 8 .. t0 + 31 (its columns ``x_cols``) into rows 0 .. 39 of ``x_s``, read in
    place from x (the in_proj output; no padded copy): two copies. The first program of a batch
    row fetches rows 0 .. 7 there, which ``_zero_front`` then overwrites with the zeros before the
    sequence."""
    bi, ti, t0, _ = program
    plgpu.copy_gmem_to_smem(x_g.at[bi, pl.ds(jnp.maximum(t0 - _BEHIND, 0), _BEHIND), x_cols],
                            x_s.at[pl.ds(0, _BEHIND)], loaded)
    plgpu.copy_gmem_to_smem(x_g.at[bi, pl.ds(t0, SPAN), x_cols], x_s.at[pl.ds(_BEHIND, SPAN)], loaded)


def _fetch_pre_activation_operands(plgpu, blocks: _Blocks, program, refs_g, refs_s, loaded, width: int,
                                   column_offset: int):
    """What the pre-activation reads, by six TMA copies to ``loaded``, waited for: x's rows with
    the 8 before them (zeros before the sequence), the masks and flag, the weights' and bias's
    rows; returns the weights' blocks (by row k) and the bias's. ``refs_g`` and ``refs_s``: (x,
    masks, flags, weights, bias) in global and shared memory. A kernel issues its own copies to
    ``loaded`` before it."""
    x_g, masks_g, flags_g, w_g, b_g = refs_g
    x_s, masks_s, flag_s, w_s, bias_s = refs_s
    _fetch_behind(plgpu, x_g, program, _columns(column_offset), x_s, loaded)
    _fetch_masks_and_weights(plgpu, masks_g, flags_g, w_g, program, masks_s, flag_s, w_s, loaded)
    plgpu.copy_gmem_to_smem(b_g.at[:, program[3]], bias_s, loaded)
    plgpu.barrier_wait(loaded)
    _zero_front(x_s, program[1])
    return [blocks.load(w_s.at[k]) for k in range(width)], blocks.load(bias_s)


_PRE_ACTIVATION_COPIES = 6  # _fetch_pre_activation_operands'


def _zero_front(x_s, ti) -> None:
    """The rows before the sequence are zeros (the first program of each batch row): stored,
    then a warpgroup barrier (``commit_smem``) before any thread reads them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    @pl.when(ti == 0)
    def _():
        x_s[pl.ds(0, _BEHIND)] = jnp.zeros((_BEHIND, COLUMNS), x_s.dtype)
        plgpu.commit_smem()


def _masked_or_not(flag_s, compute) -> None:
    """``compute(masked)``, its code twice: with the window masks where the program's flag says a
    window crosses into another document, without them (the same values) where none does."""
    crossing = flag_s[0]

    @pl.when(crossing != 0)
    def _():
        compute(True)

    @pl.when(crossing == 0)
    def _():
        compute(False)


def _masked_window(blocks: _Blocks, src_s, row: int, k: int, masks: jax.Array | None) -> jax.Array:
    """Window k of a block (``src_s``'s rows ``row`` ..) in FP32, zero in rows of another
    document (``masks`` None: every row is in its own)."""
    v = blocks.load(src_s.at[pl.ds(row, SUB)]).astype(jnp.float32)
    return v if masks is None else jnp.where((masks & (1 << k)) != 0, v, 0.0)


def _block_masks(blocks: _Blocks, masks_s, r: int, masked: bool) -> jax.Array | None:
    return blocks.load(masks_s.at[pl.ds(r, SUB)]).astype(jnp.int32) if masked else None


def _pre_activation(blocks: _Blocks, x_s, masks_s, r: int, w: list, bias: jax.Array, width: int, masked: bool):
    """(conv + b of the block at row r in FP32, bias first then lags 0 .. W-1 as the Triton kernel
    sums, and the masked windows by k)."""
    masks = _block_masks(blocks, masks_s, r, masked)
    # window k: the rows W - 1 - k before the block's, in x_s (``_fetch_behind``)
    windows = [_masked_window(blocks, x_s, _BEHIND - (width - 1) + r + k, k, masks) for k in range(width)]
    pre = bias
    for lag in range(width):
        pre = pre + windows[width - 1 - lag] * w[width - 1 - lag]
    return pre, windows


def _scratch(plgpu, source_rows: int, x_dtype, width: int) -> list:
    """Buffers of the windows' source, its masks and flag, and the weights' rows."""
    return [plgpu.SMEM((source_rows, COLUMNS), x_dtype), plgpu.SMEM((SPAN, COLUMNS), jnp.int8),
            plgpu.SMEM((32,), jnp.int32), plgpu.SMEM((width, SUB, COLUMNS), jnp.float32)]


@functools.partial(jax.jit, static_argnames=("interpret", "column_offset"))
def conv_silu_forward(x_src: jax.Array, ids_pad: jax.Array, w_WC: jax.Array, b_C: jax.Array,
                      interpret: bool = False, column_offset: int = 0) -> jax.Array:
    """silu(causal conv + b) [B, T, C] in x's dtype, x being columns [column_offset,
    column_offset + C) of ``x_src`` [B, T, I] (read in place: the in_proj output), from ids_pad
    [B, T + W - 1] (-1 in front), the weights [W, C] and bias [C]."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, c = x_src.shape[0], w_WC.shape[1]
    width = w_WC.shape[0]
    t = _checked_source("conv_silu_forward", x_src, ids_pad, width, c, column_offset)
    blocks = _Blocks(interpret)

    def kernel(x_g, masks_g, flags_g, w_g, b_g, out_g, x_s, masks_s, flag_s, w_s, bias_s, out_s, loaded):
        program = bi, _, t0, cols = _program()
        w, bias = _fetch_pre_activation_operands(plgpu, blocks, program, (x_g, masks_g, flags_g, w_g, b_g),
                                                 (x_s, masks_s, flag_s, w_s, bias_s), loaded, width, column_offset)

        def compute(masked: bool):
            for r in range(0, SPAN, SUB):
                pre, _ = _pre_activation(blocks, x_s, masks_s, r, w, bias, width, masked)
                out_s[pl.ds(r, SUB)] = (pre * sigmoid(pre, interpret)).astype(out_s.dtype)
        _masked_or_not(flag_s, compute)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g.at[bi, pl.ds(t0, SPAN), cols])
        plgpu.wait_smem_to_gmem(0)

    scratch = [*_scratch(plgpu, _BEHIND + SPAN, x_src.dtype, width), plgpu.SMEM((SUB, COLUMNS), jnp.float32),
               plgpu.SMEM((SPAN, COLUMNS), x_src.dtype), plgpu.Barrier(num_arrivals=_PRE_ACTIVATION_COPIES)]
    return kernel_on_grid(kernel, jax.ShapeDtypeStruct((b, t, c), x_src.dtype), (b, t // SPAN, c // COLUMNS), _GRID,
                          scratch, interpret)(x_src, *_window_masks(ids_pad, width, width - 1), _rows_of(w_WC),
                                              _rows_of(b_C))


@functools.partial(jax.jit, static_argnames=("interpret", "column_offset"))
def preactivation_gradients(x_src: jax.Array, ids_pad: jax.Array, w_WC: jax.Array, b_C: jax.Array,
                            dout_BTC: jax.Array, interpret: bool = False, column_offset: int = 0):
    """The backward's first kernel (``conv._preactivation_grad_kernel``): the pre-activation's
    gradient in x's dtype, as rows 0..T-1 of a [B, T + 8, C] buffer (the input gradient's kernel
    reads W - 1 rows past T there, masked), and the FP32 partial sums of the bias's gradient
    [B, T/32, C] and of each weight row's (W of them), one row a program: its rows summed 8
    apart in registers, then those 8 sums by column through shared memory. x as
    ``conv_silu_forward`` reads it."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, c = x_src.shape[0], w_WC.shape[1]
    width = w_WC.shape[0]
    t = _checked_source("preactivation_gradients", x_src, ids_pad, width, c, column_offset)
    blocks = _Blocks(interpret)
    f32 = jnp.float32

    def kernel(x_g, masks_g, flags_g, w_g, b_g, dout_g, dpre_g, sums_g, x_s, masks_s, flag_s, w_s, bias_s, dout_s,
               dpre_s, sums_s, totals_s, loaded):
        program = bi, ti, t0, cols = _program()
        plgpu.copy_gmem_to_smem(dout_g.at[bi, pl.ds(t0, SPAN), cols], dout_s, loaded)
        w, bias = _fetch_pre_activation_operands(plgpu, blocks, program, (x_g, masks_g, flags_g, w_g, b_g),
                                                 (x_s, masks_s, flag_s, w_s, bias_s), loaded, width, column_offset)

        def compute(masked: bool):
            sums = None  # [dpre, then window k times dpre for each weight row k], summed over blocks
            for r in range(0, SPAN, SUB):
                pre, windows = _pre_activation(blocks, x_s, masks_s, r, w, bias, width, masked)
                sig = sigmoid(pre, interpret)
                dpre = blocks.load(dout_s.at[pl.ds(r, SUB)]).astype(f32) * sig * (1.0 + pre * (1.0 - sig))
                dpre_s[pl.ds(r, SUB)] = dpre.astype(dpre_s.dtype)
                terms = [dpre] + [window * dpre for window in windows]
                sums = terms if sums is None else [a + v for a, v in zip(sums, terms)]
            for i, total in enumerate(sums):
                sums_s[i] = total
        _masked_or_not(flag_s, compute)
        plgpu.commit_smem()  # (a warpgroup barrier: each column's 8 sums were stored by 8 threads)
        plgpu.copy_smem_to_gmem(dpre_s, dpre_g.at[bi, pl.ds(t0, SPAN), cols])
        for i in range(1 + width):
            total = blocks.load_column(sums_s.at[i, 0])
            for row in range(1, SUB):
                total = total + blocks.load_column(sums_s.at[i, row])
            totals_s[i] = total
        plgpu.commit_smem()
        for i in range(1 + width):
            plgpu.copy_smem_to_gmem(totals_s.at[i], sums_g.at[i, bi, ti, cols])
        plgpu.wait_smem_to_gmem(0)

    dtype = x_src.dtype
    scratch = [*_scratch(plgpu, _BEHIND + SPAN, dtype, width), plgpu.SMEM((SUB, COLUMNS), f32),
               plgpu.SMEM((SPAN, COLUMNS), dout_BTC.dtype), plgpu.SMEM((SPAN, COLUMNS), dtype),
               plgpu.SMEM((1 + width, SUB, COLUMNS), f32), plgpu.SMEM((1 + width, COLUMNS), f32),
               plgpu.Barrier(num_arrivals=_PRE_ACTIVATION_COPIES + 1)]
    out_type = [jax.ShapeDtypeStruct((b, t + 8, c), dtype), jax.ShapeDtypeStruct((1 + width, b, t // SPAN, c), f32)]
    dpre, sums = kernel_on_grid(kernel, out_type, (b, t // SPAN, c // COLUMNS), _GRID, scratch, interpret)(
        x_src, *_window_masks(ids_pad, width, width - 1), _rows_of(w_WC), _rows_of(b_C), dout_BTC)
    return dpre, sums[0], list(sums[1:])


def input_gradient(dpre_pad: jax.Array, ids_back: jax.Array, w_WC: jax.Array, interpret: bool = False,
                   into_BTI: jax.Array | None = None, column_offset: int = 0,
                   quantize: tuple[jax.Array, Any] | None = None):
    """The backward's second kernel (``conv._input_grad``): dx[s] = sum over lag of
    dpre[s + lag] w[W-1-lag] where s + lag is in s's document, from ``preactivation_gradients``'s
    buffer (at least T + W - 1 rows) and the segment ids padded with W - 1 rows of -1 at the end
    ([B, T + W - 1]).

    Returns dx [B, T, C] in dpre's dtype; with ``into_BTI`` ([B, T, I]) dx written into its
    columns [column_offset, column_offset + C) (a multiple of 128) and the whole array returned
    (the kernel writes that array's buffer: XLA copies it first only where the array is still
    read after); with ``quantize`` = (scale, FP8 dtype), into an FP8 ``into_BTI``, stored as
    ``epilogue.Quantized`` does, and (dx, max |dx rounded|) returned. Jitted (as the other two
    kernels are), so a model's layers share one lowering of it."""
    scale, fp8_dtype = (None, None) if quantize is None else quantize
    return _input_gradient(dpre_pad, ids_back, w_WC, into_BTI, scale, interpret=interpret,
                           column_offset=column_offset, fp8_dtype=fp8_dtype)


@functools.partial(jax.jit, static_argnames=("interpret", "column_offset", "fp8_dtype"))
def _input_gradient(dpre_pad, ids_back, w_WC, into_BTI, scale, *, interpret: bool, column_offset: int, fp8_dtype):
    quantize = None if fp8_dtype is None else (scale, fp8_dtype)
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, t_pad, c = ids_back.shape[0], ids_back.shape[1], w_WC.shape[1]
    width = w_WC.shape[0]
    t = _checked_length("input_gradient", t_pad, width, c)
    if quantize is not None and into_BTI is None:
        raise ValueError("input_gradient: quantize needs into_BTI")
    if column_offset % COLUMNS:
        raise ValueError(f"input_gradient: column offset {column_offset} is not a multiple of {COLUMNS}")
    blocks = _Blocks(interpret)
    f32 = jnp.float32
    out_dtype = dpre_pad.dtype if into_BTI is None else into_BTI.dtype
    quantized = None if quantize is None else Quantized(dpre_pad.dtype)

    def kernel(d_g, masks_g, flags_g, w_g, *refs):
        refs = list(refs)
        scale_g = refs.pop(0) if quantize is not None else None
        out_g = refs.pop(0)
        amax_g = refs.pop(0) if quantize is not None else None
        d_s, masks_s, flag_s, w_s, *refs = refs
        scale_s = refs.pop(0) if quantize is not None else None
        out_s = refs.pop(0)
        amax_s = refs.pop(0) if quantize is not None else None
        loaded, = refs
        program = bi, ti, t0, cols = _program()
        # window lag: the rows lag ahead
        plgpu.copy_gmem_to_smem(d_g.at[bi, pl.ds(t0, SPAN + width - 1), cols], d_s, loaded)
        _fetch_masks_and_weights(plgpu, masks_g, flags_g, w_g, program, masks_s, flag_s, w_s, loaded)
        if scale_g is not None:
            plgpu.copy_gmem_to_smem(scale_g, scale_s, loaded)
        plgpu.barrier_wait(loaded)
        w = [blocks.load(w_s.at[k]) for k in range(width)]

        def compute(masked: bool):
            amax = None
            for r in range(0, SPAN, SUB):
                masks = _block_masks(blocks, masks_s, r, masked)
                dx = None
                for lag in range(width):
                    term = _masked_window(blocks, d_s, r + lag, lag, masks) * w[width - 1 - lag]
                    dx = term + 0.0 if dx is None else dx + term  # + 0.0: the Triton kernel's sum starts at +0
                amax = store_keeping_max(dx, out_s.at[pl.ds(r, SUB)], quantized, scale_s, amax)
            if amax is not None:
                amax_s[0] = jnp.max(amax)  # one number a program
        _masked_or_not(flag_s, compute)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g.at[bi, pl.ds(t0, SPAN), _columns(column_offset if in_place else 0)])
        if amax_g is not None:
            plgpu.copy_smem_to_gmem(amax_s, amax_g.at[bi, ti, lax.axis_index("c")])
        plgpu.wait_smem_to_gmem(0)

    operands = [dpre_pad, *_window_masks(ids_back, width, 0), _rows_of(w_WC)]
    scratch = _scratch(plgpu, SPAN + width - 1, dpre_pad.dtype, width)
    out_type = []
    if quantize is not None:
        operands.append(scale_operand(quantize[0]))
        scratch.append(plgpu.SMEM((32,), f32))
    # Mosaic GPU's interpreter takes no Ref operand: there dx comes back alone and XLA sets it
    # into the wider array.
    in_place = into_BTI is not None and not interpret
    if in_place:
        into_ref = jax.new_ref(into_BTI)
        operands.append(into_ref)
    else:
        out_type.append(jax.ShapeDtypeStruct((b, t, c), out_dtype))
    if quantize is not None:
        out_type.append(jax.ShapeDtypeStruct((b, t // SPAN, c // COLUMNS, 32), f32))  # word 0: the max
    scratch.append(plgpu.SMEM((SPAN, COLUMNS), out_dtype))
    if quantize is not None:
        scratch.append(plgpu.SMEM((32,), f32))
    scratch.append(plgpu.Barrier(num_arrivals=4 + (quantize is not None)))
    results = kernel_on_grid(kernel, out_type, (b, t // SPAN, c // COLUMNS), _GRID, scratch, interpret)(*operands)
    if in_place:
        dx = into_ref[...]
    else:
        dx = results[0]
        if into_BTI is not None:
            dx = lax.dynamic_update_slice_in_dim(into_BTI, dx, column_offset, axis=2)
    if quantize is None:
        return dx
    return dx, jnp.max(results[-1][..., 0])


def _gradient_into(dpre_pad, ids_back, w_WC, into_BTI, scale, column_offset: int, fp8: bool):
    """``input_gradient`` as the Mamba-2 mixer calls it: into in_proj's gradient, BF16 or FP8."""
    return input_gradient(dpre_pad, ids_back, w_WC, False, into_BTI, column_offset,
                          (scale, into_BTI.dtype) if fp8 else None)


def lowers_at(b: int, t: int, c: int, width: int, x_dtype, w_dtype, b_dtype, into_columns: int,
              column_offset: int, fp8: bool = False) -> bool:
    """Whether this jax lowers the kernels for CUDA as the mixer runs them at these shapes (x read
    from in_proj's [B, T, into_columns] output at ``column_offset``, dx written into its gradient
    there, in x's dtype, or with ``fp8`` in E5M2 for FP8 delayed scaling: only the store the
    layer uses is lowered, ~1 s each) (``ssd_mosaic.lowers``: one warning and False where it
    does not, so the caller keeps the Triton kernels)."""
    sds = jax.ShapeDtypeStruct
    x_src, ids = sds((b, t, into_columns), x_dtype), sds((b, t + width - 1), jnp.int32)
    w, bias = sds((width, c), w_dtype), sds((c,), b_dtype)
    dpre, scale = sds((b, t + 8, c), x_dtype), sds((), jnp.float32)
    return (lowers(conv_silu_forward, x_src, ids, w, bias, column_offset=column_offset)
            and lowers(preactivation_gradients, x_src, ids, w, bias, sds((b, t, c), x_dtype),
                       column_offset=column_offset)
            and lowers(_gradient_into, dpre, ids, w, sds((b, t, into_columns), jnp.float8_e5m2 if fp8 else x_dtype),
                       scale, column_offset=column_offset, fp8=fp8))
