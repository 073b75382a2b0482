"""What a linear layer calls: :func:`dot` and the per-block :class:`LayerPrecision`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxfp4.errors import ConfigError
from maxfp4.precision.catalog import LAYER_CLASS_OPTION, LAYER_CLASSES
from maxfp4.precision.fused import FusedOperands
from maxfp4.precision.policy import PrecisionPolicy
from maxfp4.precision.registry import RECIPES

# The name every linear layer's output carries, so a remat policy can keep it
# (train.remat=save_gemm, maxfp4.model.remat).
GEMM_OUT = "gemm_out"


def dot(x: jax.Array, w: jax.Array, layer_class: str, layer_index: int | None,
        policy: PrecisionPolicy, *, scales: jax.Array | None = None,
        key: jax.Array | None = None) -> jax.Array:
    """``x[..., K] @ w[K, N]`` with the recipe the policy chose for (layer_class, layer_index).

    ``scales`` (f32[3]) is the layer's delayed-scaling state, ``key`` seeds stochastic rounding.
    """
    recipe = policy.recipe_for(layer_class, layer_index)
    return RECIPES[recipe].dot(x, w, call_options(policy, recipe, layer_class), scales, key)


def call_options(policy: PrecisionPolicy, recipe: str, layer_class: str) -> tuple:
    """What a recipe's functions get as ``options``: the policy's options for the recipe, and the
    layer's class (``LAYER_CLASS_OPTION``), from which a recipe that gathers its quantized weight
    knows the weight's tensor-parallel split (maxfp4.parallel.mesh.gathered_weight_spec)."""
    return policy.options_tuple(recipe) + ((LAYER_CLASS_OPTION, layer_class),)


def grouped_recipes() -> tuple[str, ...]:
    """The recipes with a grouped GEMM (those an expert class may use)."""
    return tuple(name for name, r in RECIPES.items() if r.grouped is not None)


def fold_in_each(keys: jax.Array, n: int) -> jax.Array:
    """[..., n]: ``fold_in(key, i)`` for each key of ``keys`` [...] and each i < n, vectorized
    (the same keys as one ``fold_in`` at a time)."""
    fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    for _ in range(keys.ndim):
        fold = jax.vmap(fold, in_axes=(0, None))
    return fold(keys, jnp.arange(n, dtype=jnp.uint32))


def class_keys(block_keys: jax.Array) -> jax.Array:
    """[..., C]: each layer class's key for each block key of ``block_keys`` [...], ``fold_in``
    of the class's index in ``LAYER_CLASSES``, as ``LayerPrecision.class_key`` derives one.
    Derived for every block and class at once: one vectorized threefry, where a derivation per
    GEMM wrote scalar threefry instructions into each block's program (1,166 of a 4-block
    dense-1p3b NVFP4 step's 28,134 HLO instructions), which XLA merged across blocks into
    fusions of thousands of scalar instructions that its fusion passes are slow on."""
    return fold_in_each(block_keys, len(LAYER_CLASSES))


@dataclasses.dataclass(frozen=True)
class LayerPrecision:
    """What a block needs to run its linear layers: the policy, its index (the first block of
    its scan group: recipes are identical inside a group), its delayed-scaling scales by class,
    and a PRNG key from which each class derives its own; ``class_keys`` [C], where given, are
    those derivations made beforehand (:func:`class_keys`, the same keys)."""

    policy: PrecisionPolicy
    layer_index: int | None
    scales: dict[str, jax.Array] | None = None
    key: jax.Array | None = None
    class_keys: jax.Array | None = None

    def class_key(self, layer_class: str) -> jax.Array | None:
        """``layer_class``'s key: ``fold_in(key, its index in LAYER_CLASSES)``."""
        index = LAYER_CLASSES.index(layer_class)
        if self.class_keys is not None:
            return self.class_keys[index]
        return None if self.key is None else jax.random.fold_in(self.key, index)

    def fused(self, layer_class: str) -> FusedOperands | None:
        """The operand hooks of ``layer_class``'s recipe when it offers them and its scaling state
        is at hand (a model built without scales, as ``compare`` builds some, leaves the casts to
        the recipe's ``dot``); None: use :meth:`dot`."""
        if not self.scales or layer_class not in self.scales:
            return None
        return RECIPES[self.policy.recipe_for(layer_class, self.layer_index)].fused

    def options(self, layer_class: str) -> tuple:
        """The hashable options of ``layer_class``'s recipe (a static argument of its VJPs)."""
        return call_options(self.policy, self.policy.recipe_for(layer_class, self.layer_index), layer_class)

    def grouped_dot(self, x_MK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array, layer_class: str,
                    gemm: str = "xla") -> jax.Array:
        """``x[m] @ w[g(m)]`` over rows sorted by group (``sizes_G`` rows each), with the grouped
        form of ``layer_class``'s recipe (maxfp4.precision.recipes.grouped) on the ``gemm``
        kernels (xla or mosaic)."""
        recipe = self.policy.recipe_for(layer_class, self.layer_index)
        grouped = RECIPES[recipe].grouped
        if grouped is None:
            raise ConfigError(f"precision: recipe {recipe} on {layer_class} has no grouped GEMM; expected one of "
                              f"{', '.join(grouped_recipes())} for the expert classes")
        scales = None if self.scales is None else self.scales.get(layer_class)
        key = self.class_key(layer_class)
        y = grouped(x_MK, w_GKN, sizes_G, call_options(self.policy, recipe, layer_class), scales, key, gemm=gemm)
        return checkpoint_name(y, GEMM_OUT)

    def dot(self, x: jax.Array, w: jax.Array, layer_class: str) -> jax.Array:
        scales = None if self.scales is None else self.scales.get(layer_class)
        key = self.class_key(layer_class)
        y = dot(x, w, layer_class, self.layer_index, self.policy, scales=scales, key=key)
        return checkpoint_name(y, GEMM_OUT)
