"""Building blocks shared by the model families.

Dimension letters: B batch, T sequence, D d_model, N query heads, K kv heads, G query heads per
kv head (N = K*G), H head dim, F MLP hidden, V vocabulary, L blocks.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from maxfp4.precision import LayerPrecision

ACT_DTYPE = jnp.bfloat16


# The element-wise pieces between GEMMs (RMSNorm, the SwiGLU and squared-ReLU products) have
# hand-written VJPs. Plain autodiff of their FP32 formulas keeps FP32 copies of their inputs and
# intermediates for the backward pass ([B, T, F] FP32 tensors, several per layer, stacked over
# the scanned layers): on dense-1p3b without remat that was ~44 GB written and read back each
# step. These keep only their BF16 inputs (the GEMM outputs, which remat=save_gemm keeps anyway)
# and a [B, T] FP32 statistic, and recompute the rest in one fused backward pass.


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(x_BTD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in FP32 (never quantized), returned in the activation dtype."""
    return _rms_norm_fwd(x_BTD, scale_D, eps)[0]


def _rms_norm_fwd(x_BTD, scale_D, eps):
    x = x_BTD.astype(jnp.float32)
    rinv_BT1 = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    y = (x * rinv_BT1 * scale_D.astype(jnp.float32)).astype(ACT_DTYPE)
    return y, (x_BTD, scale_D, rinv_BT1)


