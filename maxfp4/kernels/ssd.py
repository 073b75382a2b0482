"""Mamba-2 SSD with its quadratic intra-chunk part as one Pallas kernel, forward and backward.

Same recurrence, segment resets and dimension letters as ``maxfp4.model.ssd`` (read it first).
The chunked decomposition there runs in plain XLA, which materialises the [B, K, H, Q, Q] decay
matrix and the masked C.B scores in HBM (for the 1.3B benchmark shape, 1 GB each in FP32 per
layer) and reads them back several times in the backward pass. Here one kernel program per
(batch row, chunk, head) builds those Q x Q tiles in on-chip memory and never writes them:

    y_i = sum_{j<=i, same segment} (C_i . B_j) exp(cs_i - cs_j) dt_j x_j      (intra-chunk)
        + [no segment starts in 0..i] exp(cs_i) C_i . entry_state              (entry state)

with cs the inclusive cumulative sum of a = dt * A inside the chunk. C_i . entry_state is one
batched matmul in XLA; the kernel applies the decay and the mask (so its backward reduces the
entry term's gradient over P in place, where XLA had transposed a [B, T, H, P] product to do it).
The chunk end states and the cumulative sums are batched matmuls and small reductions that XLA
runs well and differentiates; the recurrence between chunks is a kernel of its own
(``state_passing_kernel``). Each kernel carries a hand-written VJP (the SSD's rebuilds the tiles).

Decays inside the kernel are exp(cs_i - cs_j), the difference of two running sums, as Mamba-2's
own kernels do, instead of the reference's cancellation-free segment sum: with a <= 0 the
running sum only decreases, its rounding error is about eps * |cs| in the exponent, i.e. a
relative error of eps * |cs| in a decay (6e-8 * |cs| in FP32), and the mask is applied inside
the exp, so masked entries are exactly 0 and never inf - inf.

Hand-written because no maintained JAX library ships a Mamba-2 SSD kernel with packed-segment
resets. Pallas lowers through Triton on GPU; elsewhere the same kernel runs in interpret mode
(slow, used by the CPU tests that hold it to the sequential reference).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from maxfp4.kernels import ssd_mosaic, state_passing, state_passing_mosaic
from maxfp4.kernels.launch import on_gpu, pallas_call, triton_params
from maxfp4.kernels.ssd_ops import (check_shapes, compute_dtype, lowp_einsum, lowp_einsum_grads, masked_exp,
                                    ordered_dot, segment_starts)
from maxfp4.kernels.state_passing import pad_chunks, state_passing_supported

_HIGHEST = jax.lax.Precision.HIGHEST
# Heads one program walks at most: 16 was the fastest of 1 to 32 on an H200 at the 1.3B benchmark
# shapes (one layer forward + backward 3.27 ms with 1, 2.76-3.16 with 16; 2026-11-25).
_MAX_HEADS_PER_PROGRAM = 16


def supported(chunk_size: int, head_dim: int, d_state: int) -> bool:
    """Triton tiles need power-of-two sides of at least 16 (its smallest matmul)."""
    return all(v >= 16 and v & (v - 1) == 0 for v in (chunk_size, head_dim, d_state))


kernel_supported = supported  # the name the model code and older callers use


def _dot(a, b, matmul_dtype, out_dtype):
    """a @ b inside a kernel: matmul_dtype operands accumulated in out_dtype, or full precision."""
    if matmul_dtype is None:
        return jnp.dot(a, b, precision=_HIGHEST, preferred_element_type=out_dtype)
    return jnp.dot(a.astype(matmul_dtype), b.astype(matmul_dtype), preferred_element_type=out_dtype)


def _decay(cs_Q, seg_Q):
    """exp(cs_i - cs_j) on j <= i in one segment, else exactly 0 (the mask is inside the exp)."""
    q = cs_Q.shape[0]
    rows_QQ = jax.lax.broadcasted_iota(jnp.int32, (q, q), 0)
    cols_QQ = jax.lax.broadcasted_iota(jnp.int32, (q, q), 1)
    keep_QQ = (rows_QQ >= cols_QQ) & (seg_Q[:, None] == seg_Q[None, :])
    return jnp.exp(jnp.where(keep_QQ, cs_Q[:, None] - cs_Q[None, :], -jnp.inf))


def _decayed_scores(cb_QQ, dt_Q, cs_Q, seg_Q):
    """scores_ij = (C_i . B_j) exp(cs_i - cs_j) dt_j on j <= i in one segment, else exactly 0."""
    return cb_QQ * _decay(cs_Q, seg_Q) * dt_Q[None, :]


def _entry_factor(cs_Q, seg_Q):
    """exp(cs_i) where no segment starts in 0..i of the chunk (row i sees the entry state),
    else exactly 0: the mask is inside the exp."""
    return jnp.exp(jnp.where(seg_Q == 0, cs_Q, -jnp.inf))


def _forward_kernel(cb_ref, x_ref, dt_ref, cs_ref, seg_ref, c_entry_ref, d_ref, y_ref, *, matmul_dtype, cdt):
    cb_QQ, seg_Q = cb_ref[...].astype(cdt), seg_ref[...]

    def head(j, carry):
        cs_Q, x_QP = cs_ref[j, :], x_ref[:, j, :]
        scores_QQ = _decayed_scores(cb_QQ, dt_ref[j, :], cs_Q, seg_Q)
        y_QP = _dot(scores_QQ, x_QP, matmul_dtype, cdt)
        y_QP += _entry_factor(cs_Q, seg_Q)[:, None] * c_entry_ref[:, j, :].astype(cdt)
        y_QP += d_ref[j, :][None, :] * x_QP.astype(cdt)  # the D skip
        y_ref[:, j, :] = y_QP.astype(y_ref.dtype)
        return carry

    jax.lax.fori_loop(0, x_ref.shape[1], head, 0)


# The backward is two kernels, each rebuilding what it needs from the chunk's inputs: one for
# the gradients that flow through dy alone (x, the entry term), one for those of the scores
# (C.B, dt, the cumulative sums). One kernel doing both held too many Q x Q FP32 tiles at once.

def _backward_dx_kernel(cb_ref, dt_ref, cs_ref, seg_ref, c_entry_ref, d_ref, dy_ref, x_ref, dx_ref, dc_entry_ref,
                        dcs_entry_ref, ddt_ref, *, matmul_dtype, cdt):
    cb_QQ, seg_Q = cb_ref[...].astype(cdt), seg_ref[...]

    def head(j, carry):
        cs_Q, dt_Q, dy_QP = cs_ref[j, :], dt_ref[j, :], dy_ref[:, j, :].astype(cdt)
        # dx_j = dt_j (S^T dy)_j with S = C.B x decay, and the intra-chunk dt gradient is
        # x_j . (S^T dy)_j: a sum along each row of a [Q, P] tile here. Summing the score
        # kernel's [Q, Q] tile down its columns instead (cross-warp reductions) made the SSD
        # kernels' forward + backward 1.34 ms against 1.18 ms (H200, 2026-11-25).
        sdy_QP = _dot((cb_QQ * _decay(cs_Q, seg_Q)).T, dy_QP, matmul_dtype, cdt)
        dx_ref[:, j, :] = (dt_Q[:, None] * sdy_QP + d_ref[j, :][None, :] * dy_QP).astype(dx_ref.dtype)
        ddt_ref[j, :] = jnp.sum(sdy_QP * x_ref[:, j, :].astype(cdt), axis=1).astype(ddt_ref.dtype)
        # The entry term exp(cs_i) C_i . entry sends its cumulative-sum gradient to row i.
        entry_Q = _entry_factor(cs_Q, seg_Q)
        dcs_entry_ref[j, :] = (entry_Q * jnp.sum(dy_QP * c_entry_ref[:, j, :].astype(cdt), axis=1)
                               ).astype(dcs_entry_ref.dtype)
        dc_entry_ref[:, j, :] = (entry_Q[:, None] * dy_QP).astype(dc_entry_ref.dtype)
        return carry

    jax.lax.fori_loop(0, dy_ref.shape[1], head, 0)


def _backward_scores_kernel(cb_ref, x_ref, dt_ref, cs_ref, seg_ref, dy_ref, dcb_ref, g_rows_ref, dd_ref, *,
                            matmul_dtype, cdt):
    """Writes d(C.B), the D skip's gradient, and the row sums g_rows (below) from which the caller
    forms the cumulative sums' gradient with the dx kernel's dt gradient."""
    cb_QQ, seg_Q = cb_ref[...].astype(cdt), seg_ref[...]

    def head(j, dcb_QQ):
        dt_Q, dy_QP, x_QP = dt_ref[j, :], dy_ref[:, j, :].astype(cdt), x_ref[:, j, :]
        dd_ref[j, :] = jnp.sum(dy_QP * x_QP.astype(cdt), axis=0)  # the D skip's, per column of the head
        decay_dscores_QQ = _dot(dy_QP, x_QP.T, matmul_dtype, cdt) * _decay(cs_ref[j, :], seg_Q)
        # exp(cs_i - cs_j) sends its gradient with + to row i and - to column j; g = dscores *
        # scores = decay_dscores * cb * dt_j, whose column sums are dt_j * ddt_j (ddt from the dx
        # kernel): only its row sums need a reduction over the tile.
        g_rows_ref[j, :] = jnp.sum(decay_dscores_QQ * cb_QQ * dt_Q[None, :], axis=1).astype(g_rows_ref.dtype)
        return dcb_QQ + decay_dscores_QQ * dt_Q[None, :]

    # d(C.B) summed over this program's heads in cdt, in a fixed order (deterministic).
    dcb_ref[...] = jax.lax.fori_loop(0, dy_ref.shape[1], head, jnp.zeros(cb_QQ.shape, cdt)).astype(dcb_ref.dtype)


class Tiling(NamedTuple):
    """How the kernels are launched on GPU: Triton warps and software-pipelining stages per
    program, and how many heads of one group a program walks (``heads``; it must divide the
    heads per group). A program loads its group's C.B tile once for all its heads, and the
    backward sums d(C.B) over them in registers: one head per program wrote a [Q, Q] tile per
    head (for the 1.3B benchmark shape 268 MB a layer) for XLA to sum over the group."""
    num_warps: int = 8
    heads: int = 1
    num_stages: int = 1
    # The forward's kernel: "triton" (here), or "mosaic" (maxfp4.kernels.ssd_mosaic, Mosaic GPU,
    # which takes its own program shape).
    forward: str = "triton"
    # The backward's kernels: "triton" (here) or "mosaic" (ssd_mosaic.chunk_input_gradients for
    # the gradients through dy alone, ssd_mosaic.chunk_score_gradients for the scores').
    backward: str = "triton"


def default_tiling(chunk_size: int, heads_per_group: int) -> Tiling:
    """Several Q x Q FP32 tiles are live at once; more warps spread them over more registers.
    Heads per program: the largest power of two (Triton block sides are) that divides the heads
    per group, at most _MAX_HEADS_PER_PROGRAM."""
    heads = 1
    while heads < _MAX_HEADS_PER_PROGRAM and heads_per_group % (2 * heads) == 0:
        heads *= 2
    return Tiling(num_warps=4 if chunk_size <= 64 else 8, heads=heads)


class _Launch:
    """Grid, block specs and compiler settings shared by the forward and backward kernels.

    Layouts: C.B scores [B, K, G, Q, Q]; x, y [B, T, H, P]; dt, cs [B, H, T] (a chunk of one
    head is then contiguous); segment counts [B, T]. One program per (b, k, block of heads);
    head blocks vary fastest so the programs that share a group's C.B tile run together.
    """

    def __init__(self, c_entry, cb, interpret, tiling: Tiling):
        # H from c_entry [B, T, H, P]: x may be a view of a wider array (more head-sized blocks).
        b, k, g, q, _ = cb.shape
        h, p = c_entry.shape[2:]
        hb = tiling.heads
        if (h // g) % hb:
            raise ValueError(f"heads per program ({hb}) must divide the heads per group ({h // g})")
        sq = pl.squeezed
        self.grid = (b, k, h // hb)
        self.group_QQ = pl.BlockSpec((sq, sq, sq, q, q), lambda bi, ki, hi: (bi, ki, hi * hb // (h // g), 0, 0))
        self.block_QQ = pl.BlockSpec((sq, sq, sq, q, q), lambda bi, ki, hi: (bi, ki, hi, 0, 0))
        self.heads_QP = pl.BlockSpec((sq, q, hb, p), lambda bi, ki, hi: (bi, ki, hi, 0))
        self.heads_Q = pl.BlockSpec((sq, hb, q), lambda bi, ki, hi: (bi, hi, ki))
        self.heads_P = pl.BlockSpec((hb, p), lambda bi, ki, hi: (hi, 0))
        self.block_heads_P = pl.BlockSpec((sq, sq, hb, p), lambda bi, ki, hi: (bi, ki, hi, 0))
        self.seg_Q = pl.BlockSpec((sq, q), lambda bi, ki, hi: (bi, ki))
        self.interpret = interpret
        self.tiling = tiling

    def call(self, kernel, in_specs, out_specs, out_shape, *args, **kwargs):
        kwargs.update(triton_params(self.interpret, self.tiling.num_warps, self.tiling.num_stages))
        return pallas_call(kernel, grid=self.grid, in_specs=in_specs, out_specs=out_specs,
                              out_shape=out_shape, interpret=self.interpret, **kwargs)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def chunk_outputs(cb, x, dt, cs, seg, c_entry, d, out_dtype, matmul_dtype, interpret, tiling):
    """y [B, T, H, P] in out_dtype (T a multiple of Q; x [B, T, W, P] with W >= H: heads past H
    are not read, so x can be a view of a wider array): the intra-chunk outputs plus exp(cs_i)
    times the entry-state outputs c_entry_i = C_i . entry state (zero past a segment start), plus
    the D skip d * x (d [H, P], each head's D repeated over its columns); see module doc. The
    kernel writes out_dtype itself (no FP32 copy of y)."""
    return _chunk_outputs_fwd(cb, x, dt, cs, seg, c_entry, d, out_dtype, matmul_dtype, interpret, tiling)[0]


def _chunk_outputs_fwd(cb, x, dt, cs, seg, c_entry, d, out_dtype, matmul_dtype, interpret, tiling):
    if tiling.forward == "mosaic":
        y = ssd_mosaic.chunk_outputs_forward(cb, x, dt, cs, seg, c_entry, d, out_dtype, interpret)
        return y, (cb, x, dt, cs, seg, c_entry, d)
    launch = _Launch(c_entry, cb, interpret, tiling)
    cdt = dt.dtype
    kernel = functools.partial(_forward_kernel, matmul_dtype=matmul_dtype, cdt=cdt)
    in_specs = [launch.group_QQ, launch.heads_QP, launch.heads_Q, launch.heads_Q, launch.seg_Q, launch.heads_QP,
                launch.heads_P]
    y = launch.call(kernel, in_specs, launch.heads_QP, jax.ShapeDtypeStruct(c_entry.shape, out_dtype),
                    cb, x, dt, cs, seg, c_entry, d)
    return y, (cb, x, dt, cs, seg, c_entry, d)


def _chunk_outputs_bwd(out_dtype, matmul_dtype, interpret, tiling, residuals, dy):
    cb, x, dt, cs, seg, c_entry, d = residuals
    launch = _Launch(c_entry, cb, interpret, tiling)
    cdt = dt.dtype
    b, k, g, q, _ = cb.shape
    h = c_entry.shape[2]
    params = {"matmul_dtype": matmul_dtype, "cdt": cdt}
    per_head_Q = jax.ShapeDtypeStruct(cs.shape, cdt)
    if tiling.backward == "mosaic":
        dx, dc_entry, dcs_entry, ddt = ssd_mosaic.chunk_input_gradients(cb, dt, cs, seg, c_entry, d, dy, x, interpret)
    else:
        dx, dc_entry, dcs_entry, ddt = launch.call(
            functools.partial(_backward_dx_kernel, **params),
            [launch.group_QQ, launch.heads_Q, launch.heads_Q, launch.seg_Q, launch.heads_QP, launch.heads_P,
             launch.heads_QP, launch.heads_QP],
            [launch.heads_QP, launch.heads_QP, launch.heads_Q, launch.heads_Q],
            [jax.ShapeDtypeStruct(c_entry.shape, x.dtype), jax.ShapeDtypeStruct(c_entry.shape, c_entry.dtype),
             per_head_Q, per_head_Q],
            cb, dt, cs, seg, c_entry, d, dy, x)
    # d(C.B) comes out per block of heads, summed in the kernel; the blocks of a group are
    # summed here, in cdt, in a fixed order (deterministic).
    if tiling.backward == "mosaic":
        # d(C.B) per program's heads, g_rows, and the D skip's gradient in parts [B, K, 2, H, P].
        dcb_blocks, g_rows, dd_parts = ssd_mosaic.chunk_score_gradients(cb, x, dt, cs, seg, dy, interpret)
        dd = dd_parts.sum(axis=(0, 1, 2))
    else:
        dcb_blocks, g_rows, dd_parts = launch.call(
            functools.partial(_backward_scores_kernel, **params),
            [launch.group_QQ, launch.heads_QP, launch.heads_Q, launch.heads_Q, launch.seg_Q, launch.heads_QP],
            [launch.block_QQ, launch.heads_Q, launch.block_heads_P],
            [jax.ShapeDtypeStruct((b, k, h // tiling.heads, q, q), cdt), per_head_Q,
             jax.ShapeDtypeStruct((b, k) + d.shape, cdt)],
            cb, x, dt, cs, seg, dy)
        dd = dd_parts.sum(axis=(0, 1))
    blocks = dcb_blocks.shape[2]
    dcs = g_rows - dt * ddt
    dcb = dcb_blocks.reshape(b, k, g, blocks // g, q, q).sum(axis=3).astype(cb.dtype)
    if x.shape[2] > h:  # x was read in place from the first H head-sized column blocks of a wider array
        dx = jnp.pad(dx, ((0, 0), (0, 0), (0, x.shape[2] - h), (0, 0)))
    return dcb, dx, ddt, dcs + dcs_entry, None, dc_entry, dd.astype(d.dtype)


chunk_outputs.defvjp(_chunk_outputs_fwd, _chunk_outputs_bwd)


def ssd_fused(x_BTHP: jax.Array, dt_BTH: jax.Array, A_H: jax.Array, B_BTGN: jax.Array,
              C_BTGN: jax.Array, segment_ids_BT: jax.Array, chunk_size: int,
              matmul_dtype: jnp.dtype | None = None, interpret: bool | None = None,
              tiling: Tiling | None = None, D_H: jax.Array | None = None,
              x_within_BTC: jax.Array | None = None, forward: str = "auto", backward: str = "auto") -> jax.Array:
    """Drop-in for ``ssd_chunked`` (same arguments, same result to rounding) with the intra-chunk
    and entry-state outputs computed by the Pallas kernel. ``interpret`` defaults to True off GPU;
    ``tiling`` to ``default_tiling``. With ``D_H`` the output includes the mixer's D skip,
    y + D_h x_h, added by the kernel that holds x anyway (so no later pass reads x for it).
    ``x_within_BTC``: an array whose first H x P columns are x (the convolution output, say);
    the kernels then read x there in place instead of from a sliced copy, where they can.
    ``forward``: the forward's kernel, "triton", "mosaic" (``maxfp4.kernels.ssd_mosaic``; off GPU
    under Mosaic GPU's interpreter) or "auto" (mosaic on a Hopper GPU where it takes the shapes
    and operand dtypes and this jax lowers it, ``ssd_mosaic.lowers``; else triton); it sets
    ``tiling.forward``. ``backward``: the backward's kernels, "triton", "mosaic", or "auto" (mosaic
    on a Hopper GPU where the forward's conditions hold and both lower; with them the recurrence
    between chunks runs on Mosaic GPU where 64-head blocks tile); it sets ``tiling.backward``.
    """
    g, r = check_shapes(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, segment_ids_BT)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if interpret is None:
        interpret = not on_gpu()
    tiling = tiling or default_tiling(chunk_size, r)
    b, t, h, p = x_BTHP.shape
    n = B_BTGN.shape[-1]
    if not interpret and not kernel_supported(chunk_size, p, n):
        raise ValueError(f"the Pallas SSD kernel needs chunk size, head dim and state size to be "
                         f"powers of two >= 16, got {chunk_size}, {p}, {n}")
    cdt = compute_dtype(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN)
    operand_dtype = jnp.dtype(matmul_dtype or cdt)
    mosaic_runs = (not interpret and ssd_mosaic.available()
                   and mosaic_forward_takes(chunk_size, p, h // g, operand_dtype, cdt, x_BTHP.dtype))
    state_kernel = "triton"
    if state_passing_mosaic.supported(r, p) and (backward == "mosaic" or (
            backward == "auto" and mosaic_runs and _state_passing_lowers(b, t, g, n, r, p, chunk_size, cdt,
                                                                         operand_dtype))):
        state_kernel = "mosaic"
    cb, x_kernel, dt, *rest = kernel_inputs(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, segment_ids_BT, chunk_size,
                                            matmul_dtype, interpret, state_kernel)
    if x_within_BTC is not None and t % chunk_size == 0 and x_within_BTC.shape[-1] % p == 0:
        x_kernel = x_within_BTC.reshape(b, t, -1, p).astype(x_kernel.dtype)
    # D repeated over each head's columns, in the compute dtype (zero: no skip).
    d_HP = jnp.broadcast_to((jnp.zeros((h,), dt.dtype) if D_H is None else D_H.astype(dt.dtype))[:, None], (h, p))
    operands = (cb, x_kernel, dt, *rest, d_HP)  # C.B, x, dt, cumulative sums, segments, C_i . entry, D
    if forward == "auto":
        forward = ("mosaic" if mosaic_runs and ssd_mosaic.lowers(ssd_mosaic.chunk_outputs_forward, *operands,
                                                                  out_dtype=x_BTHP.dtype) else "triton")
    if backward == "auto":
        cb_, x_, dt_, cs_, seg_, c_entry_, d_ = operands
        dy = jax.ShapeDtypeStruct(c_entry_.shape, x_BTHP.dtype)
        backward = ("mosaic" if mosaic_runs
                    and ssd_mosaic.lowers(ssd_mosaic.chunk_input_gradients, cb_, dt_, cs_, seg_, c_entry_, d_, dy, x_)
                    and ssd_mosaic.lowers(ssd_mosaic.chunk_score_gradients, cb_, x_, dt_, cs_, seg_, dy)
                    else "triton")
    if forward not in ("triton", "mosaic"):
        raise ValueError(f"forward: expected auto, triton or mosaic, got {forward!r}")
    if backward not in ("triton", "mosaic"):
        raise ValueError(f"backward: expected auto, triton or mosaic, got {backward!r}")
    tiling = tiling._replace(forward=forward, backward=backward)
    y_BTHP = chunk_outputs(cb, x_kernel, dt, *rest, d_HP, x_BTHP.dtype, matmul_dtype, interpret, tiling)
    return y_BTHP[:, :t]


def _state_passing_lowers(b, t, g, n, r, p, chunk_size, cdt, operand_dtype) -> bool:
    """Whether both Mosaic recurrence kernels lower for these shapes (``ssd_mosaic.lowers``)."""
    k = -(-t // chunk_size)
    kp = 1 << (k - 1).bit_length()
    states = jax.ShapeDtypeStruct((b, kp, g, n, r, p), cdt)
    entry = jax.ShapeDtypeStruct(states.shape, operand_dtype)
    decay = jax.ShapeDtypeStruct((b, kp, g, r), cdt)
    return (ssd_mosaic.lowers(state_passing_mosaic.entry_states_forward, states, decay, out_dtype=operand_dtype)
            and ssd_mosaic.lowers(state_passing_mosaic.entry_states_backward, decay, entry, entry,
                                  dstates_dtype=operand_dtype))


def mosaic_forward_takes(chunk_size: int, head_dim: int, heads_per_group: int, operand_dtype, compute_dtype,
                         out_dtype) -> bool:
    """Whether ``auto`` runs this forward on ``ssd_mosaic``: its shapes, BF16 operands
    (``ssd_matmul=bf16``), FP32 decays and a BF16 output (the model's; the GPU runs checked that)."""
    return (ssd_mosaic.forward_supported(chunk_size, head_dim, heads_per_group)
            and jnp.dtype(operand_dtype) == jnp.bfloat16 and jnp.dtype(compute_dtype) == jnp.float32
            and jnp.dtype(out_dtype) == jnp.bfloat16)


_CHUNK_STATES = "bksgn,bksgrp->bkgnrp"


def _operand_precision(dtype):
    """FP32 (or float64) operands are multiplied at full precision, never rounded to TF32."""
    return _HIGHEST if jnp.dtype(dtype).itemsize >= 4 else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunk_entry_states(B_BKQGN, wx_BKQGRP, decay_BKGR, interpret, state_kernel="triton"):
    """The state entering each chunk, [B, K, G, N, R, P] in the operands' dtype: each chunk's
    own end state sum_s B_s (x) wx_s (a batched matmul accumulated in the decay's dtype, FP32),
    then the recurrence between chunks (``state_passing_kernel``).

    One VJP for both, so that the states' gradient, which the matmul's backward rounds to the
    operands' dtype anyway, is written rounded by the recurrence kernel: as the gradient of an
    FP32 array it had to be written in FP32 and cast in a pass of its own (4.6 ms a step for
    mamba2-1p3b on an H200). ``state_kernel``: the recurrence's kernels, "triton"
    (``state_passing``) or "mosaic" (``state_passing_mosaic``)."""
    return _chunk_entry_states_fwd(B_BKQGN, wx_BKQGRP, decay_BKGR, interpret, state_kernel)[0]


def _state_passing(state_kernel):
    return state_passing_mosaic if state_kernel == "mosaic" else state_passing


def _chunk_entry_states_fwd(B_BKQGN, wx_BKQGRP, decay_BKGR, interpret, state_kernel="triton"):
    k = B_BKQGN.shape[1]
    states_BKGNRP = ordered_dot(_CHUNK_STATES, B_BKQGN, wx_BKQGRP, decay_BKGR.dtype,
                                _operand_precision(B_BKQGN.dtype))
    states_BKGNRP, decay_BKGR = pad_chunks(states_BKGNRP, decay_BKGR)
    entry_BKGNRP = _state_passing(state_kernel).entry_states_forward(states_BKGNRP, decay_BKGR, B_BKQGN.dtype,
                                                                     interpret=interpret)
    return entry_BKGNRP[:, :k], (B_BKQGN, wx_BKQGRP, decay_BKGR, entry_BKGNRP)


def _chunk_entry_states_bwd(interpret, state_kernel, residuals, dentry_BKGNRP):
    B_BKQGN, wx_BKQGRP, decay_BKGR, entry_BKGNRP = residuals
    k = B_BKQGN.shape[1]
    dentry_BKGNRP = jnp.pad(dentry_BKGNRP, [(0, 0), (0, entry_BKGNRP.shape[1] - k)] + [(0, 0)] * 4)
    dstates_BKGNRP, ddecay_BKGR = _state_passing(state_kernel).entry_states_backward(
        decay_BKGR, entry_BKGNRP, dentry_BKGNRP, B_BKQGN.dtype, interpret=interpret)
    dB, dwx = lowp_einsum_grads(_CHUNK_STATES, B_BKQGN, wx_BKQGRP, dstates_BKGNRP[:, :k],
                                _operand_precision(B_BKQGN.dtype))
    return dB, dwx, ddecay_BKGR[:, :k]


chunk_entry_states.defvjp(_chunk_entry_states_fwd, _chunk_entry_states_bwd)


def _entry_states_unrolled(states_BKGNRP, decay_BKGR):
    """``entry_states`` as an unrolled loop in XLA, for head counts the kernel cannot tile."""
    end_states = [states_BKGNRP[:, 0]]
    for z in range(1, states_BKGNRP.shape[1]):
        end_states.append(states_BKGNRP[:, z] + decay_BKGR[:, z, :, None, :, None] * end_states[-1])
    return jnp.stack([jnp.zeros_like(end_states[0])] + end_states[:-1], axis=1)


def kernel_inputs(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, segment_ids_BT, chunk_size, matmul_dtype,
                  interpret=None, state_kernel="triton"):
    """Everything the kernel reads, computed in XLA (differentiable by XLA): the C.B tiles per
    group, x, dt and the chunk cumulative sums of dt*A per head, segment counts, and C_i . entry
    state per head (undecayed). T is padded to a multiple of the chunk size. ``interpret`` is
    for the state-passing kernel (default: True off GPU)."""
    if interpret is None:
        interpret = not on_gpu()
    g, r = check_shapes(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, segment_ids_BT)
    b, t, h, p = x_BTHP.shape
    n = B_BTGN.shape[-1]
    q = chunk_size
    k = -(-t // q)
    pad = k * q - t
    cdt = compute_dtype(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN)
    operand_dtype = matmul_dtype or cdt

    def padded(arr):
        # After the last token and zero in every input: cannot reach a real output (causality).
        return jnp.pad(arr, [(0, 0), (0, pad)] + [(0, 0)] * (arr.ndim - 2)) if pad else arr

    def mm(spec, lhs, rhs):
        """A token-length matmul in operand_dtype with cdt results (see ``ssd_ops.lowp_einsum``)."""
        if operand_dtype == cdt:
            return ordered_dot(spec, lhs, rhs, cdt, _HIGHEST)
        return lowp_einsum(spec, lhs.astype(operand_dtype), rhs.astype(operand_dtype), cdt)

    # States are kept as [B, K, G, N, R, P], the order a batched matmul over (b, k, g) writes
    # and reads them in, so no state-sized transpose appears forward or backward.
    x_BTHP_ = padded(x_BTHP)
    B_BKQGN = padded(B_BTGN).reshape(b, k, q, g, n)
    C_BKQGN = padded(C_BTGN).reshape(b, k, q, g, n)
    dt_BHT = jnp.moveaxis(padded(dt_BTH.astype(cdt)), 1, 2)
    # Padded start flags are False: the padding just extends the last segment.
    start_BKQ = padded(segment_starts(segment_ids_BT)).reshape(b, k, q)
    starts_before_BKQ = jnp.cumsum(start_BKQ.astype(jnp.int32), axis=-1)

    a_BHKQ = (dt_BHT * A_H.astype(cdt)[:, None]).reshape(b, h, k, q)
    cs_BHKQ = jnp.cumsum(a_BHKQ, axis=-1)

    # Each chunk's end state from its own tokens: token j reaches the end iff no segment
    # starts after it in the chunk.
    reaches_end_BKQ = starts_before_BKQ == starts_before_BKQ[..., -1:]
    to_end_BHKQ = masked_exp(cs_BHKQ[..., -1:] - cs_BHKQ, reaches_end_BKQ[:, None])
    weight_BKQGR = jnp.moveaxis(to_end_BHKQ * dt_BHT.reshape(b, h, k, q), 1, -1).reshape(b, k, q, g, r)
    weighted_x_BKQGRP = x_BTHP_.reshape(b, k, q, g, r, p).astype(cdt) * weight_BKQGR[..., None]

    # Between chunks, the recurrence over the K chunks (``state_passing_kernel``): a chunk's end
    # state is its own state plus the previous end state decayed over the whole chunk, which
    # crosses only if no segment starts in the chunk. Products of decays <= 1: no overflow.
    chunk_decay_BKGR = jnp.exp(cs_BHKQ[..., -1]).reshape(b, g, r, k).transpose(0, 3, 1, 2)
    crosses_BK = starts_before_BKQ[..., -1] == 0
    chunk_decay_BKGR = jnp.where(crosses_BK[:, :, None, None], chunk_decay_BKGR, 0.0)
    if state_passing_supported(r, p):
        entry_BKGNRP = chunk_entry_states(B_BKQGN.astype(operand_dtype), weighted_x_BKQGRP.astype(operand_dtype),
                                          chunk_decay_BKGR, interpret, state_kernel)
    else:
        entry_BKGNRP = _entry_states_unrolled(mm(_CHUNK_STATES, B_BKQGN, weighted_x_BKQGRP), chunk_decay_BKGR)

    # C.B once per group (shared by its R heads) and C_i . entry state per head; the kernel
    # scales the latter by exp(cs_i) and masks it past a segment start (so XLA never reduces a
    # [B, T, H, P] product to per-head factors in the backward pass).
    cb_BKGQQ = mm("bklgn,bksgn->bkgls", C_BKQGN, B_BKQGN)
    if operand_dtype == cdt:
        c_entry_BKQGRP = mm("bklgn,bkgnrp->bklgrp", C_BKQGN, entry_BKGNRP)
    else:
        # C_i . entry is a [B, T, H, P] array the kernels read forward and backward (and whose
        # gradient they write): the GEMM writes it in the operand dtype, like x, which halves
        # that traffic; the kernel adds it in cdt.
        c_entry_BKQGRP = lowp_einsum("bklgn,bkgnrp->bklgrp", C_BKQGN.astype(operand_dtype),
                                     entry_BKGNRP.astype(operand_dtype), operand_dtype)

    return (cb_BKGQQ, x_BTHP_.astype(operand_dtype), dt_BHT, cs_BHKQ.reshape(b, h, k * q),
            starts_before_BKQ.reshape(b, k * q), c_entry_BKQGRP.reshape(b, k * q, h, p))
