"""FP32: FP32 operands at the highest precision (the mixture-of-experts router's default)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxfp4.precision import catalog
from maxfp4.precision.recipes import Recipe
from maxfp4.precision.recipes.grouped import fp32_grouped


def fp32_dot(x, w, options=(), scales=None, key=None):
    """``x @ w`` in FP32 with FP32 accumulation; plain autodiff gives FP32 gradient GEMMs."""
    del options, scales, key
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


FP32 = Recipe(catalog.FP32, fp32_dot, grouped=fp32_grouped)