def _rms_norm_bwd(eps, res, dy_BTD):
    del eps
    x_BTD, scale_D, rinv_BT1 = res
    xhat = x_BTD.astype(jnp.float32) * rinv_BT1
    dy = dy_BTD.astype(jnp.float32)
    dscale_D = jnp.sum((dy * xhat).reshape(-1, xhat.shape[-1]), axis=0)
    dxhat = dy * scale_D.astype(jnp.float32)
    dx = rinv_BT1 * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
    return dx.astype(x_BTD.dtype), dscale_D.astype(scale_D.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _bf16_pairs_as_fp32(pairs_BTF2: jax.Array) -> tuple[jax.Array, jax.Array]:
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
        g, u = _bf16_pairs_as_fp32(gate_up_BTF2)
        return jax.nn.silu(g) * u
    g = gate_up_BTF2[..., 0].astype(jnp.float32)
    return jax.nn.silu(g) * gate_up_BTF2[..., 1].astype(jnp.float32)


def _swiglu_product_fwd(gate_up_BTF2):
    return swiglu_product(gate_up_BTF2), gate_up_BTF2


def _swiglu_product_bwd(gate_up_BTF2, dh_BTF):
    if gate_up_BTF2.dtype == jnp.bfloat16:
        return (_swiglu_grad_bf16_pairs(gate_up_BTF2, dh_BTF),)
    # Written over the interleaved [..., F, 2] cotangent directly (both halves from one set of
    # broadcast operands): a stack of two separate halves made XLA write sigmoid(gate) to memory
    # in FP32 and then interleave in a second pass.
    gu = gate_up_BTF2.astype(jnp.float32)
    g, u = gu[..., :1], gu[..., 1:]
    sig = jax.nn.sigmoid(g)
    first = jax.lax.broadcasted_iota(jnp.int32, gu.shape, gu.ndim - 1) == 0
    coef = jnp.where(first, u * sig * (1.0 + g * (1.0 - sig)), g * sig)
    return ((dh_BTF.astype(jnp.float32)[..., None] * coef).astype(gate_up_BTF2.dtype),)


def _swiglu_grad_bf16_pairs(gate_up_BTF2: jax.Array, dh_BTF: jax.Array) -> jax.Array:
    """The BF16 cotangent of ``swiglu_product``, computed over [..., F] 32-bit words that each
    hold one (gate, up) pair, so that every operation has the [..., F] shape.

    Over the [..., F, 2] shape, sigmoid(gate) feeds both elements of a pair; XLA then would not
    fuse it into the consumer that computes each element twice, and wrote it to memory in FP32
    first: two passes where one suffices (Llama-3-8B, an H200: 372 + 345 us a layer and
    sequence). The arithmetic is the FP32 formula of the general path, element for element, and
    the two BF16 results are packed back into one word the same way they were unpacked."""
    g, u = _bf16_pairs_as_fp32(gate_up_BTF2)
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


def rope_tables(positions_BT: jax.Array, theta: float, head_dim: int) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) of the rotary angles, FP32 [B, T, 1, H/2], for ``rotate``."""
    h = head_dim
    inv_freq_h = 1.0 / (theta ** (jnp.arange(0, h // 2, dtype=jnp.float32) * 2.0 / h))
    angles_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq_h
    return jnp.cos(angles_BTh)[:, :, None, :], jnp.sin(angles_BTh)[:, :, None, :]


def rotate(x_BTNH: jax.Array, cos_BT1h: jax.Array, sin_BT1h: jax.Array) -> jax.Array:
    """Rotary embedding, rotate-half convention (Llama): pairs are (i, i + H/2). Rotating by
    (cos, -sin) is the transpose of rotating by (cos, sin), which is its gradient."""
    h = x_BTNH.shape[-1]
    x = x_BTNH.astype(jnp.float32)
    x1, x2 = x[..., : h // 2], x[..., h // 2:]
    out = jnp.concatenate([x1 * cos_BT1h - x2 * sin_BT1h, x2 * cos_BT1h + x1 * sin_BT1h], axis=-1)
    return out.astype(x_BTNH.dtype)


def swiglu_mlp(x_BTD: jax.Array, w_up_DF2: jax.Array, w_down_FD: jax.Array,
               lp: LayerPrecision, smooth: bool = False) -> jax.Array:
    """SwiGLU: gate and up share one GEMM; the weight is [D, F, 2] so that sharding F keeps
    each device's gate and up columns together.

    ``smooth`` (Smooth-SwiGLU, arXiv 2409.12517): the product's channels are divided by their
    current absolute maximum before ``mlp_down`` quantizes them, and ``w_down``'s rows are
    multiplied by the same factors, so the layer computes the same function while a few
    outlier channels no longer set the whole tensor's FP8 scale. The factors carry no gradient.
    """
    d, f, _ = w_up_DF2.shape
    gate_up_BTF2 = lp.dot(x_BTD, w_up_DF2.reshape(d, 2 * f), "mlp_up")
    h_BTF = swiglu_product(gate_up_BTF2.reshape(*x_BTD.shape[:-1], f, 2))
    if smooth:
        s_F = jax.lax.stop_gradient(jnp.max(jnp.abs(h_BTF), axis=(0, 1)))
        s_F = jnp.where(s_F > 0, s_F, 1.0)
        h_BTF = h_BTF / s_F
        w_down_FD = w_down_FD * s_F[:, None]
    return lp.dot(h_BTF.astype(ACT_DTYPE), w_down_FD, "mlp_down")


def normal_init(key: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
    return std * jax.random.normal(key, shape, jnp.float32)


def relu2_mlp(x_BTD: jax.Array, w_up_DF1: jax.Array, w_down_FD: jax.Array, lp: LayerPrecision) -> jax.Array:
    """Squared-ReLU MLP, not gated (Nemotron-H): relu(x W_up)^2 W_down."""
    d, f, _ = w_up_DF1.shape
    h_BTF = relu2(lp.dot(x_BTD, w_up_DF1.reshape(d, f), "mlp_up"))
    return lp.dot(h_BTF.astype(ACT_DTYPE), w_down_FD, "mlp_down")


def mlp_block(x_BTD: jax.Array, w_up: jax.Array, w_down_FD: jax.Array, lp: LayerPrecision,
              kind: str = "swiglu", smooth: bool = False) -> jax.Array:
    if kind == "relu2":
        return relu2_mlp(x_BTD, w_up, w_down_FD, lp)
    return swiglu_mlp(x_BTD, w_up, w_down_FD, lp, smooth=smooth)


def output_logits(params: dict, x_BTD: jax.Array, *, cfg, policy, scales: dict, key: jax.Array,
                  constrain) -> jax.Array:
    """Final RMSNorm and the LM head (class ``lm_head``, not a block): logits [B, T, V]."""
    x_BTD = rms_norm(x_BTD, params["final_norm"], cfg.norm_eps)
    head = LayerPrecision(policy, None, {"lm_head": scales["lm_head"]} if "lm_head" in scales else None,
                          jax.random.fold_in(key, cfg.n_layers))
    return constrain(head.dot(x_BTD, params["lm_head"], "lm_head"), ("batch", "seq", "vocab"))
