"""The recipes a policy may name, one line each (the records live in maxfp4.precision.recipes)."""

from __future__ import annotations

from maxfp4.precision.recipes import Recipe, bf16, fp32, fp8, fp8_block, mx, nvfp4

RECIPES: dict[str, Recipe] = {
    "bf16": bf16.BF16,
    "fp32": fp32.FP32,
    "fp8_delayed": fp8.FP8_DELAYED,
    "fp8_current": fp8.FP8_CURRENT,
    "nvfp4": nvfp4.NVFP4,
    "mxfp8": mx.MXFP8,
    "mxfp4": mx.MXFP4,
    "fp8_block": fp8_block.FP8_BLOCK,
}
