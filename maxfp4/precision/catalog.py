"""What is known about each recipe without running it, and the reading of the ``precision:`` section.

JAX-free on purpose: the config checks its precision section with this module alone, so
validating a config never imports JAX, and nothing here can close an import cycle through the
recipes (which import the mesh, which imports the config). The recipes' arithmetic lives in
:mod:`maxfp4.precision.recipes`; each recipe's record there carries the :class:`RecipeSpec`
of the same name from this module.

Rules (``precision.rules`` in YAML) are read here into :class:`Rule` values; the policy
(:mod:`maxfp4.precision.policy`) resolves them into its table. ``layers`` is a Python slice
string over block indices (``"-4:"``, bounds may be percentages of the depth: ``":3%"``,
``"-12%:"``) or a list of indices (negatives count from the end). The LM head is not a block:
only rules without ``layers`` apply to it.
"""

from __future__ import annotations

import os

import dataclasses
import math
from fractions import Fraction
from typing import Any, Mapping

from maxfp4.errors import ConfigError, describe
from maxfp4.model_spec import (BLOCK_CLASSES, CLASS_GROUPS, EXPLICIT_ONLY_CLASSES,  # the model's anatomy names the classes
                               LAYER_CLASSES)

# The option naming the layer class a recipe's call serves: not a config option, added to the
# policy's options when a layer calls its recipe (maxfp4.precision.layer.call_options).
LAYER_CLASS_OPTION = "layer_class"
# The datasheet peak a recipe's GEMMs are charged at for MFU (maxfp4.metrics.DEVICE_PEAKS_TFLOPS);
# a device without that peak charges BF16, the rate it emulates at (FP4 and block-scaled MXFP8
# GEMMs need Blackwell; Hopper's FP8 tensor cores take per-tensor scales only).
PEAK_CLASSES = ("bf16", "fp8", "mxfp8", "fp4")


@dataclasses.dataclass(frozen=True, eq=False)
class RecipeSpec:
    """The facts about one recipe that need no JAX: its options, what it constrains, what it costs."""

    name: str
    # option -> default; a mapping default (fast_accumulation) takes a mapping of its keys to booleans
    defaults: Mapping[str, Any]
    peak: str  # one of PEAK_CLASSES
    # bytes per element of the weight copy its GEMMs read (planner: working weights, FSDP traffic)
    weight_bytes: float
    # bytes per element of the activation operand its backward keeps (planner: remat=save_gemm_io)
    operand_bytes: float
    block: int = 0  # quantization block along both feature dimensions (0: none)
    choices: Mapping[str, tuple] = dataclasses.field(default_factory=dict)  # option -> allowed values
    minimum: Mapping[str, int] = dataclasses.field(default_factory=dict)  # integer option -> lowest value
    stateful: bool = False  # keeps state from step to step (TrainState.precision)
    # a slice of the tokens is computed exactly as inside the whole tensor (no tensor-wide scale or
    # block that spans tokens), so the LM head may run a slice of the sequence at a time
    token_local: bool = False


# Hopper's fast FP8 accumulation for fprop, the precise (split) one for dgrad and wgrad, as
# Transformer Engine does (its GEMMs' use_split_accumulator); docs/PRECISION.md.
FAST_ACCUMULATION_DEFAULT = {"forward": True, "backward": False}

BF16 = RecipeSpec("bf16", {}, peak="bf16", weight_bytes=2.0, operand_bytes=2.0, token_local=True)
# FP32 operands at full precision: the mixture-of-experts router's default (its top-k choice
# flips on small score differences); charged at the BF16 peak, its FLOPs are a rounding error.
FP32 = RecipeSpec("fp32", {}, peak="bf16", weight_bytes=4.0, operand_bytes=4.0, token_local=True)
# power_2_scale: scales rounded down to powers of two (Transformer Engine's QParams.power_2_scale),
# which lets the FP8 GEMMs write BF16 outputs exactly (recipes.fp8.fp8_gemm_tn).
FP8_DELAYED = RecipeSpec(
    "fp8_delayed", {"amax_history": 1024, "margin": 0, "amax_algo": "max", "power_2_scale": False,
                    "fast_accumulation": FAST_ACCUMULATION_DEFAULT},
    peak="fp8", weight_bytes=1.0, operand_bytes=1.0, choices={"amax_algo": ("max", "most_recent")},
    minimum={"amax_history": 1}, stateful=True)
FP8_CURRENT = RecipeSpec("fp8_current", {"power_2_scale": False, "fast_accumulation": FAST_ACCUMULATION_DEFAULT},
                         peak="fp8", weight_bytes=1.0, operand_bytes=1.0)
