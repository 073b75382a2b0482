"""Mamba-2's causal depthwise convolution + SiLU as Pallas kernels, forward and backward.

Same result as ``silu(causal_conv(x in FP32, w, b, segment_ids))`` of ``maxfp4.model.mamba``
(the sum over the last W positions of the same packed document), stored in x's dtype.

Why a kernel: written in jax.numpy, the W shifted copies of x (pad + slice along T) and the
weight-gradient reductions over (B, T) lead XLA's GPU layout assignment to run the whole
convolution on a T-minor [B, channels, T] copy of the in_proj output and to transpose it back
for the SSD and in the backward pass: about a third of a Mamba-2 training step was transposes
(H200 profile, 2026-11-22). The kernels read and write [B, T, C] rows as they lie in memory.

Each program owns a [Tb, Cb] tile of one batch row. The forward reads the W - 1 rows before its
tile from x padded at the front (zeros, segment id -1), so no program needs a neighbour's data.
The backward is two kernels: the first recomputes the pre-activation, forms its gradient
(through SiLU) and the tile's partial sums for the weight and bias gradients; the second
gathers the input gradient from the next W - 1 rows of that gradient (the first writes it into
a buffer W - 1 rows longer than T, whose last rows are never used: their segment id is -1).

The padded copy of x is kept on purpose: reading the in_proj output in place instead (masked or
clamped rows, no copy) saved the copy's 4 ms and 6 GiB on an H200 mamba2-1p3b step but slowed
these kernels by 13 ms. (The Mosaic GPU kernels, ``conv_mosaic``, do read it in place: their TMA
copies fetch whole rows, with no masked loads.)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from maxfp4.kernels import conv_mosaic
from maxfp4.kernels.epilogue import Quantize, Quantized
from maxfp4.kernels.launch import pallas_call, triton_params

_TILE_T = (64, 32, 16, 8)
_TILE_C = (128, 64, 32, 16)


def _tile(size: int, options: tuple[int, ...]) -> int | None:
    return next((o for o in options if size % o == 0), None)


def supported(t: int, channels: int) -> bool:
    """Tiles are powers of two (Triton): T and the channel count must split into them."""
    return _tile(t, _TILE_T) is not None and _tile(channels, _TILE_C) is not None


conv_kernel_supported = supported  # the name the model code and older callers use


def _rows(ref, bi, start, size, c0=None, cb=None):
    if c0 is None:
        return ref[bi, pl.ds(start, size)]
    return ref[bi, pl.ds(start, size), pl.ds(c0, cb)]


def _masked_input(x_ref, ids_ref, ids_Tb, bi, t0, c0, tb, cb, width, lag):
    """The tile's input `lag` positions back, zero where that position is in an earlier document."""
    x_TbCb = _rows(x_ref, bi, t0 + width - 1 - lag, tb, c0, cb).astype(jnp.float32)
    keep_Tb = _rows(ids_ref, bi, t0 + width - 1 - lag, tb) == ids_Tb
    return jnp.where(keep_Tb[:, None], x_TbCb, 0.0)


def _preactivation(x_ref, ids_ref, w_ref, b_ref, bi, t0, c0, tb, cb, width):
    """conv(x) + b on the tile (FP32) and the tile's segment ids."""
    ids_Tb = _rows(ids_ref, bi, t0 + width - 1, tb)
    pre_TbCb = jnp.broadcast_to(b_ref[pl.ds(c0, cb)][None, :], (tb, cb)).astype(jnp.float32)
    for lag in range(width):
        x_TbCb = _masked_input(x_ref, ids_ref, ids_Tb, bi, t0, c0, tb, cb, width, lag)
        pre_TbCb += x_TbCb * w_ref[width - 1 - lag, pl.ds(c0, cb)][None, :]
    return pre_TbCb, ids_Tb


