"""Precision policy: ordered rules resolved once into a (block index, layer class) -> recipe table.

Rules are data (``precision.rules`` in YAML); the first rule that matches a (class, block) pair
wins, otherwise ``precision.default``. ``layers`` is a Python slice string over block indices
(``"-4:"``, bounds may be percentages of the depth: ``":3%"``, ``"-12%:"``) or a list of
indices (negatives count from the end). The LM head is not a block: only
rules without ``layers`` apply to it.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, Sequence

from maxfp4.config import LAYER_CLASSES, ConfigError, PrecisionConfig, describe
from maxfp4.precision.registry import RECIPES

RULE_KEYS = ("classes", "layers", "recipe")
BLOCK_CLASSES = tuple(c for c in LAYER_CLASSES if c != "lm_head")


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
        raise ConfigError(f"{key}={describe(spec)}: selects no block of {n_layers}")
    return chosen


@dataclasses.dataclass(frozen=True)
class Rule:
    classes: frozenset[str]
    layers: frozenset[int] | None  # None: every block and the LM head
    recipe: str


def _is_recipe(value: Any) -> bool:
    # A YAML list or mapping is unhashable: test the type before looking it up.
    return isinstance(value, str) and value in RECIPES


def _parse_rule(raw: Any, i: int, n_layers: int) -> Rule:
    key = f"precision.rules[{i}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}={describe(raw)}: expected a mapping with classes/layers/recipe")
    unknown = sorted(set(raw) - set(RULE_KEYS))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: unknown key; expected one of {', '.join(RULE_KEYS)}")
    if "recipe" not in raw:
        raise ConfigError(f"{key}: missing recipe; expected one of {', '.join(RECIPES)}")
    recipe = raw["recipe"]
    if not _is_recipe(recipe):
        raise ConfigError(f"{key}.recipe={describe(recipe)}: unknown recipe; expected one of {', '.join(RECIPES)}")
    classes = raw.get("classes", list(LAYER_CLASSES))
    if isinstance(classes, str):
        classes = [classes]
    if not isinstance(classes, list):
        raise ConfigError(f"{key}.classes={describe(classes)}: expected a layer class or a list of them")
    for c in classes:
        if not isinstance(c, str) or c not in LAYER_CLASSES:
            raise ConfigError(f"{key}.classes: unknown layer class {describe(c)}; expected one of {', '.join(LAYER_CLASSES)}")
    layers = _parse_layers(raw["layers"], n_layers, key + ".layers") if "layers" in raw else None
    return Rule(frozenset(classes), layers, recipe)


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """The resolved table. Hashable, so it can be a static argument of jitted functions."""

    n_layers: int
    block_table: tuple[tuple[str, ...], ...]  # [block][class index in BLOCK_CLASSES] -> recipe
    lm_head: str
    options: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]

    def recipe_for(self, layer_class: str, layer_index: int | None) -> str:
        if layer_class == "lm_head" or layer_index is None:
            return self.lm_head
        return self.block_table[layer_index][BLOCK_CLASSES.index(layer_class)]

    def options_for(self, recipe: str) -> dict:
        return dict(dict(self.options).get(recipe, ()))

    def options_tuple(self, recipe: str) -> tuple[tuple[str, Any], ...]:
        """Hashable options, passed to recipes as a static argument."""
        return dict(self.options).get(recipe, ())

    def block_groups(self) -> list[tuple[int, int]]:
        """Half-open runs [start, end) of consecutive blocks with identical recipes: one scan each."""
        groups: list[tuple[int, int]] = []
        start = 0
        for i in range(1, self.n_layers + 1):
            if i == self.n_layers or self.block_table[i] != self.block_table[start]:
                groups.append((start, i))
                start = i
        return groups

    def format_table(self, classes: Sequence[str] = BLOCK_CLASSES) -> str:
        width = max(len(c) for c in classes)
        header = "block  " + "  ".join(c.ljust(max(width, 11)) for c in classes)
        lines = [header]
        for start, end in self.block_groups():
            row = self.block_table[start]
            label = f"{start}" if end - start == 1 else f"{start}-{end - 1}"
            lines.append(label.ljust(7) + "  ".join(
                row[BLOCK_CLASSES.index(c)].ljust(max(width, 11)) for c in classes))
        lines.append(f"lm_head: {self.lm_head}")
        return "\n".join(lines)


OPTION_CHOICES = {"amax_algo": ("max", "most_recent")}


def _check_option(recipe: str, key: str, value: Any, default: Any) -> None:
    where = f"precision.recipes.{recipe}.{key}={describe(value)}"
    if isinstance(default, dict):  # fast_accumulation: {forward: bool, backward: bool}
        if not (isinstance(value, dict) and set(value) <= set(default)
                and all(isinstance(v, bool) for v in value.values())):
            raise ConfigError(f"{where}: expected a mapping of {', '.join(default)} to true or false")
        return
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false")
    elif isinstance(default, int):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{where}: expected an integer >= 0")
        if key == "amax_history" and value < 1:
            raise ConfigError(f"{where}: expected an integer >= 1")
    if key in OPTION_CHOICES and value not in OPTION_CHOICES[key]:
        raise ConfigError(f"{where}: expected one of {', '.join(OPTION_CHOICES[key])}")


def _resolve_options(cfg: PrecisionConfig) -> dict[str, dict]:
    out = {}
    for name, opts in cfg.recipes.items():
        if not _is_recipe(name):
            raise ConfigError(f"precision.recipes.{name}: unknown recipe; expected one of {', '.join(RECIPES)}")
        defaults = RECIPES[name][1]
        if not isinstance(opts, dict):
            raise ConfigError(f"precision.recipes.{name}={describe(opts)}: expected a mapping of options")
        for k, v in opts.items():
            if k not in defaults:
                allowed = ", ".join(defaults) or "none"
                raise ConfigError(f"precision.recipes.{name}.{k}: unknown option; expected one of {allowed}")
            _check_option(name, k, v, defaults[k])
        out[name] = _with_defaults(defaults, opts)
    return out


def _with_defaults(defaults: dict, opts: dict) -> dict:
    """``opts`` over ``defaults``; a mapping option merges key by key over its default and is
    kept as sorted (key, value) pairs, so the policy stays hashable."""
    out = {**defaults, **opts}
    for k, default in defaults.items():
        if isinstance(default, dict):
            out[k] = tuple(sorted({**default, **dict(opts.get(k, ()))}.items()))
    return out


def resolve_policy(cfg: PrecisionConfig, n_layers: int) -> PrecisionPolicy:
    if not _is_recipe(cfg.default):
        raise ConfigError(f"precision.default={describe(cfg.default)}: unknown recipe; expected one of {', '.join(RECIPES)}")
    rules = [_parse_rule(r, i, n_layers) for i, r in enumerate(cfg.rules)]
    options = _resolve_options(cfg)

    def pick(layer_class: str, index: int | None) -> str:
        for rule in rules:
            if layer_class not in rule.classes:
                continue
            if rule.layers is not None and (index is None or index not in rule.layers):
                continue
            return rule.recipe
        return cfg.default

    table = tuple(tuple(pick(c, i) for c in BLOCK_CLASSES) for i in range(n_layers))
    used = {r for row in table for r in row} | {pick("lm_head", None)}
    all_options = {name: options.get(name) or _with_defaults(RECIPES[name][1], {}) for name in used}
    frozen = tuple(sorted((n, tuple(sorted(o.items()))) for n, o in all_options.items()))
    return PrecisionPolicy(n_layers, table, pick("lm_head", None), frozen)


def validate_precision(cfg: PrecisionConfig, n_layers: int) -> None:
    resolve_policy(cfg, n_layers)


# Recipes that quantize in blocks: both feature dimensions of the layer must be multiples.
BLOCK_SIZES = {"nvfp4": 16, "mxfp8": 32, "mxfp4": 32, "fp8_block": 128}


def check_block_divisibility(policy: PrecisionPolicy, shapes: dict[str, tuple[int, int]]) -> None:
    """Fail before compiling when a block-scaled recipe meets a layer it cannot tile."""
    for cls, (k, n) in shapes.items():
        indices = [None] if cls == "lm_head" else range(policy.n_layers)
        for recipe in {policy.recipe_for(cls, i) for i in indices}:
            size = BLOCK_SIZES.get(recipe)
            if size and (k % size or n % size):
                raise ConfigError(f"precision: recipe {recipe} on {cls} needs its features ({k} in, {n} out) "
                                  f"to be multiples of {size}; choose another recipe for {cls} or resize the model")
