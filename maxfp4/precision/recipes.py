"""Linear-layer recipes: how the operands of Y = X W (and its two gradient GEMMs) are quantized.

A recipe is a function ``(x_MK, w_KN, options) -> y_MN`` whose backward pass defines how dgrad
and wgrad are computed. Master weights arrive in FP32 and gradients leave in FP32.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

COMPUTE_DTYPE = jnp.bfloat16


def bf16_dot(x: jax.Array, w: jax.Array, options: dict | None = None) -> jax.Array:
    """BF16 operands, FP32 accumulation, BF16 result. Autodiff gives BF16 dgrad/wgrad GEMMs
    whose weight gradient is returned in the master weight's FP32."""
    del options
    y = jax.lax.dot_general(
        x.astype(COMPUTE_DTYPE),
        w.astype(COMPUTE_DTYPE),
        (((x.ndim - 1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return y.astype(COMPUTE_DTYPE)


# name -> (function, default options)
RECIPES: dict[str, tuple[Callable, dict]] = {
    "bf16": (bf16_dot, {}),
}
