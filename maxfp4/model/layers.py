"""Building blocks shared by the model families: the parameter types every module holds
(``Linear``, ``RMSNorm``, ``Embedding``, plain ``nnx.Param``), each with its logical axes as
sharding metadata, and the functions between the GEMMs.

Dimension letters: B batch, T sequence, D d_model, N query heads, K kv heads, G query heads per
kv head (N = K*G), H head dim, F MLP hidden, V vocabulary, L blocks.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from maxfp4.parallel.mesh import constrain, lookup_specs, traced_mesh
from maxfp4.model import fp8_mlp
from maxfp4.model_spec import LinearSpec
from maxfp4.model.activations import relu2, swiglu_product
from maxfp4.precision import LayerPrecision

ACT_DTYPE = jnp.bfloat16


# Parameters are leaves of the module that owns them, named as in checkpoints and the export
# (``blocks/w_qkv``), so a layer's weight is a Param type of its own rather than a submodule,
# which would add a level to every name. ``logical_axes`` metadata names each dimension for
# parallel/mesh.py's one table; it is not flax's ``out_sharding``, which flax would resolve against the
# mesh itself (eagerly at creation, and in ``nnx.eval_shape`` under a mesh).

def param(value: jax.Array, axes: tuple[str | None, ...], kind: type = nnx.Param, **metadata) -> nnx.Param:
    """``value`` as a ``kind`` parameter with the logical ``axes`` (one name or None a dimension)."""
    if len(axes) != value.ndim:
        raise ValueError(f"logical axes {axes} for a parameter of shape {value.shape}")
    return kind(value, logical_axes=tuple(axes), **metadata)


class Linear(nnx.Param):
    """A linear layer's FP32 master weight, [in, out...] (stacked: [L, in, out...]), that knows
    its precision class (``layer_class``); calling it runs the recipe the policy gives that
    class (:meth:`LayerPrecision.dot`). Layers that fuse a GEMM with its neighbours read the
    weight (``self[...]``) and ask ``lp.fused(layer_class)`` for the recipe's operand hooks."""

    def __call__(self, x: jax.Array, lp: LayerPrecision) -> jax.Array:
        w = self[...]
        return lp.dot(x, w.reshape(w.shape[0], -1), self.layer_class)


def linear(key: jax.Array, spec: LinearSpec, n: int | None, *, std: float) -> Linear:
    """The weight of the linear layer ``spec`` (maxfp4.model_spec), ``n`` of them stacked (None: one)."""
    shape, axes = stacked(n, spec.shape, spec.axes)
    return param(normal_init(key, shape, std), axes, Linear, layer_class=spec.layer_class)


class RMSNorm(nnx.Param):
    """An RMSNorm's FP32 scale [D] (stacked: [L, D]), ones at init."""

    def __call__(self, x_BTD: jax.Array, eps: float) -> jax.Array:
        return rms_norm(x_BTD, self[...], eps)


