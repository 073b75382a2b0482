"""The SSD's recurrence between chunks as a Pallas kernel, forward and backward.

With K chunks, each chunk's end state from its own tokens (states[z]) and the decay over the
whole chunk (decay[z], already zero where a segment starts inside chunk z so nothing crosses):

    end[z]   = states[z] + decay[z] * end[z - 1]          (end[-1] = 0)
    entry[z] = end[z - 1]                                 (the state entering chunk z)

States are [B, K, G, N, R, P] (the order the chunk-state matmul writes), decays [B, K, G, R]
(per head: R heads a group). Written in jax.numpy as an unrolled loop over K, XLA fused every
entry[z] into its consumers and recomputed the chain up to z inside each, with state-sized
masks: K^2 / 2 passes over a state instead of one (about a tenth of a mamba2-1p3b step on an
H100). As ``lax.scan`` it would be K dependent launches a layer. Here one program per
(b, g, n, head block) walks the K chunks in order (a loop of ``_UNROLL`` chunks an iteration)
with its [R_t, P] slice of the state in registers: one read of the states and one write of the
entries, forward; the backward walks back:

    d_end[K-1] = 0;  d_end[z-1] = d_entry[z] + decay[z] * d_end[z]
    d_states[z] = d_end[z];  d_decay[z] = sum over (n, p) of d_end[z] * entry[z]

(d_decay comes out per n and is summed over N by XLA, a [B, K, G, N, R] array.)

Hand-written for the same reason as ``maxfp4.kernels.ssd``; it runs in interpret mode off GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from maxfp4.kernels.launch import pallas_call, triton_params

# Elements of one program's state slice: 16 KiB in FP32, held in registers across the K steps.
_SLICE_ELEMENTS = 4096


def _power_of_two(v: int) -> bool:
    return v >= 1 and v & (v - 1) == 0


def state_passing_supported(heads_per_group: int, head_dim: int) -> bool:
    """Triton tiles are powers of two: the [R_t, P] slice needs R and P to be."""
    return _power_of_two(heads_per_group) and _power_of_two(head_dim)


# Chunks a loop iteration walks. The chain is serial, but the loads of states[z], decay[z] (and
# dentry[z]) do not depend on it: a few chunks unrolled let Triton issue them ahead. Unrolled
# over all K, the kernel's size and Triton's compile time grew with the sequence (K = 256 chunks,
# 32k tokens a device, took minutes to compile).
_UNROLL = 8


def _unroll(k: int) -> int:
    return min(_UNROLL, k)  # K is a power of two (pad_chunks), so either divides it


# The recurrence runs in the states' dtype (FP32); entries may be stored narrower (see
# ``entry_states``), so every load is widened and every store rounded once.

def _forward_kernel(states_ref, decay_ref, entry_ref):
    k = states_ref.shape[0]
    u = _unroll(k)

    def chunks(i, end_RP):  # chunks i*u .. i*u + u - 1
        for j in range(u):
            z = i * u + j
            entry_ref[z] = end_RP.astype(entry_ref.dtype)
            end_RP = states_ref[z] + decay_ref[z][:, None] * end_RP
        return end_RP

    jax.lax.fori_loop(0, k // u, chunks, jnp.zeros(states_ref.shape[1:], states_ref.dtype))


def _backward_kernel(decay_ref, entry_ref, dentry_ref, dstates_ref, ddecay_ref):
    k = entry_ref.shape[0]
    u = _unroll(k)

    def chunks(i, dend_RP):  # chunks k-1 - i*u down to k - u - i*u
        for j in range(u):
            z = k - 1 - (i * u + j)
            dstates_ref[z] = dend_RP.astype(dstates_ref.dtype)
            ddecay_ref[z] = jnp.sum(dend_RP * entry_ref[z].astype(dend_RP.dtype), axis=1)
            dend_RP = dentry_ref[z].astype(dend_RP.dtype) + decay_ref[z][:, None] * dend_RP
        return dend_RP

    # d end[K-1] = 0: the last end is unused
    jax.lax.fori_loop(0, k // u, chunks, jnp.zeros(entry_ref.shape[1:], ddecay_ref.dtype))


def _launch(kernel, states_shape, interpret, in_kinds, out_kinds, out_shape, *args):
    """pallas_call over programs (b, g, n, head block); kinds name each operand's block:
    "state" [Kp, R_t, P] of a [B, Kp, G, N, R, P] array, "decay" [Kp, R_t] of [B, Kp, G, R],
    "partial" [Kp, R_t] of [B, Kp, G, N, R]."""
    b, kp, g, n, r, p = states_shape
    r_t = min(r, max(1, _SLICE_ELEMENTS // p))
    sq = pl.squeezed
    specs = {
        "state": pl.BlockSpec((sq, kp, sq, sq, r_t, p), lambda bi, gi, ni, ri: (bi, 0, gi, ni, ri, 0)),
        "decay": pl.BlockSpec((sq, kp, sq, r_t), lambda bi, gi, ni, ri: (bi, 0, gi, ri)),
        "partial": pl.BlockSpec((sq, kp, sq, sq, r_t), lambda bi, gi, ni, ri: (bi, 0, gi, ni, ri)),
    }
    return pallas_call(kernel, grid=(b, g, n, r // r_t), in_specs=[specs[s] for s in in_kinds],
                          out_specs=[specs[s] for s in out_kinds], out_shape=out_shape,
                          interpret=interpret, **triton_params(interpret, num_warps=4))(*args)


def pad_chunks(states_BKGNRP: jax.Array, decay_BKGR: jax.Array) -> tuple[jax.Array, jax.Array]:
    """K padded to a power of two, as the kernels walk it: zero states after the last chunk
    cannot reach an earlier one."""
    k = states_BKGNRP.shape[1]
    kp = 1 << (k - 1).bit_length()
    if kp == k:
        return states_BKGNRP, decay_BKGR
    return (jnp.pad(states_BKGNRP, [(0, 0), (0, kp - k)] + [(0, 0)] * 4),
            jnp.pad(decay_BKGR, [(0, 0), (0, kp - k), (0, 0), (0, 0)]))


def entry_states_forward(states, decay, out_dtype, interpret):
    """The forward kernel on K-padded inputs (``pad_chunks``); entries stored in out_dtype."""
    (entry,) = _launch(_forward_kernel, states.shape, interpret, ("state", "decay"), ("state",),
                       [jax.ShapeDtypeStruct(states.shape, out_dtype)], states, decay)
    return entry


def entry_states_backward(decay, entry, dentry, dstates_dtype, interpret):
    """(d states stored in dstates_dtype, d decay) from the entries' gradient, K-padded. The
    recurrence runs in the decay's dtype; a consumer that rounds d states anyway (the BF16
    chunk-state GEMM's backward) gets them rounded here, with no separate cast pass."""
    b, kp, g, n, r, _ = entry.shape
    dstates, ddecay_partial = _launch(
        _backward_kernel, entry.shape, interpret, ("decay", "state", "state"), ("state", "partial"),
        [jax.ShapeDtypeStruct(entry.shape, dstates_dtype), jax.ShapeDtypeStruct((b, kp, g, n, r), decay.dtype)],
        decay, entry, dentry)
    return dstates, ddecay_partial.sum(axis=3)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _entry_states(states, decay, out_dtype, interpret):
    return entry_states_forward(states, decay, out_dtype, interpret)


