"""Operand hooks a recipe may offer to layers that fuse its casts into their own kernels.

A layer next to a kernel with a VJP of its own (the MLP's activation, the attention's QKV
epilogue, the Mamba-2 mixer) can have that kernel store the GEMM's low-precision operands
directly instead of a BF16 tensor that a separate pass reads again to cast. The layer asks
:meth:`maxfp4.precision.LayerPrecision.fused` for these hooks and never names a recipe; a
recipe without them (or without its scaling state at hand) gets the plain ``dot`` path.

Signatures (``options``: the recipe's hashable options, ``scales``: the layer's state):
``forward(x, w, options, scales) -> (y, residuals)``; ``scales_of(options, scales) -> [sx, sw, sdy]``;
``forward_quantized(qx, amax_x, x_dtype, w, options, scales) -> (y, residuals)``;
``dy_scale(residuals)``, ``x_scale(residuals)``; ``quantize_dy(residuals, dy) -> (qdy, amax)``;
``backward(options, residuals, dy)`` and ``backward_quantized(options, residuals, qdy, amax_dy,
qdy_t_NM=None) -> (dx, dw, amaxes)``; ``dgrad(options, residuals, qdy) -> dx``;
``wgrad(options, residuals, qdy, amax_dy, qdy_t_NM=None, qx_t_KM=None) -> (dw, amaxes)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class FusedOperands:
    """A recipe's operand hooks (hashable: passed to custom VJPs as a static argument)."""

    recipe: str
    x_format: Any  # the element type x and w are stored in (formats.FP8_E4M3, ...)
    dy_format: Any  # the element type dY is stored in
    forward: Callable
    scales_of: Callable
    forward_quantized: Callable
    dy_scale: Callable
    x_scale: Callable
    quantize_dy: Callable
    backward: Callable
    backward_quantized: Callable
    dgrad: Callable
    wgrad: Callable
