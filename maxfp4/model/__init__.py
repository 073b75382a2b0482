"""Models as Flax NNX modules; every linear layer goes through ``maxfp4.precision.dot``.

:func:`get_model` picks the family from ``model.kind``: its module type (``DenseLM`` or
``HybridLM``) and the functional face the trainer uses over the pure parameter pytree (each
function merges the pytree into the module where it runs, see :mod:`maxfp4.model.lm`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from maxfp4.config import ModelConfig
from maxfp4.model_spec import model_spec


@dataclasses.dataclass(frozen=True)
class ModelFns:
    init_params: Callable  # (cfg, key) -> params
    param_axes: Callable  # (cfg) -> logical axes tree
    forward: Callable  # (params, inputs, positions, segment_ids, *, cfg, policy, ...) -> logits
    forward_embedded: Callable
    block_layer_classes: tuple[str, ...]  # the precision classes its blocks have (maxfp4.model_spec)
    module: type  # the nnx.Module: module(cfg, key) builds it; lm.apply(module, params, cfg) wraps a pytree


def abstract_params(cfg: ModelConfig, sharding=None):
    """The parameter pytree's shapes and dtypes, nothing allocated; with ``sharding``, each leaf a
    ``ShapeDtypeStruct`` placed whole on it (what a checkpoint read or a placement needs)."""
    import jax

    shapes = jax.eval_shape(lambda k: get_model(cfg).init_params(cfg, k), jax.random.key(0))
    if sharding is None:
        return shapes
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)


def get_model(cfg: ModelConfig) -> ModelFns:
    classes = model_spec(cfg).block_classes
    if cfg.kind == "hybrid":
        from maxfp4.model import hybrid
        return ModelFns(hybrid.init_params, hybrid.param_axes, hybrid.forward, hybrid.forward_embedded,
                        classes, hybrid.HybridLM)
    from maxfp4.model import decoder
    return ModelFns(decoder.init_params, decoder.param_axes, decoder.forward, decoder.forward_embedded,
                    classes, decoder.DenseLM)