def _entry_states_fwd(states, decay, out_dtype, interpret):
    entry = entry_states_forward(states, decay, out_dtype, interpret)
    return entry, (decay, entry)


def _entry_states_bwd(out_dtype, interpret, residuals, dentry):
    decay, entry = residuals
    return entry_states_backward(decay, entry, dentry, decay.dtype, interpret)


_entry_states.defvjp(_entry_states_fwd, _entry_states_bwd)


def entry_states(states_BKGNRP: jax.Array, decay_BKGR: jax.Array, interpret: bool,
                 out_dtype: jnp.dtype | None = None) -> jax.Array:
    """The state entering each chunk, [B, K, G, N, R, P] (zero for the first chunk), from each
    chunk's own end state and its whole-chunk decay (zero where a segment starts in the chunk).
    K is padded to a power of two (``pad_chunks``).
    ``out_dtype`` (default: the states') stores the entries narrower for a consumer that rounds
    them anyway (the SSD's BF16 GEMM), so no separate cast pass reads them again."""
    k = states_BKGNRP.shape[1]
    states_BKGNRP, decay_BKGR = pad_chunks(states_BKGNRP, decay_BKGR.astype(states_BKGNRP.dtype))
    return _entry_states(states_BKGNRP, decay_BKGR, jnp.dtype(out_dtype or states_BKGNRP.dtype), interpret)[:, :k]