# rht_bf16: the Hadamard-transformed wgrad operands are rounded to BF16 before quantization, as
# Transformer Engine's RHT cast kernel does (false: quantize the FP32 transform). The backward
# keeps x in BF16: its wgrad quantizes x again, along the tokens.
NVFP4 = RecipeSpec("nvfp4", {"rht": True, "stochastic_rounding": True, "weight_2d": True, "rht_bf16": True},
                   peak="fp4", weight_bytes=0.5 + 1 / 16, operand_bytes=2.0, block=16)  # FP4 + an E4M3 scale per 16
# OCP MX: E8M0 scale per 32 elements; the backward keeps x in BF16 (its wgrad blocks run along M).
MXFP8 = RecipeSpec("mxfp8", {}, peak="mxfp8", weight_bytes=1.0 + 1 / 32, operand_bytes=2.0, block=32)
MXFP4 = RecipeSpec("mxfp4", {}, peak="fp4", weight_bytes=0.5 + 1 / 32, operand_bytes=2.0, block=32)
# DeepSeek-V3's block FP8: an FP32 scale per 128x128 weight tile.
FP8_BLOCK = RecipeSpec("fp8_block", {}, peak="fp8", weight_bytes=1.0 + 4 / 128**2, operand_bytes=2.0, block=128)

SPECS: dict[str, RecipeSpec] = {s.name: s for s in (BF16, FP32, FP8_DELAYED, FP8_CURRENT, NVFP4, MXFP8, MXFP4, FP8_BLOCK)}
RECIPE_NAMES = tuple(SPECS)
# The recipe of a class in EXPLICIT_ONLY_CLASSES (the router) that no rule names by class.
EXPLICIT_ONLY_DEFAULT = FP32.name


def is_recipe(value: Any) -> bool:
    # A YAML list or mapping is unhashable: test the type before looking it up.
    return isinstance(value, str) and value in SPECS


def _unknown_recipe(key: str, value: Any) -> ConfigError:
    return ConfigError(f"{key}={describe(value)}: unknown recipe; expected one of {', '.join(RECIPE_NAMES)}"
                       f"{_recipe_hint(value)}")


def _recipe_hint(value) -> str:
    """" (did you mean ...?)": recipes that start with or resemble ``value``, and the preset of that name."""
    import difflib

    text = str(value)
    close = [n for n in RECIPE_NAMES if n.startswith(text)] or difflib.get_close_matches(text, RECIPE_NAMES, n=2, cutoff=0.6)
    preset = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                          "configs", "precision", f"{text}.yaml")
    options = [repr(n) for n in close] + ([f"the preset configs/precision/{text}.yaml"] if os.path.isfile(preset) else [])
    return f" (did you mean {' or '.join(options)}?)" if options else ""


# ----------------------------------------------------------------------------- rules

RULE_KEYS = ("classes", "layers", "recipe")


@dataclasses.dataclass(frozen=True)
class Rule:
    classes: frozenset[str]
    layers: frozenset[int] | None  # None: every block and the LM head
    recipe: str


def _slice_bound(text: str, n_layers: int) -> int | None:
    """An integer, or a percentage of the block count rounded up, away from zero ("3%" of 62
    blocks is 2, "-12%" is -8; of 12 blocks 1 and -2), so one preset fits every depth and a
    slice that takes a share of either end of the stack (":3%", "-12%:") takes at least one
    block. Exact: the percentage is read as a fraction, not a float."""
    text = text.strip()
    if not text:
        return None
    if text.endswith("%"):
        if "/" in text:  # Fraction would take "1/3" (and fail on "1/0"): decimals only
            raise ValueError(text)
        pct = Fraction(text[:-1].strip())
        whole = math.ceil(n_layers * abs(pct) / 100)
        return -whole if pct < 0 else whole
    return int(text)


def _parse_layers(spec: Any, n_layers: int, key: str) -> frozenset[int]:
    if isinstance(spec, str):
        parts = spec.split(":")
        if len(parts) not in (2, 3):
            raise ConfigError(f"{key}={describe(spec)}: expected a Python slice like '-4:' or '0:8:2', or a list of indices")
        try:
            bounds = [_slice_bound(p, n_layers) for p in parts]
        except ValueError:
            raise ConfigError(f"{key}={describe(spec)}: expected integers or percentages in the slice") from None
        if len(bounds) == 3 and bounds[2] == 0:
            raise ConfigError(f"{key}={describe(spec)}: slice step must not be 0")
        picked = range(n_layers)[slice(*bounds)]
    elif isinstance(spec, int) and not isinstance(spec, bool):
        picked = [spec]
    elif isinstance(spec, (list, tuple)):
        picked = []
        for i in spec:
            if not isinstance(i, int) or isinstance(i, bool) or not -n_layers <= i < n_layers:
                raise ConfigError(f"{key}: index {describe(i)} out of range for {n_layers} blocks")
            picked.append(i % n_layers)
    else:
        raise ConfigError(f"{key}={describe(spec)}: expected a slice string or a list of block indices")
    chosen = frozenset(picked)
    if not chosen:
        # Absolute bounds past the depth: percentages and negative bounds fit every depth.
        raise ConfigError(f"{key}={describe(spec)}: selects no block of {n_layers} "
                          f"(write bounds as percentages of the depth, such as '-12%:', to share a preset)")
    return chosen


