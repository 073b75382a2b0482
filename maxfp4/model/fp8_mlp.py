"""The MLP's FP8 operands stored by the activation itself, for FP8 delayed scaling: mlp_up and
its activation as one VJP (``up_activation``), or the whole MLP as one (``mlp``).

With that recipe, mlp_up's output gradient (dY, the activation's input gradient) is only ever
read by one cast to E5M2, with a scale fixed before the step, and by its amax. Differentiated
apart, the activation's backward wrote dY in BF16 and a second pass read it back to cast it. For
SwiGLU that second pass was not fused at all: the gradient is assembled from 32-bit words that
each hold one (gate, up) pair (``activations.swiglu_grad_bf16_pairs``), and XLA does not fuse a
width-changing bitcast into the cast. Here the activation's backward stores dY in E5M2 itself,
``fp8(clip(bf16(dY) * scale))`` exactly as ``maxfp4.precision.formats.quantize_fp8`` casts the
BF16 tensor, and reduces its amax in the same pass. Same values as ``lp.dot`` then the
activation, bit for bit (tests/test_fp8_mlp.py). On GPU, with SwiGLU, the whole MLP's backward
goes one step further: ``mlp_grad_kernel`` writes those operands and the wgrads' transposed
copies in one pass.

Dimension letters as in :mod:`maxfp4.model.layers`; K = 2F (SwiGLU's interleaved gate/up
columns) or F (squared ReLU).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxfp4.parallel.mesh import batch_split_axes, split_size
from maxfp4.model import activations
from maxfp4.kernels import mlp_grad as mlp_grad_kernel
from maxfp4.kernels.launch import kernels_on_gpu, on_gpu
from maxfp4.precision import GEMM_OUT, LayerPrecision
from maxfp4.precision.formats import FP8_E4M3, FP8_E5M2, cast_fp8


def up_fused(lp: LayerPrecision) -> bool:
    """Whether mlp_up runs with its activation as ``up_activation``: its recipe offers FP8
    operand hooks (``LayerPrecision.fused``), whose dY this module's kernels write."""
    ops = lp.fused("mlp_up")
    return ops is not None and (ops.x_format, ops.dy_format) == (FP8_E4M3, FP8_E5M2)


def mlp_fused(lp: LayerPrecision) -> bool:
    """Whether the whole MLP runs as ``mlp``: mlp_down on the same recipe's hooks too."""
    return up_fused(lp) and lp.fused("mlp_down") == lp.fused("mlp_up")


def up_activation(x_BTD: jax.Array, w_up_DK: jax.Array, lp: LayerPrecision, kind: str) -> jax.Array:
    """``activation(lp.dot(x, w_up, "mlp_up"))`` in FP32 ([B, T, F]); ``kind``: "swiglu" (w_up's
    columns interleaved gate/up pairs) or "relu2"."""
    return _up_activation(x_BTD, w_up_DK, lp.scales["mlp_up"], kind, lp.options("mlp_up"), lp.fused("mlp_up"))


def mlp(x_BTD: jax.Array, w_up_DK: jax.Array, w_down_FD: jax.Array, lp: LayerPrecision, kind: str,
        kernel: bool | None = None) -> jax.Array:
    """``lp.dot(activation(lp.dot(x, w_up, "mlp_up")), w_down, "mlp_down")``, [B, T, D]. The
    activation's forward also stores mlp_down's input in E4M3 with its amax: the BF16 product
    and the cast's second read of it are gone too. (Left to XLA, the backward's recomputation
    of the product was written in FP32 and read back by the cast: Llama-3-8B, an H200, 368 us a
    layer and GPU.)

    ``kernel``: the activation's backward as ``mlp_grad_kernel`` (interpret mode off GPU), which
    also stores the wgrads' operands transposed; None picks it where ``_kernel_applies``."""
    if kernel is None:
        kernel = _kernel_applies(x_BTD.shape[0] * x_BTD.shape[1], w_down_FD.shape[0], x_BTD.shape[0], kind)
    return _mlp(x_BTD, w_up_DK, lp.scales["mlp_up"], w_down_FD, lp.scales["mlp_down"], kind,
                lp.options("mlp_up"), lp.options("mlp_down"), bool(kernel), lp.fused("mlp_up"))


