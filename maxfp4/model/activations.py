"""The MLP activations between mlp_up and mlp_down, with hand-written VJPs (see
:mod:`maxfp4.model.layers` for why): SwiGLU's product over interleaved (gate, up) pairs, and the
squared ReLU. Both compute in FP32 from the BF16 GEMM output.

Dimension letters as in :mod:`maxfp4.model.layers`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def bf16_pairs_as_fp32(pairs_BTF2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The two halves of a BF16 [..., F, 2] array as two FP32 [..., F] arrays, read as one
    32-bit word per pair: element 0 is the word's low half (``bitcast_convert_type``'s layout),
    and a BF16 value widened to FP32 is its 16 bits followed by 16 zero bits, so both are exact.
    XLA then loads one word per pair instead of two 2-byte values."""
    w = jax.lax.bitcast_convert_type(pairs_BTF2, jnp.uint32)
    return (jax.lax.bitcast_convert_type(w << 16, jnp.float32),
            jax.lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), jnp.float32))


@jax.custom_vjp
def swiglu_product(gate_up_BTF2: jax.Array) -> jax.Array:
    """``silu(gate) * up`` in FP32 from the interleaved [..., F, 2] output of the gate/up GEMM."""
    if gate_up_BTF2.dtype == jnp.bfloat16:
        g, u = bf16_pairs_as_fp32(gate_up_BTF2)
        return jax.nn.silu(g) * u
    g = gate_up_BTF2[..., 0].astype(jnp.float32)
    return jax.nn.silu(g) * gate_up_BTF2[..., 1].astype(jnp.float32)


def _swiglu_product_fwd(gate_up_BTF2):
    return swiglu_product(gate_up_BTF2), gate_up_BTF2


def _swiglu_product_bwd(gate_up_BTF2, dh_BTF):
    if gate_up_BTF2.dtype == jnp.bfloat16:
        return (swiglu_grad_bf16_pairs(gate_up_BTF2, dh_BTF),)
    # Written over the interleaved [..., F, 2] cotangent directly (both halves from one set of
    # broadcast operands): a stack of two separate halves made XLA write sigmoid(gate) to memory
    # in FP32 and then interleave in a second pass.
    gu = gate_up_BTF2.astype(jnp.float32)
    g, u = gu[..., :1], gu[..., 1:]
    sig = jax.nn.sigmoid(g)
    first = jax.lax.broadcasted_iota(jnp.int32, gu.shape, gu.ndim - 1) == 0
    coef = jnp.where(first, u * sig * (1.0 + g * (1.0 - sig)), g * sig)
    return ((dh_BTF.astype(jnp.float32)[..., None] * coef).astype(gate_up_BTF2.dtype),)


def swiglu_grad_bf16_pairs(gate_up_BTF2: jax.Array, dh_BTF: jax.Array) -> jax.Array:
    """The BF16 cotangent of ``swiglu_product``, computed over [..., F] 32-bit words that each
    hold one (gate, up) pair, so that every operation has the [..., F] shape.

    Over the [..., F, 2] shape, sigmoid(gate) feeds both elements of a pair; XLA then would not
    fuse it into the consumer that computes each element twice, and wrote it to memory in FP32
    first: two passes where one suffices (Llama-3-8B, an H200: 372 + 345 us a layer and
    sequence). The arithmetic is the FP32 formula of the general path, element for element, and
    the two BF16 results are packed back into one word the same way they were unpacked."""
    g, u = bf16_pairs_as_fp32(gate_up_BTF2)
    sig = jax.nn.sigmoid(g)
    dh = dh_BTF.astype(jnp.float32)
    d_gate = dh * (u * sig * (1.0 + g * (1.0 - sig)))
    d_up = dh * (g * sig)

    def bits(x):
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)

    return jax.lax.bitcast_convert_type(bits(d_gate) | (bits(d_up) << 16), jnp.bfloat16)


swiglu_product.defvjp(_swiglu_product_fwd, _swiglu_product_bwd)


@jax.custom_vjp
def relu2(a_BTF: jax.Array) -> jax.Array:
    """``relu(a)^2`` in FP32."""
    return jnp.square(jax.nn.relu(a_BTF.astype(jnp.float32)))


def _relu2_fwd(a_BTF):
    return relu2(a_BTF), a_BTF


def _relu2_bwd(a_BTF, dh_BTF):
    da = 2.0 * jax.nn.relu(a_BTF.astype(jnp.float32)) * dh_BTF.astype(jnp.float32)
    return (da.astype(a_BTF.dtype),)


relu2.defvjp(_relu2_fwd, _relu2_bwd)
