"""Precision policy: ordered rules resolved once into a (block index, layer class) -> recipe table.

Rules are data (``precision.rules`` in YAML, read by :mod:`maxfp4.precision.catalog`); the first
rule that matches a (class, block) pair wins, otherwise ``precision.default``. JAX-free, like
the catalog it reads: the table is hashable, a static argument of the jitted step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Collection, Sequence

from maxfp4.errors import ConfigError, describe
from maxfp4.precision.catalog import (BLOCK_CLASSES, EXPLICIT_ONLY_CLASSES, EXPLICIT_ONLY_DEFAULT, LAYER_CLASSES, SPECS,
                                      Rule, read_section, with_defaults)

# The classes of the block table; the router's recipes are a column of their own (router_table).
TABLE_CLASSES = tuple(c for c in BLOCK_CLASSES if c not in EXPLICIT_ONLY_CLASSES)


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    """The resolved table. Hashable, so it can be a static argument of jitted functions."""

    n_layers: int
    block_table: tuple[tuple[str, ...], ...]  # [block][class index in TABLE_CLASSES] -> recipe
    lm_head: str
    options: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]
    # [block] -> the router's recipe: apart from the table, which holds what the blocks'
    # recipes (their scans, their state) depend on (empty: FP32 everywhere)
    router_table: tuple[str, ...] = ()

    def recipe_for(self, layer_class: str, layer_index: int | None) -> str:
        if layer_class == "lm_head" or layer_index is None:
            return self.lm_head
        if layer_class in EXPLICIT_ONLY_CLASSES:
            return self.router_table[layer_index] if self.router_table else EXPLICIT_ONLY_DEFAULT
        return self.block_table[layer_index][TABLE_CLASSES.index(layer_class)]

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
            if i == self.n_layers or self.recipe_rows[i] != self.recipe_rows[start]:
                groups.append((start, i))
                start = i
        return groups

    @functools.cached_property
    def recipe_rows(self) -> tuple[tuple[str, ...], ...]:
        """Each block's recipes, the router's included: blocks with equal rows share a scan."""
        return tuple(row + ((self.router_table[i],) if self.router_table else ())
                     for i, row in enumerate(self.block_table))

    def format_table(self, classes: Sequence[str] = BLOCK_CLASSES) -> str:
        width = max(len(c) for c in classes)
        header = "block  " + "  ".join(c.ljust(max(width, 11)) for c in classes)
        lines = [header]
        for start, end in self.block_groups():
            row = self.block_table[start]
            label = f"{start}" if end - start == 1 else f"{start}-{end - 1}"
            lines.append(label.ljust(7) + "  ".join(
                self.recipe_for(c, start).ljust(max(width, 11)) for c in classes))
        lines.append(f"lm_head: {self.lm_head}")
        return "\n".join(lines)


def _matches(rule: Rule, layer_class: str, index: int | None) -> bool:
    return layer_class in rule.classes and (rule.layers is None or (index is not None and index in rule.layers))


def resolve_policy(cfg: Any, n_layers: int) -> PrecisionPolicy:
    """The table of a ``PrecisionConfig`` for ``n_layers`` blocks."""
    rules, options = read_section(cfg, n_layers)

    def pick(layer_class: str, index: int | None) -> str:
        # precision.default is not the router's: it keeps FP32 unless a rule names its class
        default = EXPLICIT_ONLY_DEFAULT if layer_class in EXPLICIT_ONLY_CLASSES else cfg.default
        return next((rule.recipe for rule in rules if _matches(rule, layer_class, index)), default)

    table = tuple(tuple(pick(c, i) for c in TABLE_CLASSES) for i in range(n_layers))
    router = tuple(pick(EXPLICIT_ONLY_CLASSES[0], i) for i in range(n_layers))
    used = {r for row in table for r in row} | {pick("lm_head", None)} | set(router)
    all_options = {name: options.get(name) or with_defaults(SPECS[name].defaults, {}) for name in used}
    frozen = tuple(sorted((n, tuple(sorted(o.items()))) for n, o in all_options.items()))
    return PrecisionPolicy(n_layers, table, pick("lm_head", None), frozen, router)


def check_block_divisibility(policy: PrecisionPolicy, shapes: dict[str, tuple[int, int]]) -> None:
    """Fail before compiling when a block-scaled recipe meets a layer it cannot tile."""
    for cls, (k, n) in shapes.items():
        indices = [None] if cls == "lm_head" else range(policy.n_layers)
        for recipe in {policy.recipe_for(cls, i) for i in indices}:
            size = SPECS[recipe].block  # both feature dimensions must be multiples of its block
            if size and (k % size or n % size):
                raise ConfigError(f"precision: recipe {recipe} on {cls} needs its features ({k} in, {n} out) "
                                  f"to be multiples of {size}; choose another recipe for {cls} or resize the model")


def unmatched_rules(cfg: Any, n_layers: int, block_classes: Sequence[Collection[str]]) -> list[str]:
    """One line per rule that matches no layer of this model: its classes are absent (``mamba_in``
    on a dense model) or absent from the blocks it selects. Such a rule decides nothing, which is
    what a preset shared by dense and hybrid models means; a typo reads the same, so the caller
    shows these lines beside the table. ``block_classes[i]``: the layer classes block i has."""
    rules, _ = read_section(cfg, n_layers)
    lines = []
    for i, rule in enumerate(rules):
        if "lm_head" in rule.classes and rule.layers is None:
            continue
        if not any(_matches(rule, c, b) for b, classes in enumerate(block_classes) for c in classes):
            have = sorted({c for classes in block_classes for c in classes} | {"lm_head"}, key=LAYER_CLASSES.index)
            raw = cfg.rules[i]
            named = f"classes {describe(raw.get('classes'))}" + (f", layers {describe(raw['layers'])}" if "layers" in raw else "")
            lines.append(f"precision.rules[{i}] ({named}) matches no layer of this model, so it decides nothing "
                         f"(the model has {', '.join(have)})")
    return lines