def norm_scale(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> RMSNorm:
    return param(jnp.ones(shape, jnp.float32), axes, RMSNorm)


class Embedding(nnx.Param):
    """The token embedding [V, D]; calling it looks tokens up, in the activation dtype."""

    def __call__(self, inputs_BT: jax.Array) -> jax.Array:
        return embed_tokens(self[...], inputs_BT)


def embed_tokens(table_VD: jax.Array, inputs: jax.Array) -> jax.Array:
    """The rows of the embedding table for ``inputs`` (any shape), in the activation dtype."""
    mesh = traced_mesh()
    if inputs.ndim != 2 or mesh is None:
        return jnp.take(table_VD, inputs, axis=0).astype(ACT_DTYPE)
    # [B, T] tokens under a mesh: looked up where the table's d_model part lives (the ids
    # gathered there, small integers), then moved towards the activations' [batch, seq] by
    # all-to-alls (lookup_specs). Left to itself, XLA's partitioner could not go between the
    # table's d_model split over fsdp (and context) and the rows' batch split over it: it
    # gathered the whole [B, T, D] rows (forward) and their FP32 gradient (backward) on every
    # device.
    specs = lookup_specs(table_VD.shape, inputs.shape, mesh)
    inputs = jax.lax.with_sharding_constraint(inputs, NamedSharding(mesh, PartitionSpec(specs[0][0], None)))
    rows = jnp.take(table_VD, inputs, axis=0)
    for spec in specs:
        rows = jax.lax.with_sharding_constraint(rows, NamedSharding(mesh, spec))
    return rows.astype(ACT_DTYPE)


def stacked(n: int | None, shape: tuple[int, ...], axes: tuple[str | None, ...]):
    """(shape, axes) of ``n`` layers' parameters stacked on a leading ``layers`` axis (None: one)."""
    if n is None:
        return shape, axes
    return (n, *shape), ("layers", *axes)


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
    # summed over the token dims in place: flattening them first made XLA gather a sequence
    # split over context whole on every rank
    dscale_D = jnp.sum(dy * xhat, axis=tuple(range(xhat.ndim - 1)))
    dxhat = dy * scale_D.astype(jnp.float32)
    dx = rinv_BT1 * (dxhat - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
    return dx.astype(x_BTD.dtype), dscale_D.astype(scale_D.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


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


def _up_activation(x_BTD: jax.Array, w_up_DK: jax.Array, lp: LayerPrecision, kind: str) -> jax.Array:
    """The activation of mlp_up's output, FP32 [B, T, F]; with FP8 delayed scaling on mlp_up,
    one VJP whose backward stores mlp_up's output gradient in E5M2 itself (``fp8_mlp``)."""
    if fp8_mlp.up_fused(lp):
        return fp8_mlp.up_activation(x_BTD, w_up_DK, lp, kind)
    y_BTK = lp.dot(x_BTD, w_up_DK, "mlp_up")
    if kind == "swiglu":
        return swiglu_product(y_BTK.reshape(*y_BTK.shape[:-1], -1, 2))
    return relu2(y_BTK)


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
    if not smooth and fp8_mlp.mlp_fused(lp):
        return fp8_mlp.mlp(x_BTD, w_up_DF2.reshape(d, 2 * f), w_down_FD, lp, "swiglu")
    h_BTF = _up_activation(x_BTD, w_up_DF2.reshape(d, 2 * f), lp, "swiglu")
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
    if fp8_mlp.mlp_fused(lp):
        return fp8_mlp.mlp(x_BTD, w_up_DF1.reshape(d, f), w_down_FD, lp, "relu2")
    h_BTF = _up_activation(x_BTD, w_up_DF1.reshape(d, f), lp, "relu2")
    return lp.dot(h_BTF.astype(ACT_DTYPE), w_down_FD, "mlp_down")


def mlp_block(x_BTD: jax.Array, w_up: jax.Array, w_down_FD: jax.Array, lp: LayerPrecision,
              kind: str = "swiglu", smooth: bool = False) -> jax.Array:
    if kind == "relu2":
        return relu2_mlp(x_BTD, w_up, w_down_FD, lp)
    return swiglu_mlp(x_BTD, w_up, w_down_FD, lp, smooth=smooth)


def head_precision(cfg, policy, scales: dict, key: jax.Array) -> LayerPrecision:
    """The LM head's precision (class ``lm_head``, not a block): its key follows the blocks'."""
    return LayerPrecision(policy, None, {"lm_head": scales["lm_head"]} if "lm_head" in scales else None,
                          jax.random.fold_in(key, cfg.n_layers))


def output_logits(params: dict, x_BTD: jax.Array, *, cfg, policy, scales: dict, key: jax.Array) -> jax.Array:
    """Final RMSNorm and the LM head over the parameter pytree: logits [B, T, V]
    (``LanguageModel.logits`` on the module)."""
    x_BTD = rms_norm(x_BTD, params["final_norm"], cfg.norm_eps)
    head = head_precision(cfg, policy, scales, key)
    return constrain(head.dot(x_BTD, params["lm_head"], "lm_head"), ("batch", "seq", "vocab"))
