"""Precision state: what a stateful recipe (``fp8_delayed``: a scale and an amax history per
quantized tensor x, w, dY) keeps for every linear layer it runs.

It lives beside the parameters in the train state, is never seen by the optimizer, and is
updated once per step from the amaxes the recipes report (combined across microbatches by
max). The recipe's record makes and updates each slot (``Recipe.init_state`` and
``update_state``); this module lays them out::

    {"blocks": {layer_class: {"scale": f32[L, 3], ...}}, "lm_head": {"scale": f32[3], ...}}

with only the classes that use the stateful recipe somewhere present. Slot order: x, w, dY.
A model with mixture-of-experts blocks also keeps its routers' bias here (``"router"``,
maxfp4.model.router_state), outside the optimizer for the same reasons; the step updates it.
"""

from __future__ import annotations

from typing import Any, Sequence

from maxfp4.errors import ConfigError
from maxfp4.model_spec import CLASS_GROUPS
from maxfp4.precision.policy import BLOCK_CLASSES, PrecisionPolicy
from maxfp4.precision.recipes import Recipe
from maxfp4.model.router_state import STATE_KEY as ROUTER_KEY, router_inputs
from maxfp4.precision.registry import RECIPES


def _stateful(recipe: str) -> bool:
    return RECIPES[recipe].spec.stateful


def stateful_classes(policy: PrecisionPolicy, model_classes: Sequence[str] = BLOCK_CLASSES) -> tuple[list[str], bool]:
    """Block classes of the model with a stateful recipe in any block, and whether the LM head has one."""
    classes = [c for c in BLOCK_CLASSES if c in model_classes
               and any(_stateful(policy.recipe_for(c, i)) for i in range(policy.n_layers))]
    return classes, _stateful(policy.lm_head)


def state_recipe(policy: PrecisionPolicy) -> Recipe | None:
    """The one stateful recipe the policy uses (a layer class's slots hold one recipe's state)."""
    used = sorted({r for row in policy.block_table for r in row} | {policy.lm_head})
    stateful = [r for r in used if _stateful(r)]
    if len(stateful) > 1:
        raise ConfigError(f"precision: recipes {' and '.join(stateful)} both keep state; expected at most one "
                          f"stateful recipe in a policy")
    return RECIPES[stateful[0]] if stateful else None


def init_precision_state(policy: PrecisionPolicy, model_classes: Sequence[str] = BLOCK_CLASSES,
                         router: dict[str, Any] | None = None) -> dict[str, Any]:
    """``model_classes``: the block layer classes the model has (a dense model has no Mamba);
    ``router``: the mixture-of-experts routers' state (maxfp4.model.router_state), kept here
    beside the scaling state, outside the optimizer."""
    classes, head = stateful_classes(policy, model_classes)
    state: dict[str, Any] = {} if router is None else {ROUTER_KEY: router}
    if not classes and not head:
        return state
    recipe = state_recipe(policy)
    options = policy.options_tuple(recipe.name)
    if classes:
        state["blocks"] = {c: recipe.init_state(options, (policy.n_layers,)) for c in classes}
    if head:
        state["lm_head"] = recipe.init_state(options, ())
    return state


def scales_of(state: dict[str, Any]) -> dict[str, Any]:
    """The part the model consumes: {"blocks": {class: f32[L, 3]}, "lm_head": f32[3]}."""
    out: dict[str, Any] = {}
    if "blocks" in state:
        out["blocks"] = {c: s["scale"] for c, s in state["blocks"].items()}
    if "lm_head" in state:
        out["lm_head"] = state["lm_head"]["scale"]
    if ROUTER_KEY in state:
        out["blocks"] = {**out.get("blocks", {}), **router_inputs(state[ROUTER_KEY])}
    return out


def with_reciprocals(scales: dict[str, Any], policy: PrecisionPolicy) -> dict[str, Any]:
    """:func:`scales_of`'s output as the model's layers take it: each block class's [L, 3] scales
    with what the stateful recipe computes from them once for all layers appended
    (``Recipe.with_reciprocals``: [L, 6] for fp8_delayed; the same values a layer would compute
    alone); the expert classes in their grouped GEMM's form (``Recipe.grouped_with_reciprocals``).
    Inside the differentiated loss, so the scales' cotangent keeps :func:`scales_of`'s layout.
    The LM head's single scales and the routers' inputs go as they are. Dividing once a class
    keeps XLA from gathering each layer's own exact divisions into multi-output fusions of
    thousands of instructions, which lengthened the compile."""
    recipe = state_recipe(policy)
    if recipe is None or "blocks" not in scales:
        return scales
    options = policy.options_tuple(recipe.name)
    experts = set(CLASS_GROUPS["expert"])

    def prepared(c, s):
        fn = recipe.grouped_with_reciprocals if c in experts else recipe.with_reciprocals
        return fn(s, options) if fn is not None and c in BLOCK_CLASSES else s

    return {**scales, "blocks": {c: prepared(c, s) for c, s in scales["blocks"].items()}}


def update_precision_state(state: dict[str, Any], amaxes: dict[str, Any],
                           policy: PrecisionPolicy) -> dict[str, Any]:
    """``amaxes`` has the layout of :func:`scales_of` (the scales' cotangents)."""
    if not state:
        return state
    new: dict[str, Any] = {k: v for k, v in state.items() if k == ROUTER_KEY}  # updated by the step
    recipe = state_recipe(policy)
    if recipe is None:
        return new
    options = policy.options_tuple(recipe.name)
    if "blocks" in state:
        new["blocks"] = {c: recipe.update_state(s, amaxes["blocks"][c], options) for c, s in state["blocks"].items()}
    if "lm_head" in state:
        new["lm_head"] = recipe.update_state(state["lm_head"], amaxes["lm_head"], options)
    return new