def _forward_kernel(x_ref, ids_ref, w_ref, b_ref, out_ref, *, tb, cb, width):
    bi, t0, c0 = pl.program_id(0), pl.program_id(1) * tb, pl.program_id(2) * cb
    pre_TbCb, _ = _preactivation(x_ref, ids_ref, w_ref, b_ref, bi, t0, c0, tb, cb, width)
    out_ref[...] = (pre_TbCb * jax.nn.sigmoid(pre_TbCb)).astype(out_ref.dtype)


def _preactivation_grad_kernel(x_ref, ids_ref, w_ref, b_ref, dout_ref, dpre_ref, db_ref, *dw_refs,
                               tb, cb, width):
    bi, t0, c0 = pl.program_id(0), pl.program_id(1) * tb, pl.program_id(2) * cb
    pre_TbCb, ids_Tb = _preactivation(x_ref, ids_ref, w_ref, b_ref, bi, t0, c0, tb, cb, width)
    sig_TbCb = jax.nn.sigmoid(pre_TbCb)
    dpre_TbCb = dout_ref[...].astype(jnp.float32) * sig_TbCb * (1.0 + pre_TbCb * (1.0 - sig_TbCb))
    dpre_ref[bi, pl.ds(t0, tb), pl.ds(c0, cb)] = dpre_TbCb.astype(dpre_ref.dtype)
    db_ref[...] = jnp.sum(dpre_TbCb, axis=0)
    # Row W-1-lag of the weight multiplies the input `lag` positions back. The shifted inputs
    # are loaded again here (from cache) rather than kept from the pre-activation: W tiles held
    # at once spilled registers. One output per row: Triton cannot stack them into one tile.
    for row in range(width):
        x_TbCb = _masked_input(x_ref, ids_ref, ids_Tb, bi, t0, c0, tb, cb, width, width - 1 - row)
        dw_refs[row][...] = jnp.sum(x_TbCb * dpre_TbCb, axis=0)


def _input_grad(dpre_ref, ids_ref, w_ref, *, tb, cb, width):
    """dx[s] = sum over lag of dpre[s + lag] * w[W-1-lag], where s + lag is in s's document
    (the program's [tb, cb] tile, FP32). dpre and ids are padded with W - 1 rows at the end
    (zeros, segment id -1)."""
    bi, t0, c0 = pl.program_id(0), pl.program_id(1) * tb, pl.program_id(2) * cb
    ids_Tb = _rows(ids_ref, bi, t0, tb)
    dx_TbCb = jnp.zeros((tb, cb), jnp.float32)
    for lag in range(width):
        dpre_TbCb = _rows(dpre_ref, bi, t0 + lag, tb, c0, cb).astype(jnp.float32)
        keep_Tb = _rows(ids_ref, bi, t0 + lag, tb) == ids_Tb
        dx_TbCb += jnp.where(keep_Tb[:, None], dpre_TbCb, 0.0) * w_ref[width - 1 - lag, pl.ds(c0, cb)][None, :]
    return dx_TbCb


def _input_grad_kernel(dpre_ref, ids_ref, w_ref, dx_ref, *, tb, cb, width):
    dx_ref[...] = _input_grad(dpre_ref, ids_ref, w_ref, tb=tb, cb=cb, width=width).astype(dx_ref.dtype)


def _input_grad_kernel_into(dpre_ref, ids_ref, w_ref, into_ref, dx_ref, *, tb, cb, width):
    """``_input_grad_kernel`` writing into a block of a wider array (``into_ref`` is that array,
    aliased to ``dx_ref`` and not read)."""
    del into_ref
    _input_grad_kernel(dpre_ref, ids_ref, w_ref, dx_ref, tb=tb, cb=cb, width=width)


