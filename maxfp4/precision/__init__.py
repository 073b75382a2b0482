"""Per-layer precision: every linear layer of every model calls :func:`dot`.

The package imports nothing until a name is asked for, so that the JAX-free parts (``catalog``,
``policy``) can be imported by the config without JAX: ``from maxfp4.precision import
LayerPrecision`` loads :mod:`.layer` (and JAX) then.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "dot": "maxfp4.precision.layer", "LayerPrecision": "maxfp4.precision.layer", "GEMM_OUT": "maxfp4.precision.layer",
    "class_keys": "maxfp4.precision.layer", "fold_in_each": "maxfp4.precision.layer",
    # each recipe's operands, as its backward keeps them (remat policies name them)
    "GEMM_IN": "maxfp4.precision.recipes", "GEMM_WEIGHT": "maxfp4.precision.recipes",
    "FusedOperands": "maxfp4.precision.fused",
    "PrecisionPolicy": "maxfp4.precision.policy", "resolve_policy": "maxfp4.precision.policy",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'maxfp4.precision' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


__all__ = sorted(_HOMES)
