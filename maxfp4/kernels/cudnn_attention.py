"""cuDNN's fused attention for code under ``shard_map``: the forward and backward cuDNN calls
bound directly, without the ``custom_partitioning`` layer that ``jax.nn.dot_product_attention``
wraps them in.

Why hand-written: the public entry lowers through ``custom_partitioning`` so that GSPMD can
split it; inside ``shard_map`` every array is already one device's block, and compiling a
pipeline stage with it segfaulted XLA (jax 0.11.2, one H200 pair). The primitives beneath it
(``jax._src.cudnn.fused_attention_stablehlo``, the module jax's own sequence-packing tests
call) are the same cuDNN custom calls; this module binds them in a ``custom_vjp`` of its own,
the pairing jax's wrapper makes above them, so the kernels and their numerics are cuDNN's.

Layout BTNH. Dimension letters: B batch, T queries, S keys, N query heads, K kv heads, H head
dim, M documents (runs) per row.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Mask(NamedTuple):
    """What cuDNN masks.

    - ``causal``: query i sees keys <= i (top-left aligned).
    - ``allowed_B1TS``: a boolean mask, passed to cuDNN as an additive bias (False -> the
      dtype's large negative number, as jax.nn.dot_product_attention does).
    - ``lengths_BM`` / ``starts_BM``: the packed layout: each row holds M runs (documents),
      run m of ``lengths_BM[b, m]`` tokens from ``starts_BM[b, m]``, each attended to on its own
      (``causal`` within the run); unused runs have length 0 and start -1.
    """

    causal: bool = False
    allowed_B1TS: jax.Array | None = None
    lengths_BM: jax.Array | None = None
    starts_BM: jax.Array | None = None


def _module():
    from jax._src.cudnn import fused_attention_stablehlo as fa  # the primitives live only here
    return fa


def attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: Mask = Mask(),
              scale: float | None = None) -> jax.Array:
    """softmax(scale q k^T, masked) v by cuDNN's fused kernel: [B, T, N, H], differentiable in q,
    k and v. Usable inside ``shard_map`` (module docstring)."""
    fa = _module()
    scale = q_BTNH.shape[-1] ** -0.5 if scale is None else float(scale)
    dtype = q_BTNH.dtype
    unused = jnp.zeros(0, dtype)
    bias = unused
    if mask.allowed_B1TS is not None:
        bias = jnp.where(mask.allowed_B1TS, jnp.asarray(0, dtype), fa.get_large_negative_number(dtype))
    packed = mask.lengths_BM is not None
    if packed:
        # cuDNN's packed layout: offsets [B, M+1] with a trailing -1, lengths for q and kv.
        starts = jnp.concatenate([mask.starts_BM, jnp.full((mask.starts_BM.shape[0], 1), -1, jnp.int32)], 1)
        q_len, kv_len, q_off, kv_off = fa._fix_seqlen_offsets(
            mask.lengths_BM, mask.lengths_BM, starts, starts, q_BTNH, k_BSKH)
        mask_type = fa.MaskType.PADDING_CAUSAL if mask.causal else fa.MaskType.PADDING
    else:
        q_len = kv_len = q_off = kv_off = unused
        mask_type = fa.MaskType.CAUSAL if mask.causal else fa.MaskType.NO_MASK
    params = (("dropout_rate", 0.0), ("layout", fa.AttentionLayout.BTNH.value), ("mask_type", mask_type),
              ("scale", scale), ("seed", 0), ("sliding_window_length", None),
              ("variadic_args", (mask.allowed_B1TS is not None, False)))
    return _attention(q_BTNH, k_BSKH, v_BSKH, (bias, q_len, kv_len, q_off, kv_off), params)


def _forward(q, k, v, extra, params):
    bias, q_len, kv_len, q_off, kv_off = extra
    unused = jnp.zeros(0, q.dtype)
    return _module()._dot_product_attention_fwd_p.bind(
        q, k, v, bias, q_len, kv_len, q_off, kv_off, unused, unused, is_training=True, **dict(params))


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, extra, params):
    return _forward(q, k, v, extra, params)[0]


def _attention_fwd(q, k, v, extra, params):
    out, softmax_stat = _forward(q, k, v, extra, params)
    return out, (q, k, v, extra, out, softmax_stat)


def _attention_bwd(params, res, dout):
    q, k, v, extra, out, softmax_stat = res
    bias, q_len, kv_len, q_off, kv_off = extra
    unused = jnp.zeros(0, q.dtype)
    dq, dk, dv = _module()._dot_product_attention_bwd_p.bind(
        q, k, v, bias, q_len, kv_len, q_off, kv_off, unused, unused, softmax_stat, out, dout.astype(out.dtype),
        **dict(params))
    return dq, dk, dv, jax.tree.map(_no_cotangent, extra)


def _no_cotangent(x):
    # The mask's arrays are constants of the step: zero cotangents (float0 for the integer ones).
    if jnp.issubdtype(x.dtype, jnp.integer):
        return np.zeros(x.shape, jax.dtypes.float0)
    return jnp.zeros_like(x)


_attention.defvjp(_attention_fwd, _attention_bwd)