def _kernel_applies(m: int, f: int, batch: int, kind: str) -> bool:
    """On GPU, under no mesh or one that splits only the batch, with each device's tokens and
    the features (SwiGLU's pairs) in whole tiles of the kind's size."""
    if not kernels_on_gpu():
        return False
    split = batch_split_axes(batch)
    return split is not None and mlp_grad_kernel.supported(m // split_size(*split), f, *mlp_grad_kernel.TILES[kind])


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _up_activation(x_BTD, w_up_DK, scales, kind, options, ops):
    return _up_activation_fwd(x_BTD, w_up_DK, scales, kind, options, ops)[0]


def _activation(y_BTK: jax.Array, kind: str) -> jax.Array:
    if kind == "swiglu":
        return activations.swiglu_product(y_BTK.reshape(*y_BTK.shape[:-1], -1, 2))
    return activations.relu2(y_BTK)


def _up_forward(x_BTD, w_up_DK, scales, options, ops):
    y_BTK, up_res = ops.forward(x_BTD, w_up_DK, options, scales)
    return checkpoint_name(y_BTK, GEMM_OUT), up_res  # what train.remat=save_gemm keeps, as lp.dot names it


def _up_backward(kind, options, ops, up_res, y_BTK, dh_BTF):
    """mlp_up's (dx, dw, amaxes) from the activation's output gradient."""
    scale = ops.dy_scale(up_res)
    if kind == "swiglu":
        qdy_BTF2, amax = swiglu_grad_e5m2(y_BTK.reshape(*y_BTK.shape[:-1], -1, 2), dh_BTF, scale)
        qdy_BTK = qdy_BTF2.reshape(y_BTK.shape)
    else:
        qdy_BTK, amax = relu2_grad_e5m2(y_BTK, dh_BTF, scale)
    return ops.backward_quantized(options, up_res, qdy_BTK, amax)


def _up_activation_fwd(x_BTD, w_up_DK, scales, kind, options, ops):
    y_BTK, up_res = _up_forward(x_BTD, w_up_DK, scales, options, ops)
    return _activation(y_BTK, kind), (up_res, y_BTK)


def _up_activation_bwd(kind, options, ops, residuals, dh_BTF):
    up_res, y_BTK = residuals
    return _up_backward(kind, options, ops, up_res, y_BTK, dh_BTF)


_up_activation.defvjp(_up_activation_fwd, _up_activation_bwd)


# options_up and options_down: the same recipe's options, each with its own layer class.
@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _mlp(x_BTD, w_up_DK, scales_up, w_down_FD, scales_down, kind, options_up, options_down, kernel, ops):
    return _mlp_fwd(x_BTD, w_up_DK, scales_up, w_down_FD, scales_down, kind, options_up, options_down, kernel, ops)[0]


def _mlp_fwd(x_BTD, w_up_DK, scales_up, w_down_FD, scales_down, kind, options_up, options_down, kernel, ops):
    del kernel
    y_BTK, up_res = _up_forward(x_BTD, w_up_DK, scales_up, options_up, ops)
    sx_down = ops.scales_of(options_down, scales_down)[0]
    qh_BTF, amax_h = activation_e4m3(y_BTK, kind, sx_down)
    out_BTD, down_res = ops.forward_quantized(qh_BTF, amax_h, jnp.bfloat16, w_down_FD, options_down, scales_down)
    return checkpoint_name(out_BTD, GEMM_OUT), (up_res, y_BTK, down_res)


def _mlp_bwd(kind, options_up, options_down, kernel, ops, residuals, dout_BTD):
    up_res, y_BTK, down_res = residuals
    if not kernel:
        dh_BTF, dw_down, amaxes_down = ops.backward(options_down, down_res, dout_BTD)
        dx_BTD, dw_up, amaxes_up = _up_backward(kind, options_up, ops, up_res, y_BTK, dh_BTF)
        return dx_BTD, dw_up, amaxes_up, dw_down, amaxes_down
    # mlp_down's dgrad first: the kernel needs dh, and stores mlp_down's input transposed for its
    # wgrad along with mlp_up's dY in both layouts.
    qdout_BTD, amax_dout = ops.quantize_dy(down_res, dout_BTD)
    dh_BTF = ops.dgrad(options_down, down_res, qdout_BTD)
    qdy_BTK, qdy_t_KM, qh_t_FM, amax_dy = mlp_grad_kernel.activation_grad_fp8(
        y_BTK, dh_BTF, ops.dy_scale(up_res), ops.x_scale(down_res), kind,
        not on_gpu())
    dw_down, amaxes_down = ops.wgrad(options_down, down_res, qdout_BTD, amax_dout, qx_t_KM=qh_t_FM)
    dx_BTD, dw_up, amaxes_up = ops.backward_quantized(options_up, up_res, qdy_BTK, amax_dy, qdy_t_KM)
    return dx_BTD, dw_up, amaxes_up, dw_down, amaxes_down


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def _bf16_bits(x_f32: jax.Array) -> jax.Array:
    """x rounded to BF16, as its 16 bits in the low half of a uint32."""
    return jax.lax.bitcast_convert_type(x_f32.astype(jnp.bfloat16), jnp.uint16).astype(jnp.uint32)


def _widened(bits_u32: jax.Array) -> jax.Array:
    """The BF16 value in ``bits_u32``'s low half, exactly, as FP32. Going through the bits keeps
    the BF16 rounding: XLA may drop an ``f32 -> bf16 -> f32`` round trip of converts (it allows
    excess precision), and the BF16 path casts the rounded value."""
    return jax.lax.bitcast_convert_type(bits_u32 << 16, jnp.float32)


def _e5m2_bits(v_f32: jax.Array, scale: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(cast_fp8(v_f32, scale, FP8_E5M2), jnp.uint8).astype(jnp.uint16)


def swiglu_grad_e5m2(gate_up_BTF2: jax.Array, dh_BTF: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """SwiGLU's BF16 input gradient (``activations.swiglu_grad_bf16_pairs``) stored in E5M2 with
    ``scale``: ``(f8e5m2[..., F, 2], max |gradient|)``. Each (gate, up) pair's two FP8 bytes are
    packed into one 16-bit word, element 0 in the low byte, as the BF16 pairs are unpacked."""
    g, u = activations.bf16_pairs_as_fp32(gate_up_BTF2)
    sig = jax.nn.sigmoid(g)
    dh = dh_BTF.astype(jnp.float32)
    d_gate = _widened(_bf16_bits(dh * (u * sig * (1.0 + g * (1.0 - sig)))))
    d_up = _widened(_bf16_bits(dh * (g * sig)))
    amax = jnp.max(jnp.maximum(jnp.abs(d_gate), jnp.abs(d_up)))
    words = _e5m2_bits(d_gate, scale) | (_e5m2_bits(d_up, scale) << 8)
    # The barrier keeps the FP8 tensor a GEMM operand of its own, as quantize_fp8's does.
    return jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(words, FP8_E5M2)), amax


def relu2_grad_e5m2(a_BTF: jax.Array, dh_BTF: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The squared ReLU's BF16 input gradient (``activations.relu2``'s) stored in E5M2 with ``scale``:
    ``(f8e5m2[..., F], max |gradient|)``."""
    da = _widened(_bf16_bits(2.0 * jax.nn.relu(a_BTF.astype(jnp.float32)) * dh_BTF.astype(jnp.float32)))
    return jax.lax.optimization_barrier(cast_fp8(da, scale, FP8_E5M2)), jnp.max(jnp.abs(da))


def activation_e4m3(y_BTK: jax.Array, kind: str, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The activation of mlp_up's BF16 output (``activations.swiglu_product`` or ``relu2``, in
    FP32), rounded to BF16 as the BF16 path hands it to mlp_down, stored in E4M3 with ``scale``:
    ``(f8e4m3fn[..., F], max |bf16 activation|)``."""
    if kind == "swiglu":
        g, u = activations.bf16_pairs_as_fp32(y_BTK.reshape(*y_BTK.shape[:-1], -1, 2))
        h = jax.nn.silu(g) * u
    else:
        h = jnp.square(jax.nn.relu(y_BTK.astype(jnp.float32)))
    r = _widened(_bf16_bits(h))
    return jax.lax.optimization_barrier(cast_fp8(r, scale, FP8_E4M3)), jnp.max(jnp.abs(r))