def _input_grad_kernel_into_fp8(dpre_ref, ids_ref, w_ref, qscale_ref, into_ref, dx_ref, amax_ref, *, tb, cb,
                                width, quantized):
    """``_input_grad_kernel_into`` storing FP8 (``fp8_epilogue.Quantized``) and the tile's
    per-column max of |dx| as rounded before the cast."""
    del into_ref
    dx_TbCb = quantized.round(_input_grad(dpre_ref, ids_ref, w_ref, tb=tb, cb=cb, width=width))
    dx_ref[...] = quantized.cast(dx_TbCb, qscale_ref[0], dx_ref.dtype)
    amax_ref[...] = jnp.max(jnp.abs(dx_TbCb), axis=0)


# Triton warps per program (H200, mamba2-1p3b shapes): the forward 0.29 ms with 8, 0.36 with 4;
# the two backward kernels 0.23 ms with 4, 0.30 with 8.
_FORWARD_WARPS, _BACKWARD_WARPS = 8, 4


class ConvTiling(NamedTuple):
    """How the kernels are launched on GPU: each program's tile (rows of T, channels) and the
    Triton warps of the forward and the two backward kernels."""
    rows: int
    channels: int
    forward_warps: int = _FORWARD_WARPS
    backward_warps: int = _BACKWARD_WARPS


def default_conv_tiling(t: int, channels: int) -> ConvTiling:
    """The largest tile sides of _TILE_T and _TILE_C that divide T and the channels."""
    return ConvTiling(_tile(t, _TILE_T), _tile(channels, _TILE_C))


