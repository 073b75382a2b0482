"""The 16-point Hadamard transform of NVFP4's weight gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


HADAMARD16_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def hadamard16_matrix() -> np.ndarray:
    """The float64 16x16 matrix ``M = H16 @ diag(HADAMARD16_SIGNS) / 4`` (H16 Sylvester, +-1)."""
    h = np.ones((1, 1))
    while h.shape[0] < 16:
        h = np.block([[h, h], [h, -h]])
    return h @ np.diag(np.asarray(HADAMARD16_SIGNS, np.float64)) / 4.0


def walsh16(v: jax.Array, axis: int = -1) -> jax.Array:
    """``H16 @ g`` for every group g of 16 along ``axis`` of ``v`` (that axis has length 16; H16
    Sylvester, unnormalised), by butterflies.

    Sylvester's H16 is the Kronecker power H2 x H2 x H2 x H2, so four butterfly stages, one per
    bit of the index within the group (bit 3 first), compute the product: the element whose
    bit is 0 becomes ``a + b`` and its partner (the index with that bit set) ``a - b``. Adds
    only: no matmul, hence no TF32/bf16 matmul precision to worry about on GPU.

    Each stage pairs elements by reversing the two halves of every 2 * 2^bit run (a reverse
    and a select, both element-wise), so XLA can fuse the stages with the ops around them.
    Slicing the halves and stacking them again made every stage its own FP32 pass (profile of
    dense-1p3b's NVFP4 step on an H200: ~60 ms of 517). Still, the fused passes recompute
    multi-dimensional indices for each of an output's 16 inputs; all four stages on 16 slices
    with one stack at the end was 8% faster on one linear layer, but not measured on a whole
    model, whose compile it may lengthen.
    """
    axis = axis % v.ndim
    lead, trail = v.shape[:axis], v.shape[axis + 1:]
    lane = np.arange(16).reshape((16,) + (1,) * len(trail))
    for bit in (3, 2, 1, 0):
        stride = 1 << bit
        runs = v.reshape(*lead, 16 // (2 * stride), 2, stride, *trail)
        partner = jnp.flip(runs, axis=axis + 1).reshape(v.shape)
        low = ((lane >> bit) & 1) == 0  # this element is the "a" of its pair
        v = jnp.where(low, v + partner, partner - v)
    return v


def _grouped(x: jax.Array, axis: int, fn) -> jax.Array:
    """``fn(groups, group_axis)`` on the groups of 16 along ``axis``, in place: the axis is split
    into (n / 16, 16) where it lies, so no transpose moves it (a transform along the token axis
    of an activation stays in the activation's layout)."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % 16:
        raise ValueError(f"hadamard16: axis {axis} of shape {x.shape} must be divisible by 16")
    lead, trail = x.shape[:axis], x.shape[axis + 1:]
    out = fn(x.astype(jnp.float32).reshape(*lead, n // 16, 16, *trail), axis + 1)
    return out.reshape(x.shape)


def _signs_along(ndim: int, axis: int) -> jax.Array:
    """HADAMARD16_SIGNS shaped to broadcast along ``axis`` of an ndim-dimensional array."""
    return jnp.asarray(HADAMARD16_SIGNS, jnp.float32).reshape((16,) + (1,) * (ndim - 1 - axis))


def hadamard16(x: jax.Array, axis: int = -1) -> jax.Array:
    """Apply ``M = H16 @ diag(sign) / 4`` to every group of 16 consecutive elements along ``axis``.

    Convention: a group ``g`` (the 16 values ``x[..., 16*j : 16*j+16, ...]`` along ``axis``) is
    treated as a column vector and becomes ``M @ g``, i.e. as a row vector ``g @ M.T`` =
    ``g @ diag(sign) @ H16 / 4``: the signs are applied first, then the Hadamard transform.
    ``M`` is orthonormal; :func:`hadamard16_inverse` applies ``M.T``. Computed in float32 and
    returned as float32. ``sign = HADAMARD16_SIGNS``; :func:`hadamard16_matrix` returns ``M``.
    """
    return _grouped(x, axis, lambda g, a: walsh16(g * _signs_along(g.ndim, a), a) * jnp.float32(0.25))


def hadamard16_inverse(x: jax.Array, axis: int = -1) -> jax.Array:
    """Inverse of :func:`hadamard16`: every group ``g`` becomes ``M.T @ g``, i.e.
    ``diag(sign) @ (H16 @ g) / 4`` (Hadamard first, then the signs)."""
    return _grouped(x, axis, lambda g, a: walsh16(g, a) * jnp.float32(0.25) * _signs_along(g.ndim, a))
