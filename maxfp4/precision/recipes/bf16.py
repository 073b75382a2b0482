"""BF16: BF16 operands, FP32 accumulation. The reference recipe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxfp4.precision import catalog
from maxfp4.precision.recipes.grouped import bf16_grouped
from maxfp4.precision.recipes import COMPUTE_DTYPE, GEMM_IN, GEMM_WEIGHT, TN, Recipe, dtype_token, flat, unflat


@jax.custom_vjp
def _bf16(x, w):
    return _bf16_fwd(x, w)[0]


def _bf16_fwd(x, w):
    x_MK, w_KN = flat(x).astype(COMPUTE_DTYPE), w.astype(COMPUTE_DTYPE)
    y = jnp.dot(x_MK, w_KN, preferred_element_type=COMPUTE_DTYPE)
    return unflat(y, x.shape[:-1]), (checkpoint_name(x_MK, GEMM_IN), checkpoint_name(w_KN, GEMM_WEIGHT),
                                                  dtype_token(x.dtype))


def _bf16_bwd(res, dy):
    x_MK, w_KN, x_token = res
    dy_MN = flat(dy).astype(COMPUTE_DTYPE)
    # Written out so that both gradient GEMMs are BF16 x BF16: plain autodiff of a dot with an
    # FP32 result feeds an FP32 cotangent into them and runs them as FP32 GEMMs.
    dx = jax.lax.dot_general(dy_MN, w_KN, TN, preferred_element_type=COMPUTE_DTYPE)
    dw = jax.lax.dot_general(x_MK, dy_MN, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return unflat(dx, dy.shape[:-1]).astype(x_token.dtype), dw


_bf16.defvjp(_bf16_fwd, _bf16_bwd)


def bf16_dot(x, w, options=(), scales=None, key=None):
    """BF16 operands, FP32 accumulation; BF16 output and input gradient, FP32 weight gradient."""
    del options, scales, key
    return _bf16(x, w)


BF16 = Recipe(catalog.BF16, bf16_dot, grouped=bf16_grouped)