def _launch(kernel, x_shape, out_specs, out_shape, n_whole, interpret, *args, tiling: ConvTiling, num_warps: int,
            tiled_specs=None, input_output_aliases=None):
    """Inputs: the first ``n_whole`` as whole arrays (indexed by hand), the rest tiled by
    ``tiled_specs(tb, cb)`` (default: the program's own [tb, cb] tile)."""
    b, t, c = x_shape
    tb, cb = tiling.rows, tiling.channels
    if t % tb or c % cb:
        raise ValueError(f"convolution tile {tb} x {cb} does not divide T x channels {t} x {c}")
    params = triton_params(interpret, num_warps)
    return pallas_call(
        functools.partial(kernel, tb=tb, cb=cb, width=args[2].shape[0]),
        grid=(b, t // tb, c // cb),
        in_specs=[pl.no_block_spec] * n_whole + [(tiled_specs or _tile_spec)(tb, cb)] * (len(args) - n_whole),
        out_specs=out_specs(tb, cb), out_shape=out_shape, interpret=interpret,
        input_output_aliases=input_output_aliases or {}, **params)(*args)


def _tile_spec(tb, cb):
    return pl.BlockSpec((pl.squeezed, tb, cb), lambda bi, ti, ci: (bi, ti, ci))


def _padded_ids(segment_ids_BT, front: int, back: int):
    return jnp.pad(segment_ids_BT.astype(jnp.int32), ((0, 0), (front, back)), constant_values=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def causal_conv_silu(x_BTC: jax.Array, w_WC: jax.Array, b_C: jax.Array, segment_ids_BT: jax.Array,
                     interpret: bool = False) -> jax.Array:
    """silu(causal depthwise conv of x within each packed document + b), in x's dtype."""
    return conv_forward(x_BTC, w_WC, b_C, segment_ids_BT, interpret)[0]


def conv_forward(x_BTC, w_WC, b_C, segment_ids_BT, interpret, tiling: ConvTiling | None = None,
                 kernel: str = "triton", source_BTI: jax.Array | None = None, source_offset: int = 0):
    """(``causal_conv_silu``'s value, the residuals ``conv_backward`` takes). ``tiling``: the
    launch (default ``default_conv_tiling``). ``kernel``: "triton" (here) or "mosaic"
    (``maxfp4.kernels.conv_mosaic``, the same values; ``mamba._conv_kernels`` chooses). The
    Mosaic kernels read x in place: ``source_BTI`` is the wider array whose columns
    [source_offset, source_offset + C) x_BTC is (the in_proj output), which is then their
    residual instead of a padded copy of x."""
    width = w_WC.shape[0]
    ids_front = _padded_ids(segment_ids_BT, width - 1, 0)
    if kernel == "mosaic":
        source, offset = (x_BTC, 0) if source_BTI is None else (source_BTI, source_offset)
        out = conv_mosaic.conv_silu_forward(source, ids_front, w_WC, b_C, interpret, column_offset=offset)
        return out, (source, w_WC, b_C, segment_ids_BT)
    tiling = tiling or default_conv_tiling(*x_BTC.shape[1:])
    # The padded copy is the backward pass's residual too, so it is made once.
    x_pad = jnp.pad(x_BTC, ((0, 0), (width - 1, 0), (0, 0)))
    if kernel == "triton":
        out = _launch(_forward_kernel, x_BTC.shape, _tile_spec, jax.ShapeDtypeStruct(x_BTC.shape, x_BTC.dtype),
                      4, interpret, x_pad, ids_front, w_WC, b_C, tiling=tiling, num_warps=tiling.forward_warps)
    else:
        raise ValueError(f"conv_forward: kernel must be triton or mosaic, got {kernel!r}")
    return out, (x_pad, w_WC, b_C, segment_ids_BT)


def _bwd(interpret, residuals, dout_BTC):
    return conv_backward(residuals, dout_BTC, interpret) + (None,)


def into_columns_supported(channels: int, column_offset: int) -> bool:
    """``conv_backward`` can write the input gradient at this column offset of a wider array
    when the offset is a whole number of its channel tiles."""
    cb = _tile(channels, _TILE_C)
    return cb is not None and column_offset % cb == 0


def conv_backward(residuals, dout_BTC: jax.Array, interpret: bool, into_BTI: jax.Array | None = None,
                  column_offset: int = 0, tiling: ConvTiling | None = None, quantize: Quantize | None = None,
                  kernel: str = "triton", source_offset: int = 0):
    """(dx, dw, db) of ``causal_conv_silu`` from its forward residuals (``conv_forward``).

    With ``into_BTI``, a wider [B, T, I] array, dx is written into its columns
    [column_offset, column_offset + C) in place (the kernel's output aliases it) and the whole
    array is returned as dx: the Mamba-2 mixer assembles the in_proj output's gradient that way
    instead of adding zero-padded pieces (``into_columns_supported`` says where it can).
    ``quantize`` (with ``into_BTI`` of its FP8 dtype): dx is stored as FP8 as
    ``fp8_epilogue.Quantize`` says, and a fourth value comes back, ``max |dx|`` in FP32.
    ``tiling``: the launch (default ``default_conv_tiling``). ``kernel``: "triton", or "mosaic"
    (``conv_mosaic.preactivation_gradients`` and ``conv_mosaic.input_gradient``, every variant;
    ``mamba._conv_kernels`` chooses), whose residual is x's source, read at ``source_offset`` as
    ``conv_forward`` was told."""
    if kernel not in ("triton", "mosaic"):
        raise ValueError(f"conv_backward: kernel must be triton or mosaic, got {kernel!r}")
    x_pad, w_WC, b_C, segment_ids_BT = residuals  # (with "mosaic", x's source: not padded)
    width = w_WC.shape[0]
    b, c = x_pad.shape[0], w_WC.shape[1]
    t = x_pad.shape[1] - (0 if kernel == "mosaic" else width - 1)
    tiling = tiling or default_conv_tiling(t, c)
    tb = tiling.rows
    launch = functools.partial(_launch, tiling=tiling, num_warps=tiling.backward_warps)
    def per_tile(tb, cb):  # one row of partial sums a [tb, cb] tile
        return pl.BlockSpec((pl.squeezed, pl.squeezed, cb), lambda bi, ti, ci: (bi, ti, ci))

    def grad_specs(tb, cb):
        # dpre is written whole-array, into rows 0..T-1 of a buffer W - 1 rows longer: the input
        # gradient reads past T there without a padded copy; it never uses those rows (their
        # segment id is -1), so they are left unwritten.
        return [pl.no_block_spec] + [per_tile(tb, cb)] * (1 + width)

    partial_sums = jax.ShapeDtypeStruct((b, t // tb, c), jnp.float32)
    # The pre-activation gradient is stored in x's dtype (BF16 in training): the input gradient,
    # a W-tap sum of it, is rounded to that dtype anyway; the weight and bias gradients are
    # summed from the FP32 values inside the first kernel.
    shapes = [jax.ShapeDtypeStruct((b, t + width - 1, c), x_pad.dtype)] + [partial_sums] * (1 + width)
    ids_front = _padded_ids(segment_ids_BT, width - 1, 0)
    if kernel == "mosaic":
        dpre_pad, db_parts, dw_parts = conv_mosaic.preactivation_gradients(x_pad, ids_front, w_WC, b_C, dout_BTC,
                                                                           interpret, column_offset=source_offset)
    else:
        dpre_pad, db_parts, *dw_parts = launch(_preactivation_grad_kernel, (b, t, c), grad_specs, shapes, 4, interpret,
                                               x_pad, ids_front, w_WC, b_C, dout_BTC)
    grad_inputs = (dpre_pad, _padded_ids(segment_ids_BT, 0, width - 1), w_WC)
    amax = None
    if into_BTI is None and quantize is not None:
        raise ValueError("conv_backward: quantize needs into_BTI")
    if kernel == "mosaic":
        dx = conv_mosaic.input_gradient(dpre_pad, grad_inputs[1], w_WC, interpret, into_BTI, column_offset,
                                        None if quantize is None else (quantize.scale, into_BTI.dtype))
        if quantize is not None:
            dx, amax = dx
    elif into_BTI is None:
        dx = launch(_input_grad_kernel, (b, t, c), _tile_spec, jax.ShapeDtypeStruct((b, t, c), x_pad.dtype),
                     3, interpret, *grad_inputs)
    else:
        if column_offset % tiling.channels:
            raise ValueError(f"column offset {column_offset} is not a whole number of the channel tiles of {c}")

        def into_spec(tb, cb):
            shift = column_offset // cb
            return pl.BlockSpec((pl.squeezed, tb, cb), lambda bi, ti, ci: (bi, ti, ci + shift))

        # The wider array goes in last, with the output's block spec, and is never read: it only
        # gives the output its buffer and its other columns.
        into_shape = jax.ShapeDtypeStruct(into_BTI.shape, into_BTI.dtype)
        if quantize is None:
            dx = launch(_input_grad_kernel_into, (b, t, c), into_spec, into_shape, 3, interpret, *grad_inputs,
                        into_BTI, tiled_specs=into_spec, input_output_aliases={3: 0})
        else:
            fp8_kernel = functools.partial(_input_grad_kernel_into_fp8, quantized=Quantized(x_pad.dtype))
            dx, amax_parts = launch(
                fp8_kernel, (b, t, c), lambda tb, cb: [into_spec(tb, cb), per_tile(tb, cb)], [into_shape, partial_sums],
                4, interpret, *grad_inputs, jnp.reshape(quantize.scale, (1,)).astype(jnp.float32), into_BTI,
                tiled_specs=into_spec, input_output_aliases={4: 0})
            amax = jnp.max(amax_parts)
    dw_WC = jnp.stack([jnp.sum(part, axis=(0, 1)) for part in dw_parts]).astype(w_WC.dtype)
    db_C = jnp.sum(db_parts, axis=(0, 1)).astype(b_C.dtype)
    return (dx, dw_WC, db_C) if amax is None else (dx, dw_WC, db_C, amax)


causal_conv_silu.defvjp(conv_forward, _bwd)