def parse_rule(raw: Any, i: int, n_layers: int) -> Rule:
    key = f"precision.rules[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}={describe(raw)}: expected a mapping with classes/layers/recipe")
    unknown = sorted(set(raw) - set(RULE_KEYS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown key; expected one of {', '.join(RULE_KEYS)}")
    if "recipe" not in raw:
        raise ConfigError(f"{key}: missing recipe; expected one of {', '.join(RECIPE_NAMES)}")
    if not is_recipe(raw["recipe"]):
        raise _unknown_recipe(f"{key}.recipe", raw["recipe"])
    classes = raw.get("classes", [c for c in LAYER_CLASSES if c not in EXPLICIT_ONLY_CLASSES])
    if isinstance(classes, str):
        classes = [classes]
    if not isinstance(classes, list):
        raise ConfigError(f"{key}.classes={describe(classes)}: expected a layer class or a list of them")
    known = LAYER_CLASSES + tuple(CLASS_GROUPS)
    for c in classes:
        if not isinstance(c, str) or c not in known:
            raise ConfigError(f"{key}.classes: unknown layer class {describe(c)}; expected one of {', '.join(known)}")
    classes = [member for c in classes for member in CLASS_GROUPS.get(c, (c,))]
    layers = _parse_layers(raw["layers"], n_layers, key + ".layers") if "layers" in raw else None
    return Rule(frozenset(classes), layers, raw["recipe"])


# ----------------------------------------------------------------------------- options


def _check_option(spec: RecipeSpec, key: str, value: Any) -> None:
    default = spec.defaults[key]
    where = f"precision.recipes.{spec.name}.{key}={describe(value)}"
    if isinstance(default, dict):  # fast_accumulation: {forward: bool, backward: bool}
        if not (isinstance(value, dict) and set(value) <= set(default)
                and all(isinstance(v, bool) for v in value.values())):
            raise ConfigError(f"{where}: expected a mapping of {', '.join(default)} to true or false")
        return
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false")
    elif isinstance(default, int):
        lowest = spec.minimum.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
            raise ConfigError(f"{where}: expected an integer >= {lowest}")
    if key in spec.choices and value not in spec.choices[key]:
        raise ConfigError(f"{where}: expected one of {', '.join(spec.choices[key])}")


def with_defaults(defaults: Mapping[str, Any], opts: Mapping[str, Any]) -> dict:
    """``opts`` over ``defaults``; a mapping option merges key by key over its default and is
    kept as sorted (key, value) pairs, so the policy stays hashable."""
    out = {**defaults, **opts}
    for k, default in defaults.items():
        if isinstance(default, dict):
            out[k] = tuple(sorted({**default, **dict(opts.get(k, ()))}.items()))
    return out


def resolve_options(recipes: Any) -> dict[str, dict]:
    """``precision.recipes`` checked against each recipe's schema, over its defaults."""
    out = {}
    for name, opts in recipes.items():
        if not is_recipe(name):
            raise ConfigError(f"precision.recipes.{name}: unknown recipe; expected one of {', '.join(RECIPE_NAMES)}")
        spec = SPECS[name]
        if not isinstance(opts, dict):
            raise ConfigError(f"precision.recipes.{name}={describe(opts)}: expected a mapping of options")
        for k, v in opts.items():
            if k not in spec.defaults:
                allowed = ", ".join(spec.defaults) or "none"
                raise ConfigError(f"precision.recipes.{name}.{k}: unknown option; expected one of {allowed}")
            _check_option(spec, k, v)
        out[name] = with_defaults(spec.defaults, opts)
    return out


def read_section(cfg: Any, n_layers: int) -> tuple[list[Rule], dict[str, dict]]:
    """(rules, options by recipe) of a ``PrecisionConfig`` for a stack of ``n_layers`` blocks;
    ConfigError with one line naming the key for anything the policy could not resolve."""
    if not is_recipe(cfg.default):
        raise _unknown_recipe("precision.default", cfg.default)
    rules = [parse_rule(r, i, n_layers) for i, r in enumerate(cfg.rules)]
    return rules, resolve_options(cfg.recipes)


def validate_precision(cfg: Any, n_layers: int) -> None:
    read_section(cfg, n_layers)
