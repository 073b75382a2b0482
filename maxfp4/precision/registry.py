"""The recipes a policy may name: name -> (function, default options)."""

from __future__ import annotations

from typing import Callable

from maxfp4.precision.compare import (FP8_BLOCK_DEFAULTS, MXFP4_DEFAULTS, MXFP8_DEFAULTS, fp8_block_dot,
                                      mxfp4_dot, mxfp8_dot)
from maxfp4.precision.fused import FusedOperands
from maxfp4.precision.recipes import (FP8_CURRENT_DEFAULTS, FP8_DELAYED_DEFAULTS, FP8_DELAYED_FUSED, NVFP4_DEFAULTS, bf16_dot,
                                      fp8_current_dot, fp8_delayed_dot, nvfp4_dot)

RECIPES: dict[str, tuple[Callable, dict]] = {
    "bf16": (bf16_dot, {}),
    "fp8_delayed": (fp8_delayed_dot, FP8_DELAYED_DEFAULTS),
    "fp8_current": (fp8_current_dot, FP8_CURRENT_DEFAULTS),
    "nvfp4": (nvfp4_dot, NVFP4_DEFAULTS),
    # Comparison recipes (maxfp4.precision.compare): emulated, for numerics studies.
    "mxfp8": (mxfp8_dot, MXFP8_DEFAULTS),
    "mxfp4": (mxfp4_dot, MXFP4_DEFAULTS),
    "fp8_block": (fp8_block_dot, FP8_BLOCK_DEFAULTS),
}

# Recipes that carry state from step to step (maxfp4.precision.state).
STATEFUL_RECIPES = ("fp8_delayed",)

# Recipes whose operands a layer may store from its own kernels (maxfp4.precision.fused).
FUSED_OPERANDS: dict[str, FusedOperands] = {"fp8_delayed": FP8_DELAYED_FUSED}

