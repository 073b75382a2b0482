"""The SSD's shared operations: shape checks, the compute dtype, segment starts, the masked
exponential, and the matmuls with a chosen operand dtype and a fixed summation order. The
jax.numpy SSD (maxfp4.model.ssd) and its Pallas kernels (maxfp4.kernels.ssd) both use them, so
both compute the same values. Dimension letters as in maxfp4.model.ssd.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_HIGHEST = jax.lax.Precision.HIGHEST
_einsum = functools.partial(jnp.einsum, precision=_HIGHEST)


def compute_dtype(*arrays: jax.Array) -> jnp.dtype:
    """FP32, widened to float64 if any input is float64 (used by the float64 tests)."""
    return functools.reduce(jnp.promote_types, [a.dtype for a in arrays], jnp.dtype(jnp.float32))


def check_shapes(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, segment_ids_BT) -> tuple[int, int]:
    b, t, h, _ = x_BTHP.shape
    g, n = B_BTGN.shape[2:]
    if dt_BTH.shape != (b, t, h) or A_H.shape != (h,) or segment_ids_BT.shape != (b, t):
        raise ValueError(f"inconsistent shapes: x {x_BTHP.shape}, dt {dt_BTH.shape}, "
                         f"A {A_H.shape}, segment_ids {segment_ids_BT.shape}")
    if B_BTGN.shape != (b, t, g, n) or C_BTGN.shape != (b, t, g, n):
        raise ValueError(f"B {B_BTGN.shape} and C {C_BTGN.shape} must both be [B, T, G, N]")
    if h % g:
        raise ValueError(f"heads ({h}) must be divisible by groups ({g})")
    return g, h // g


def ordered_dot(spec: str, lhs: jax.Array, rhs: jax.Array, out_dtype: jnp.dtype | None = None,
                precision=None) -> jax.Array:
    """The two-operand einsum ``spec`` as one dot_general whose result is already laid out as
    the output asks wherever the operands allow it.

    A dot_general writes [batch, first operand's free dims, second operand's free dims].
    jnp.einsum keeps the operands in the order given and transposes that result into the
    output's order; for the SSD's state-sized matmuls (and for their gradients, as JAX derives
    them) that was a separate transpose pass over a [B, K, G, N, H, P]-sized array each, about
    3 ms a step apiece for mamba2-1p3b on an H200 (2026-11-25). Here the operand whose
    free dimensions come first in the output goes first, and the final transpose only moves
    size-1 axes (the group axis with one group) in the common case, which is free.
    """
    (spec_a, spec_b), spec_out = spec.split("->")[0].split(","), spec.split("->")[1]
    first_free = next(c for c in spec_out if not (c in spec_a and c in spec_b))
    if first_free in spec_b:
        spec_a, spec_b, lhs, rhs = spec_b, spec_a, rhs, lhs
    batch = [c for c in spec_out if c in spec_a and c in spec_b]
    contract = [c for c in spec_a if c in spec_b and c not in spec_out]
    dims = (([spec_a.index(c) for c in contract], [spec_b.index(c) for c in contract]),
            ([spec_a.index(c) for c in batch], [spec_b.index(c) for c in batch]))
    out = jax.lax.dot_general(lhs, rhs, dims, precision=precision, preferred_element_type=out_dtype)
    written = batch + [c for c in spec_a if c not in spec_b] + [c for c in spec_b if c not in spec_a]
    return jnp.transpose(out, [written.index(c) for c in spec_out])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def lowp_einsum(spec: str, lhs: jax.Array, rhs: jax.Array, out_dtype: jnp.dtype) -> jax.Array:
    """einsum of low-precision operands (both BF16, say) accumulated into ``out_dtype``.

    Its VJP rounds the incoming FP32 cotangent to the operands' dtype so that both backward
    matmuls also run on tensor cores; differentiating ``einsum(..., preferred_element_type=f32)``
    directly would multiply an FP32 cotangent by a BF16 operand, which XLA runs as an FP32 GEMM
    on CUDA cores (measured: ~15% of a Mamba-2 training step). The operand gradients come out in
    the operands' dtype, as any BF16 matmul's do. Every matmul, forward and backward, is an
    ``ordered_dot`` (no transposes of its result).
    """
    return ordered_dot(spec, lhs, rhs, out_dtype)


def _lowp_einsum_fwd(spec, lhs, rhs, out_dtype):
    return lowp_einsum(spec, lhs, rhs, out_dtype), (lhs, rhs)


def _lowp_einsum_bwd(spec, out_dtype, residuals, cotangent):
    lhs, rhs = residuals
    return lowp_einsum_grads(spec, lhs, rhs, cotangent.astype(jnp.result_type(lhs, rhs)))


def lowp_einsum_grads(spec: str, lhs: jax.Array, rhs: jax.Array, cotangent: jax.Array, precision=None):
    """(d lhs, d rhs) of the einsum ``spec`` for an output cotangent already in the operands'
    dtype: two ``ordered_dot``s, each result in its operand's layout. FP32 operands need
    ``precision=HIGHEST`` to stay FP32 on GPU (the default rounds them to TF32)."""
    (spec_l, spec_r), spec_out = spec.split("->")[0].split(","), spec.split("->")[1]
    dtype = jnp.result_type(lhs, rhs)
    return (ordered_dot(f"{spec_out},{spec_r}->{spec_l}", cotangent, rhs, dtype, precision),
            ordered_dot(f"{spec_out},{spec_l}->{spec_r}", cotangent, lhs, dtype, precision))


lowp_einsum.defvjp(_lowp_einsum_fwd, _lowp_einsum_bwd)


def segment_starts(segment_ids_BT: jax.Array) -> jax.Array:
    """[B, T] True where a segment starts. Position 0 counts as a start; the state before it
    is zero anyway, so this only keeps the masks uniform."""
    first_B1 = jnp.ones_like(segment_ids_BT[:, :1], dtype=bool)
    return jnp.concatenate([first_B1, segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)


def masked_exp(log_decay: jax.Array, keep: jax.Array) -> jax.Array:
    """exp(log_decay) where keep, exactly 0 elsewhere. The -inf goes in only here, inside the
    exp, so no inf ever meets another inf; its gradient is exactly 0 on masked entries."""
    return jnp.exp(jnp.where(keep, log_decay, -jnp.inf))
