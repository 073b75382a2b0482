"""cuDNN's fused attention for code under ``shard_map``: the forward and backward cuDNN calls
bound directly, without the ``custom_partitioning`` layer that ``jax.nn.dot_product_attention``
wraps them in.

Why hand-written: the public entry lowers through ``custom_partitioning`` so that GSPMD can
split it; inside ``shard_map`` every array is already one device's block, and compiling a
pipeline stage with it segfaulted XLA (jax 0.11.2, one H200 pair). The primitives beneath it
(``jax._src.cudnn.fused_attention_stablehlo``, the module jax's own sequence-packing tests
call) are the same cuDNN custom calls; this module binds them in a ``custom_vjp`` of its own,
the pairing jax's wrapper makes above them, so the kernels and their numerics are cuDNN's.

Binding them also reaches the forward's softmax statistic (the log-sum-exp of each query's
scores), which the public entry keeps to itself: :func:`attention_merged` uses it to run one
attention as several kernel calls over disjoint key sets (a split sequence's causal blocks,
maxfp4.parallel.context).

Layout BTNH. Dimension letters: B batch, T queries, S keys, N query heads, K kv heads, H head
dim, M documents (runs) per row.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple, Sequence

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
    - ``q_lengths_B`` / ``kv_lengths_B``: padding: row b's first ``q_lengths_B[b]`` queries see
      its first ``kv_lengths_B[b]`` keys, the other queries see none (:func:`attention_merged`
      only; a length may be 0).
    """

    causal: bool = False
    allowed_B1TS: jax.Array | None = None
    lengths_BM: jax.Array | None = None
    starts_BM: jax.Array | None = None
    q_lengths_B: jax.Array | None = None
    kv_lengths_B: jax.Array | None = None


def _module():
    from jax._src.cudnn import fused_attention_stablehlo as fa  # the primitives live only here
    return fa


def _call(q_BTNH: jax.Array, k_BSKH: jax.Array, mask: Mask, scale: float | None):
    """(the kernel's array operands, its static parameters) for ``mask``."""
    fa = _module()
    scale = q_BTNH.shape[-1] ** -0.5 if scale is None else float(scale)
    dtype = q_BTNH.dtype
    unused = jnp.zeros(0, dtype)
    bias = unused
    if mask.allowed_B1TS is not None:
        bias = jnp.where(mask.allowed_B1TS, jnp.asarray(0, dtype), fa.get_large_negative_number(dtype))
    q_len = kv_len = q_off = kv_off = unused
    if mask.lengths_BM is not None:
        # cuDNN's packed layout: offsets [B, M+1] with a trailing -1, lengths for q and kv.
        starts = jnp.concatenate([mask.starts_BM, jnp.full((mask.starts_BM.shape[0], 1), -1, jnp.int32)], 1)
        q_len, kv_len, q_off, kv_off = fa._fix_seqlen_offsets(
            mask.lengths_BM, mask.lengths_BM, starts, starts, q_BTNH, k_BSKH)
    elif mask.q_lengths_B is not None:
        # A length of 0 is given to the kernel as 1; attention_merged drops what that row gives.
        q_len = jnp.maximum(mask.q_lengths_B, 1).astype(jnp.int32)
        kv_len = jnp.maximum(mask.kv_lengths_B, 1).astype(jnp.int32)
    padded = mask.lengths_BM is not None or mask.q_lengths_B is not None
    if padded:
        mask_type = fa.MaskType.PADDING_CAUSAL if mask.causal else fa.MaskType.PADDING
    else:
        mask_type = fa.MaskType.CAUSAL if mask.causal else fa.MaskType.NO_MASK
    params = (("dropout_rate", 0.0), ("layout", fa.AttentionLayout.BTNH.value), ("mask_type", mask_type),
              ("scale", scale), ("seed", 0), ("sliding_window_length", None),
              ("variadic_args", (mask.allowed_B1TS is not None, False)))
    return (bias, q_len, kv_len, q_off, kv_off), params


def attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask: Mask = Mask(),
              scale: float | None = None) -> jax.Array:
    """softmax(scale q k^T, masked) v by cuDNN's fused kernel: [B, T, N, H], differentiable in q,
    k and v. Usable inside ``shard_map`` (module docstring)."""
    extra, params = _call(q_BTNH, k_BSKH, mask, scale)
    return _attention(q_BTNH, k_BSKH, v_BSKH, extra, params)


def _forward(q, k, v, extra, params):
    bias, q_len, kv_len, q_off, kv_off = extra
    unused = jnp.zeros(0, q.dtype)
    return _module()._dot_product_attention_fwd_p.bind(
        q, k, v, bias, q_len, kv_len, q_off, kv_off, unused, unused, is_training=True, **dict(params))


