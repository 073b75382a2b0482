"""The MLP as a module: SwiGLU (gate and up in one GEMM) or the squared ReLU (Nemotron-H).

Dimension letters: B batch, T sequence, D d_model, F MLP hidden, L blocks.
"""

from __future__ import annotations

import jax
from flax import nnx

from maxfp4.config import ModelConfig
from maxfp4.model.layers import linear, mlp_block
from maxfp4.model_spec import mixer_linears
from maxfp4.precision import LayerPrecision


class MLP(nnx.Module):
    """``w_up`` [D, F, gates] (SwiGLU: gate and up side by side per feature, so sharding F keeps
    each device's pairs together; relu2: gates = 1) and ``w_down`` [F, D] (maxfp4.model_spec),
    ``n`` of each stacked on a leading L axis (None: one layer)."""

    def __init__(self, cfg: ModelConfig, key_up: jax.Array, key_down: jax.Array, n: int | None, *,
                 std: float, out_std: float):
        up, down = mixer_linears(cfg, "mlp")
        self.w_up = linear(key_up, up, n, std=std)
        self.w_down = linear(key_down, down, n, std=out_std)

    def __call__(self, x_BTD: jax.Array, lp: LayerPrecision, kind: str = "swiglu",
                 smooth: bool = False) -> jax.Array:
        # One function for both GEMMs: with FP8 hooks it fuses them with the activation.
        return mlp_block(x_BTD, self.w_up[...], self.w_down[...], lp, kind=kind, smooth=smooth)
