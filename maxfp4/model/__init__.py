"""Models: every linear layer goes through ``maxfp4.precision.dot``.

:func:`get_model` picks the family from ``model.kind``; both expose the same functions.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from maxfp4.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class ModelFns:
    init_params: Callable  # (cfg, key) -> params
    param_axes: Callable  # (cfg) -> logical axes tree
    forward: Callable  # (params, inputs, positions, segment_ids, *, cfg, policy, ...) -> logits
    forward_embedded: Callable
    block_layer_classes: tuple[str, ...]  # the precision classes a block of this model has


def get_model(cfg: ModelConfig) -> ModelFns:
    if cfg.kind == "hybrid":
        from maxfp4.model import hybrid
        return ModelFns(hybrid.init_params, hybrid.param_axes, hybrid.forward, hybrid.forward_embedded,
                        hybrid.block_layer_classes(cfg))
    from maxfp4.model import decoder
    return ModelFns(decoder.init_params, decoder.param_axes, decoder.forward, decoder.forward_embedded,
                    decoder.BLOCK_LAYER_CLASSES)