def _backward(q, k, v, extra, params, softmax_stat, out, dout):
    bias, q_len, kv_len, q_off, kv_off = extra
    unused = jnp.zeros(0, q.dtype)
    return _module()._dot_product_attention_bwd_p.bind(
        q, k, v, bias, q_len, kv_len, q_off, kv_off, unused, unused, softmax_stat, out, dout.astype(out.dtype),
        **dict(params))


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, extra, params):
    return _forward(q, k, v, extra, params)[0]


def _attention_fwd(q, k, v, extra, params):
    out, softmax_stat = _forward(q, k, v, extra, params)
    return out, (q, k, v, extra, out, softmax_stat)


def _attention_bwd(params, res, dout):
    q, k, v, extra, out, softmax_stat = res
    dq, dk, dv = _backward(q, k, v, extra, params, softmax_stat, out, dout)
    return dq, dk, dv, jax.tree.map(_no_cotangent, extra)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _no_cotangent(x):
    # The mask's arrays are constants of the step: zero cotangents (float0 for integers and bools).
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return np.zeros(x.shape, jax.dtypes.float0)
    return jnp.zeros_like(x)


# ----------------------------------------------------------------------------- merged parts


def attention_merged(q_BTNH: jax.Array, parts: Sequence[tuple[jax.Array, jax.Array, Mask]],
                     scale: float | None = None) -> jax.Array:
    """Attention of the queries over the union of disjoint key sets, one cuDNN call each: every
    part ``(k [B, S_p, K, H], v, mask)`` gives its output and the log-sum-exp of its scores, the
    outputs are weighted by exp(lse_p - lse) (FlashAttention's merge of key blocks), and the
    backward pass runs each part's cuDNN backward with the merged output and log-sum-exp, which
    gives each part's exact share of the whole softmax's gradient (what ring attention does with
    its key blocks). A query that sees no key of a part (padding, or a length of 0) takes nothing
    from it. [B, T, N, H]."""
    calls = [_call(q_BTNH, k, mask, scale) for k, _, mask in parts]
    keys = tuple((k, v) for k, v, _ in parts)
    extras = tuple(extra for extra, _ in calls)
    params = tuple(p for _, p in calls)
    t = q_BTNH.shape[1]
    seen = tuple(_rows_seen(mask, q_BTNH.shape[0], t) for _, _, mask in parts)
    return _merged(q_BTNH, keys, extras, seen, params)


def _rows_seen(mask: Mask, b: int, t: int) -> jax.Array:
    """[B, T] whether each query sees a key of the part (its log-sum-exp is defined)."""
    if mask.q_lengths_B is None:
        return jnp.ones((b, t), bool)
    return (jnp.arange(t)[None] < mask.q_lengths_B[:, None]) & (mask.kv_lengths_B[:, None] > 0)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _merged(q, keys, extras, seen, params):
    return _merged_fwd(q, keys, extras, seen, params)[0]


def _merged_fwd(q, keys, extras, seen, params):
    outs, stats = [], []
    for (k, v), extra, rows_BT, p in zip(keys, extras, seen, params):
        out, stat_BNT = _forward(q, k, v, extra, p)
        outs.append(out)
        stats.append(jnp.where(rows_BT[:, None, :], stat_BNT, -jnp.inf))
    lse_BNT = jax.nn.logsumexp(jnp.stack(stats), axis=0)
    total = 0.0
    for out, stat_BNT in zip(outs, stats):
        weight_BTN1 = jnp.swapaxes(jnp.exp(stat_BNT - lse_BNT), 1, 2)[..., None]
        total = total + jnp.where(weight_BTN1 > 0, out.astype(jnp.float32), 0.0) * weight_BTN1
    out = total.astype(q.dtype)
    return out, (q, keys, extras, seen, out, lse_BNT)


def _merged_bwd(params, res, dout):
    q, keys, extras, seen, out, lse_BNT = res
    dq = jnp.zeros(q.shape, jnp.float32)
    dkeys = []
    for (k, v), extra, rows_BT, p in zip(keys, extras, seen, params):
        dq_p, dk_p, dv_p = _backward(q, k, v, extra, p, lse_BNT, out, dout)
        # Rows that see nothing of this part (a length of 0 given to the kernel as 1) add nothing.
        dq = dq + jnp.where(rows_BT[:, :, None, None], dq_p.astype(jnp.float32), 0.0)
        any_B = jnp.any(rows_BT, axis=1)[:, None, None, None]
        dkeys.append((jnp.where(any_B, dk_p, jnp.zeros((), dk_p.dtype)), jnp.where(any_B, dv_p, jnp.zeros((), dv_p.dtype))))
    no_cotangent = jax.tree.map(_no_cotangent, (extras, seen))
    return (dq.astype(q.dtype), tuple(dkeys), *no_cotangent)


_merged.defvjp(_merged_fwd, _merged_bwd)
