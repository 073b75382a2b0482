"""Grouped GEMMs for mixture-of-experts layers: ``y[m] = x[m] @ w[g(m)]`` over tokens sorted by
expert, ``g(m)`` the group whose run of ``sizes_G`` rows holds row m (rows past the last group
give 0). The three GEMMs of a linear layer become three ``jax.lax.ragged_dot`` products:
fprop ``ragged(X, W)``, dgrad ``ragged(dY, W^T)`` and wgrad ``dW[g] = X_g^T dY_g``
(``ragged_dot_general`` with the tokens as the ragged contracting dim).

Each recipe's grouped form quantizes its operands as its dense form does (same formats, same
scale rules), with one scale per expert where an expert's weight is a tensor of its own:

- ``bf16``: BF16 operands, FP32 accumulation, FP32 weight gradient.
- ``fp8_current``: x and dY per tensor, each expert's weight with the scale of its own amax.
- ``fp8_delayed``: the layer's per-tensor scales (x, w, dY) from its delayed-scaling state;
  this step's amaxes leave as the scales' cotangent, as the dense recipe's do.
- ``nvfp4``: 1D blocks of 16 along K for x and dY (dY stochastically rounded), 16x16 tiles
  and a global scale per expert for W; the wgrad operands in blocks of 16 tokens. No Hadamard
  transform on the wgrad: a 16-token block may straddle two experts, and H^T H = I holds only
  over whole blocks (docs/MOE.md).

The quantized operands are multiplied exactly in BF16 (FP8 and block-dequantized NVFP4 values
are BF16 numbers) with FP32 accumulation, and the FP32 scales multiply the result per row. The
``gemm`` argument picks the kernels: ``xla`` (``jax.lax.ragged_dot``, FP32 outputs) or ``mosaic``
(maxfp4.kernels.grouped_gemm on Hopper: BF16 outputs, so the scales multiply a BF16 product and
the weight gradient is BF16-rounded); ``model.moe.grouped_gemm`` chooses (maxfp4.model.moe).

Dimension letters: M token-expert rows (sorted by expert), K input features, N output
features, G experts (groups).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from maxfp4.kernels import grouped_gemm
from maxfp4.precision import formats as F
from maxfp4.precision.recipes import COMPUTE_DTYPE, amax, delayed_scales, dtype_token, power_2_scale

_WGRAD_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def ragged(x_MK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array, gemm: str = "xla") -> jax.Array:
    """FP32 ``x[m] @ w[g(m)]`` of BF16 operands (``gemm``: module docstring)."""
    x, w = x_MK.astype(COMPUTE_DTYPE), w_GKN.astype(COMPUTE_DTYPE)
    if gemm == "mosaic":
        return grouped_gemm.ragged(x, w, sizes_G).astype(jnp.float32)
    return jax.lax.ragged_dot(x, w, sizes_G, preferred_element_type=jnp.float32)


def ragged_t(dy_MN: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array, gemm: str = "xla") -> jax.Array:
    """FP32 ``dy[m] @ w[g(m)]^T``."""
    if gemm == "mosaic":
        return grouped_gemm.ragged_t(dy_MN.astype(COMPUTE_DTYPE), w_GKN.astype(COMPUTE_DTYPE),
                                     sizes_G).astype(jnp.float32)
    return ragged(dy_MN, jnp.swapaxes(w_GKN, 1, 2), sizes_G)


def ragged_wgrad(x_MK: jax.Array, dy_MN: jax.Array, sizes_G: jax.Array, gemm: str = "xla") -> jax.Array:
    """FP32 ``dW[g] = X_g^T dY_g`` [G, K, N]."""
    x, dy = x_MK.astype(COMPUTE_DTYPE), dy_MN.astype(COMPUTE_DTYPE)
    if gemm == "mosaic":
        return grouped_gemm.ragged_wgrad(x, dy, sizes_G).astype(jnp.float32)
    return jax.lax.ragged_dot_general(x, dy, sizes_G, _WGRAD_DIMS, preferred_element_type=jnp.float32)


def row_groups(sizes_G: jax.Array, m: int) -> jax.Array:
    """The group of each of ``m`` rows (rows past the last group: the last group, whose GEMM
    output there is 0 anyway)."""
    ends_G = jnp.cumsum(sizes_G)
    return jnp.minimum(jnp.searchsorted(ends_G, jnp.arange(m), side="right"), sizes_G.shape[0] - 1)


# ----------------------------------------------------------------------------- bf16

@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _bf16(x_MK, w_GKN, sizes_G, gemm):
    return _bf16_fwd(x_MK, w_GKN, sizes_G, gemm)[0]


def _bf16_fwd(x_MK, w_GKN, sizes_G, gemm):
    x, w = x_MK.astype(COMPUTE_DTYPE), w_GKN.astype(COMPUTE_DTYPE)
    return ragged(x, w, sizes_G, gemm).astype(COMPUTE_DTYPE), (x, w, sizes_G, dtype_token(x_MK.dtype))


def _bf16_bwd(gemm, res, dy_MN):
    x, w, sizes_G, x_token = res
    dy = dy_MN.astype(COMPUTE_DTYPE)
    dx = ragged_t(dy, w, sizes_G, gemm).astype(x_token.dtype)
    return dx, ragged_wgrad(x, dy, sizes_G, gemm), None


_bf16.defvjp(_bf16_fwd, _bf16_bwd)


def bf16_grouped(x_MK, w_GKN, sizes_G, options=(), scales=None, key=None, gemm="xla"):
    del options, scales, key
    return _bf16(x_MK, w_GKN, sizes_G, gemm)


def fp32_grouped(x_MK, w_GKN, sizes_G, options=(), scales=None, key=None, gemm="xla"):
    """FP32 at the highest precision; plain autodiff of ``ragged_dot`` (never the BF16 kernel)."""
    del options, scales, key, gemm
    return jax.lax.ragged_dot(x_MK.astype(jnp.float32), w_GKN.astype(jnp.float32), sizes_G,
                              precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------- fp8

def _quantize_experts(w_GKN, sw_G):
    return F.quantize_fp8(w_GKN, sw_G[:, None, None], F.FP8_E4M3)


def _reciprocal(a, b, given=None):
    """``1 / (a * b)`` correctly rounded (``formats.div_rn``), or ``given`` (the same value
    computed once for a class's layers by :func:`fp8_delayed_grouped_with_reciprocals`)
    broadcast to the product's shape."""
    product = a * b
    return F.div_rn(1.0, product) if given is None else jnp.broadcast_to(given, product.shape)


def _fp8_fprop(qx_MK, sx, qw_GKN, sw_G, sizes_G, gemm, inv_xw=None):
    groups_M = row_groups(sizes_G, qx_MK.shape[0])
    inv_M = _reciprocal(sx, sw_G, inv_xw)[groups_M]
    return (ragged(qx_MK, qw_GKN, sizes_G, gemm) * inv_M[:, None]).astype(COMPUTE_DTYPE)


def _fp8_backward(qdy_MN, sdy, qx_MK, sx, qw_GKN, sw_G, sizes_G, gemm, inv_dyw=None, inv_xdy=None):
    groups_M = row_groups(sizes_G, qdy_MN.shape[0])
    dx = ragged_t(qdy_MN, qw_GKN, sizes_G, gemm) * _reciprocal(sdy, sw_G, inv_dyw)[groups_M][:, None]
    dw = ragged_wgrad(qx_MK, qdy_MN, sizes_G, gemm) * _reciprocal(sx, sdy, inv_xdy)
    return dx, dw


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fp8_current(x_MK, w_GKN, sizes_G, power_2, gemm):
    return _fp8_current_fwd(x_MK, w_GKN, sizes_G, power_2, gemm)[0]


def _fp8_current_fwd(x_MK, w_GKN, sizes_G, power_2, gemm):
    sx = F.scale_from_amax(amax(x_MK), F.FP8_E4M3, power_2=power_2)
    sw_G = F.scale_from_amax(jnp.max(jnp.abs(w_GKN), axis=(1, 2)), F.FP8_E4M3, power_2=power_2)
    qx, qw = F.quantize_fp8(x_MK, sx, F.FP8_E4M3), _quantize_experts(w_GKN, sw_G)
    return _fp8_fprop(qx, sx, qw, sw_G, sizes_G, gemm), (qx, sx, qw, sw_G, sizes_G, dtype_token(x_MK.dtype))


def _fp8_current_bwd(power_2, gemm, res, dy_MN):
    qx, sx, qw, sw_G, sizes_G, x_token = res
    sdy = F.scale_from_amax(amax(dy_MN), F.FP8_E5M2, power_2=power_2)
    dx, dw = _fp8_backward(F.quantize_fp8(dy_MN, sdy, F.FP8_E5M2), sdy, qx, sx, qw, sw_G, sizes_G, gemm)
    return dx.astype(x_token.dtype), dw, None


_fp8_current.defvjp(_fp8_current_fwd, _fp8_current_bwd)


def fp8_current_grouped(x_MK, w_GKN, sizes_G, options=(), scales=None, key=None, gemm="xla"):
    del scales, key
    return _fp8_current(x_MK, w_GKN, sizes_G, power_2_scale(options), gemm)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fp8_delayed(x_MK, w_GKN, sizes_G, scales, gemm):
    return _fp8_delayed_fwd(x_MK, w_GKN, sizes_G, scales, gemm)[0]


def _given_reciprocals(scales):
    """The three reciprocals (x w, dY w, x dY) that came with the scales, else Nones."""
    return tuple(scales[3:]) if scales.shape[-1] == 6 else (None, None, None)


def _fp8_delayed_fwd(x_MK, w_GKN, sizes_G, scales, gemm):
    sx, sw, _ = scales[0], scales[1], scales[2]
    sw_G = jnp.broadcast_to(sw, (w_GKN.shape[0],))
    qx, qw = F.quantize_fp8(x_MK, sx, F.FP8_E4M3), _quantize_experts(w_GKN, sw_G)
    amax_xw = jnp.stack([amax(x_MK), amax(w_GKN)])
    return (_fp8_fprop(qx, sx, qw, sw_G, sizes_G, gemm, _given_reciprocals(scales)[0]),
            (qx, qw, sw_G, sizes_G, scales, amax_xw, dtype_token(x_MK.dtype)))


def _fp8_delayed_bwd(gemm, res, dy_MN):
    qx, qw, sw_G, sizes_G, scales, amax_xw, x_token = res
    sdy = scales[2]
    _, inv_dyw, inv_xdy = _given_reciprocals(scales)
    dx, dw = _fp8_backward(F.quantize_fp8(dy_MN, sdy, F.FP8_E5M2), sdy, qx, scales[0], qw, sw_G, sizes_G, gemm,
                           inv_dyw, inv_xdy)
    # The scales' "gradient" is this step's amaxes (x, w, dY), as in recipes.fp8; zero for the
    # reciprocals where the scales came with them.
    return dx.astype(x_token.dtype), dw, None, jnp.concatenate([amax_xw, amax(dy_MN)[None], jnp.zeros_like(scales[3:])])


_fp8_delayed.defvjp(_fp8_delayed_fwd, _fp8_delayed_bwd)


def fp8_delayed_grouped(x_MK, w_GKN, sizes_G, options=(), scales=None, key=None, gemm="xla"):
    """``scales``: f32[3] (x, w, dY), or f32[6] with the reciprocals of
    :func:`fp8_delayed_grouped_with_reciprocals` appended."""
    del key
    if scales is None:
        raise ValueError("fp8_delayed needs its scaling state (scales f32[3])")
    return _fp8_delayed(x_MK, w_GKN, sizes_G, jnp.concatenate([delayed_scales(scales, options), scales[3:]]), gemm)


def fp8_delayed_grouped_with_reciprocals(scales_X3: jax.Array, options) -> jax.Array:
    """[..., 3] scales of an expert class -> [..., 6]: the scales, then the exact reciprocals of
    the products its three GEMMs dequantize with (x w, dY w, x dY), computed once for the
    class's [L, 3] array rather than in every layer (recipes.fp8.fp8_delayed_with_reciprocals
    says why). No gradient reaches them."""
    s = delayed_scales(scales_X3, options)
    sx, sw, sdy = s[..., 0], s[..., 1], s[..., 2]
    inv = F.div_rn(1.0, jnp.stack([sx * sw, sdy * sw, sx * sdy], axis=-1))
    return jnp.concatenate([scales_X3, jax.lax.stop_gradient(inv)], axis=-1)


# ----------------------------------------------------------------------------- nvfp4

def _pad_rows(a_MK: jax.Array, block: int = F.NVFP4_BLOCK) -> jax.Array:
    return jnp.pad(a_MK, ((0, -a_MK.shape[0] % block), (0, 0)))


def _experts_2d(w_GKN, two_d: bool):
    """(block-dequantized BF16 [G, K, N], global decode scale per expert [G])."""
    q = jax.vmap(lambda w: F.quantize_nvfp4(w, two_d=two_d))(w_GKN)
    return q.block_dequantize(COMPUTE_DTYPE), q.global_decode_scale


@partial(jax.custom_vjp, nondiff_argnums=(3, 5))
def _nvfp4(x_MK, w_GKN, sizes_G, sr, key, gemm):
    return _nvfp4_fwd(x_MK, w_GKN, sizes_G, sr, key, gemm)[0]


def _nvfp4_fwd(x_MK, w_GKN, sizes_G, sr, key, gemm):
    qx = F.quantize_nvfp4(x_MK)
    vw, dec_w_G = _experts_2d(w_GKN, True)
    groups_M = row_groups(sizes_G, x_MK.shape[0])
    y = ragged(qx.block_dequantize(COMPUTE_DTYPE), vw, sizes_G, gemm) * qx.global_decode_scale
    return (y * dec_w_G[groups_M][:, None]).astype(COMPUTE_DTYPE), (x_MK, vw, dec_w_G, sizes_G, key)


def _nvfp4_bwd(sr, gemm, res, dy_MN):
    x_MK, vw, dec_w_G, sizes_G, key = res
    k_dgrad, k_wgrad = jax.random.split(key) if sr else (None, None)
    m = dy_MN.shape[0]
    qdy = F.quantize_nvfp4(dy_MN, key=k_dgrad)  # blocks along N, dgrad's contraction
    groups_M = row_groups(sizes_G, m)
    dx = ragged_t(qdy.block_dequantize(COMPUTE_DTYPE), vw, sizes_G, gemm) * qdy.global_decode_scale
    dx = dx * dec_w_G[groups_M][:, None]
    # wgrad: blocks of 16 tokens; padded rows are zero and past every group.
    v_x, s_x = F.block_dequantize_nvfp4_columns(_pad_rows(x_MK), dtype=COMPUTE_DTYPE)
    v_dy, s_dy = F.block_dequantize_nvfp4_columns(_pad_rows(dy_MN), key=k_wgrad, dtype=COMPUTE_DTYPE)
    dw = (ragged_wgrad(v_x, v_dy, sizes_G, gemm) * s_x) * s_dy
    return dx.astype(x_MK.dtype), dw, None, None


_nvfp4.defvjp(_nvfp4_fwd, _nvfp4_bwd)


def nvfp4_grouped(x_MK, w_GKN, sizes_G, options=(), scales=None, key=None, gemm="xla"):
    del scales
    sr = bool(dict(options).get("stochastic_rounding", True))
    if sr and key is None:
        raise ValueError("nvfp4 with stochastic_rounding needs a PRNG key")
    return _nvfp4(x_MK, w_GKN, sizes_G, sr, key if sr else jnp.zeros((), jnp.uint32), gemm)
