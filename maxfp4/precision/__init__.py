"""Per-layer precision: every linear layer of every model calls :func:`dot`."""

from __future__ import annotations

import jax

from maxfp4.precision.policy import PrecisionPolicy, resolve_policy
from maxfp4.precision.recipes import RECIPES


def dot(x: jax.Array, w: jax.Array, layer_class: str, layer_index: int | None,
        policy: PrecisionPolicy) -> jax.Array:
    """``x[..., K] @ w[K, N]`` with the recipe the policy chose for (layer_class, layer_index)."""
    recipe = policy.recipe_for(layer_class, layer_index)
    fn, _ = RECIPES[recipe]
    return fn(x, w, policy.options_for(recipe))


__all__ = ["dot", "PrecisionPolicy", "resolve_policy"]
