"""FP8 delayed-scaling state: a scale and an amax history per quantized tensor (x, w, dY) of
every linear layer whose recipe is ``fp8_delayed``.

It lives beside the parameters in the train state, is never seen by the optimizer, and is
updated once per step from the amaxes the recipes report (combined across microbatches by
max). Layout::

    {"blocks": {layer_class: {"scale": f32[L, 3], "amax_history": f32[L, 3, H]}},
     "lm_head": {"scale": f32[3], "amax_history": f32[3, H]}}

with only the classes that use delayed scaling somewhere present. Slot order: x, w, dY.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from maxfp4.precision import formats as F
from maxfp4.precision.policy import BLOCK_CLASSES, PrecisionPolicy
from maxfp4.precision.registry import STATEFUL_RECIPES

SLOT_DTYPES = (F.FP8_E4M3, F.FP8_E4M3, F.FP8_E5M2)  # HYBRID: E4M3 forward, E5M2 backward


def stateful_classes(policy: PrecisionPolicy, model_classes: Sequence[str] = BLOCK_CLASSES) -> tuple[list[str], bool]:
    """Block classes of the model with a delayed-scaling recipe in any block, and whether the LM
    head has one."""
    classes = [c for c in BLOCK_CLASSES if c in model_classes
               and any(policy.recipe_for(c, i) in STATEFUL_RECIPES for i in range(policy.n_layers))]
    return classes, policy.lm_head in STATEFUL_RECIPES


def _history_len(policy: PrecisionPolicy) -> int:
    return int(policy.options_for("fp8_delayed").get("amax_history", 1024))


def init_precision_state(policy: PrecisionPolicy, model_classes: Sequence[str] = BLOCK_CLASSES) -> dict[str, Any]:
    """``model_classes``: the block layer classes the model has (a dense model has no Mamba)."""
    classes, head = stateful_classes(policy, model_classes)
    h, n = _history_len(policy), policy.n_layers

    def slot(*lead):
        return {"scale": jnp.ones((*lead, 3), jnp.float32),
                "amax_history": jnp.zeros((*lead, 3, h), jnp.float32)}

    state: dict[str, Any] = {}
    if classes:
        state["blocks"] = {c: slot(n) for c in classes}
    if head:
        state["lm_head"] = slot()
    return state


def scales_of(state: dict[str, Any]) -> dict[str, Any]:
    """The part the model consumes: {"blocks": {class: f32[L, 3]}, "lm_head": f32[3]}."""
    out: dict[str, Any] = {}
    if "blocks" in state:
        out["blocks"] = {c: s["scale"] for c, s in state["blocks"].items()}
    if "lm_head" in state:
        out["lm_head"] = state["lm_head"]["scale"]
    return out


def _update_slot(slot: dict[str, jax.Array], amax: jax.Array, margin: int, algo: str,
                 power_2: bool) -> dict[str, jax.Array]:
    """Roll this step's amax into the history (newest at index 0) and compute the next scales
    ``(fp8_max / amax_h) / 2**margin`` (rounded down to a power of two with ``power_2``); a zero
    or non-finite amax_h keeps the old scale."""
    history = jnp.roll(slot["amax_history"], 1, axis=-1).at[..., 0].set(amax)
    amax_h = jnp.max(history, axis=-1) if algo == "max" else history[..., 0]
    scales = [F.scale_from_amax(amax_h[..., i], SLOT_DTYPES[i], margin, slot["scale"][..., i], power_2)
              for i in range(3)]
    return {"scale": jnp.stack(scales, axis=-1), "amax_history": history}


def update_precision_state(state: dict[str, Any], amaxes: dict[str, Any],
                           policy: PrecisionPolicy) -> dict[str, Any]:
    """``amaxes`` has the layout of :func:`scales_of` (the scales' cotangents)."""
    if not state:
        return state
    opts = policy.options_for("fp8_delayed")
    margin, algo = int(opts.get("margin", 0)), str(opts.get("amax_algo", "max"))
    power_2 = bool(opts.get("power_2_scale", False))
    new: dict[str, Any] = {}
    if "blocks" in state:
        new["blocks"] = {c: _update_slot(s, amaxes["blocks"][c], margin, algo, power_2)
                         for c, s in state["blocks"].items()}
    if "lm_head" in state:
        new["lm_head"] = _update_slot(state["lm_head"], amaxes["lm_head"], margin, algo, power_2)
    return new
