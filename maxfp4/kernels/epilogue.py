"""An FP8 store for the Mamba-2 kernels next to an FP8 linear layer.

With the FP8 delayed-scaling recipe on in_proj, its output gradient (dY, [B, T, I]) is only ever
read by one cast to E5M2, with a scale fixed before the step; with it on out_proj, the gated
norm's output (out_proj's input, [B, T, E]) is only ever read by one cast to E4M3. The kernels
that produce them can store the FP8 values themselves, ``fp8(clip(v_bf16 * scale))`` exactly as
``maxfp4.precision.formats.quantize_fp8`` casts the BF16 tensor, and the max of |v_bf16| the
recipe's state needs: the BF16 copy and the pass that read it back are gone (one write and one
read a layer each).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from maxfp4.precision.formats import cast_fp8, quantize_fp8


class Quantize(NamedTuple):
    """Asked of a kernel: store this tensor as ``dtype`` (an FP8 type) with FP32 ``scale``."""
    scale: jax.Array
    dtype: Any


@dataclasses.dataclass(frozen=True)
class Quantized:
    """How a kernel stores one FP8 value: first rounded to ``rounded_dtype`` (the activation
    dtype the BF16 path stores), then scaled in FP32, clipped to the format's range and cast."""
    rounded_dtype: Any

    def round(self, v: jax.Array) -> jax.Array:
        return v.astype(self.rounded_dtype).astype(jnp.float32)

    @staticmethod
    def cast(v_rounded: jax.Array, scale: jax.Array, dtype) -> jax.Array:
        return cast_fp8(v_rounded, scale, dtype)


def quantize_rounded(v: jax.Array, rounded_dtype, quantize: Quantize) -> tuple[jax.Array, jax.Array]:
    """``(fp8 values, max |v rounded|)`` of a small piece computed in XLA (dt's columns)."""
    # The barrier keeps the rounding: XLA on GPU may otherwise compute the cast from the FP32
    # value (it allows excess precision), where the kernels round.
    r = jax.lax.optimization_barrier(v.astype(rounded_dtype)).astype(jnp.float32)
    return quantize_fp8(r, quantize.scale, quantize.dtype), jnp.max(jnp.abs(r))
