"""Grouped-query causal self-attention over packed sequences.

Segment ids keep packed documents apart: a token attends only to earlier tokens of its own
segment. On GPU the fused cuDNN kernel runs (``jax.nn.dot_product_attention(implementation=
"cudnn")``); the segment mask reaches it as an additive bias, which cuDNN applies inside the
fused kernel, so packed documents stay separated there too. Scores, softmax and the value
product are never quantized.
"""

from __future__ import annotations

import jax

from maxfp4.model.layers import rope
from maxfp4.model.remat import tag_attention_output
from maxfp4.precision import LayerPrecision


def resolve_implementation(name: str) -> str:
    """``auto`` picks cuDNN's fused kernel on GPU and XLA elsewhere."""
    if name == "auto":
        # Device platform, not default_backend(): the latter names the plugin ("cuda").
        return "cudnn" if jax.devices()[0].platform in ("gpu", "cuda") else "xla"
    return name


def segment_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """[B, 1, T, T] True where query and key share a segment (causality is added separately)."""
    return (segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :])


def attend(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, segment_ids_BT: jax.Array,
           implementation: str) -> jax.Array:
    return jax.nn.dot_product_attention(
        q_BTNH, k_BTKH, v_BTKH, mask=segment_mask(segment_ids_BT), is_causal=True,
        implementation=implementation)


def attention_block(x_BTD: jax.Array, w_qkv_DKGH: jax.Array, w_o_ND: jax.Array,
                    positions_BT: jax.Array, segment_ids_BT: jax.Array, *, rope_theta: float | None,
                    implementation: str, lp: LayerPrecision) -> jax.Array:
    """``w_qkv`` is [D, K, G+2, H]: per kv head its G query heads, then its key and value, so that
    splitting K over devices keeps each head group's q, k and v together."""
    b, t, d = x_BTD.shape
    _, k, g2, h = w_qkv_DKGH.shape
    g = g2 - 2
    qkv = lp.dot(x_BTD, w_qkv_DKGH.reshape(d, k * g2 * h), "attn_qkv")
    qkv_BTKGH = qkv.reshape(b, t, k, g2, h)
    q_BTNH = qkv_BTKGH[:, :, :, :g, :].reshape(b, t, k * g, h)
    k_BTKH = qkv_BTKGH[:, :, :, g, :]
    v_BTKH = qkv_BTKGH[:, :, :, g + 1, :]
    if rope_theta is not None:
        q_BTNH = rope(q_BTNH, positions_BT, rope_theta)
        k_BTKH = rope(k_BTKH, positions_BT, rope_theta)
    out_BTNH = tag_attention_output(attend(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, implementation))
    return lp.dot(out_BTNH.reshape(b, t, k * g * h), w_o_ND, "attn_out")
