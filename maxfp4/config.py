"""Typed, frozen run configuration loaded from YAML with dotted ``key=value`` overrides.

Every key has a type and a default (the sections in :mod:`maxfp4.config_schema`); unknown keys, wrong types and impossible values raise
:class:`ConfigError` with one line naming the key, the value and what was expected, before
anything is compiled. ``include: [other.yaml, ...]`` at the top of a file merges presets (paths
relative to the including file; the including file wins).
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat
import types
import typing
from typing import Any

import yaml

from maxfp4.errors import ConfigError, describe  # noqa: F401 - re-exported: `from maxfp4.config import ConfigError`
# The sections, re-exported: `from maxfp4.config import ModelConfig` is how the package and users name them.
from maxfp4.config_schema import (ATTENTION_IMPLS, CheckpointConfig, Config, DATA_SOURCES, DataConfig,
                                  DistributedConfig, FaultConfig, MAX_INIT_STD, MAX_LAYERS, MAX_LR,
                                  MIXTURE_SOURCES, MLP_KINDS, MODEL_KINDS, MambaConfig, MeshConfig, ModelConfig, MoEConfig,
                                  OptimConfig, PATTERN_CHARS, PrecisionConfig, REMAT_POLICIES, ResilienceConfig,
                                  RunConfig, TrainConfig, check_text, control_character, validate, yaml_key)  # noqa: F401


# ----------------------------------------------------------------------------- loading

# Integer fields end up in int32 arrays (the step counter, schedules, shapes) or in loops over
# them; run.seed alone is hashed into 64-bit PRNG keys.
INT32_MAX = 2**31 - 1
SEED_RANGE = (-2**63, 2**63 - 1)
# The YAML a config may hold after its aliases are expanded, and how deep it may nest: real
# configs hold a few hundred values, four levels deep (an alias bomb of 1 KB holds billions).
YAML_MAX_VALUES = 100_000
YAML_MAX_DEPTH = 64
# No setting takes an integer past 20 digits; Python's int() refuses decimal text past 4300.
YAML_MAX_INT_DIGITS = 1000
# A config is a few KB, an override value a few hundred characters; YAML's pure-Python parser
# reads ~100K values a second, so these bound what reading a config may cost to seconds.
CONFIG_MAX_BYTES = 1 << 20
OVERRIDE_MAX_CHARS = 1 << 16


def _convert(value: Any, typ: Any, key: str) -> Any:
    """Convert a YAML value to ``typ`` or raise a ConfigError naming ``key``."""
    origin = typing.get_origin(typ)
    if dataclasses.is_dataclass(typ):
        if value is None:
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: got {describe(value)}, expected a mapping of {typ.__name__} keys")
        return _build(typ, value, key + ".")
    if typ is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={describe(value)}: expected true or false")
    if typ is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            low, high = SEED_RANGE if key == "run.seed" else (-INT32_MAX - 1, INT32_MAX)
            if not low <= value <= high:
                raise ConfigError(f"{key}={describe(value)}: expected an integer in [{low}, {high}]")
            return value
        raise ConfigError(f"{key}={describe(value)}: expected an integer")
    if typ is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 else math.inf
        elif isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{key}={describe(value)}: expected a number")
        if not math.isfinite(number):  # no setting means anything at inf or nan
            raise ConfigError(f"{key}={describe(value)}: expected a finite number")
        return number
    if typ is str:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if isinstance(value, str):
            return check_text(value, key)
        raise ConfigError(f"{key}={describe(value)}: expected a string")
    if typ is dict:
        if value is None:
            return {}
        if isinstance(value, dict):
            return value
        raise ConfigError(f"{key}={describe(value)}: expected a mapping")
    if origin is tuple:
        (item_type, _) = typing.get_args(typ)
        if value is None:
            return ()
        if isinstance(value, (str, dict)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={describe(value)}: expected a list")
        return tuple(_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        raise AssertionError(f"union types are not used in the config ({key})")
    raise AssertionError(f"unsupported config type {typ} for {key}")


def _build(cls: type, raw: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    fields = {yaml_key(f): f for f in dataclasses.fields(cls)}
    unknown = sorted((str(k) for k in set(raw) - set(fields)))
    if unknown:
        name = unknown[0] if control_character(unknown[0]) < 0 else repr(unknown[0])
        raise ConfigError(f"{prefix}{name}: unknown key; expected one of {', '.join(sorted(fields))}")
    kwargs = {}
    for key, f in fields.items():
        if key in raw:
            kwargs[f.name] = _convert(raw[key], hints[f.name], prefix + key)
    return cls(**kwargs)


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


class YamlRefused(Exception):
    """YAML the loader refuses: nested too deeply, too many values (with or without aliases), a
    duplicate key, an integer too long to read. ``expected`` says what would be accepted."""

    def __init__(self, problem: str, mark=None, expected: str | None = None):
        super().__init__(problem)
        self.problem, self.line = problem, (mark.line + 1 if mark is not None else None)
        self.expected = expected or f"at most {YAML_MAX_VALUES} values nested at most {YAML_MAX_DEPTH} deep"


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses documents nested deeper than ``YAML_MAX_DEPTH`` (the
    composer recurses per level) or holding more than ``YAML_MAX_VALUES`` values, written out
    (counted as they are composed, so a huge list stops early) or once every alias is expanded
    (checked on the composed graph before any Python object is built: aliases share nodes there,
    so the check costs one pass over the text's own nodes, not over the expansion). It refuses
    duplicate keys (YAML's last-one-wins hides a typo) and reads YAML 1.1's base-60 numbers
    (``1:30``) as the strings they look like, so a type check refuses them instead of reading 90."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > YAML_MAX_DEPTH:
                raise YamlRefused(f"nested deeper than {YAML_MAX_DEPTH} levels", self.peek_event().start_mark)
            if not self.check_event(yaml.AliasEvent):
                self._nodes += 1
                if self._nodes > YAML_MAX_VALUES:
                    raise YamlRefused(f"holds more than {YAML_MAX_VALUES} values", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return self.construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                if key in first:
                    raise YamlRefused(f"duplicate key {describe(key)} (also at line {first[key]})",
                                      key_node.start_mark, expected="each key once in a mapping")
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        if ":" in text:  # YAML 1.1 base 60
            return text
        digits = text.replace("_", "").lstrip("+-")
        if len(digits) > YAML_MAX_INT_DIGITS:  # int() refuses decimal text past 4300 digits
            raise YamlRefused(f"an integer of {len(digits)} digits", node.start_mark,
                              expected=f"integers of at most {YAML_MAX_INT_DIGITS} digits")
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node):
        text = self.construct_scalar(node)
        return text if ":" in text else super().construct_yaml_float(node)


_ConfigLoader.add_constructor("tag:yaml.org,2002:int", _ConfigLoader.construct_yaml_int)
_ConfigLoader.add_constructor("tag:yaml.org,2002:float", _ConfigLoader.construct_yaml_float)


def _node_children(node) -> list:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_expansion(root) -> None:
    """Count the values of the document with every alias expanded (memoised per shared node, so
    linear in the composed graph) and refuse more than ``YAML_MAX_VALUES`` or a cycle."""
    expanded: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            on_path.discard(key)
            total = 1 + sum(expanded[id(c)] for c in _node_children(node))
            if total > YAML_MAX_VALUES:
                raise YamlRefused(f"aliases expand it to more than {YAML_MAX_VALUES} values "
                                  "(an alias bomb?)", node.start_mark)
            expanded[key] = total
            continue
        if key in expanded:
            continue
        if key in on_path:
            raise YamlRefused("an alias refers to a collection that contains it", node.start_mark)
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in _node_children(node) if id(c) not in expanded)


def load_yaml(text) -> Any:
    """``yaml.safe_load`` with the bounds and refusals of :class:`_ConfigLoader` (raises
    :class:`YamlRefused`)."""
    loader = _ConfigLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _files_beside(path: str) -> str:
    """"; ... has a.yaml, b.yaml": the YAML files of the missing file's directory (the presets, for
    configs/precision/fp9.yaml), the closest first."""
    import difflib

    folder = os.path.dirname(path)
    names = sorted(n for n in os.listdir(folder) if n.endswith((".yaml", ".yml"))) if os.path.isdir(folder) else []
    if not names:
        return ""
    close = difflib.get_close_matches(os.path.basename(path), names, n=1, cutoff=0.5)
    return f"; {folder} has {', '.join(close + [n for n in names if n not in close])}"


def _read_config_text(path: str, name: str) -> str:
    """The text of a config file: a regular file (a device such as /dev/zero never ends, a FIFO
    may never open) of at most ``CONFIG_MAX_BYTES``, UTF-8. ``name`` names it in errors."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"config file {name}: not found{_files_beside(path)}") from None
    except OSError as e:
        raise ConfigError(f"config file {name}: cannot read ({e.strerror or e})") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a device, FIFO or socket"
        raise ConfigError(f"config file {name}: not a regular file ({kind}); expected a YAML file")
    try:
        with open(path, "rb") as fh:
            raw = fh.read(CONFIG_MAX_BYTES + 1)
    except OSError as e:  # a permission problem
        raise ConfigError(f"config file {name}: cannot read ({e.strerror or e})") from None
    if len(raw) > CONFIG_MAX_BYTES:
        raise ConfigError(f"config file {name}: larger than {CONFIG_MAX_BYTES} bytes; expected a config "
                          f"(a few KB), not data")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {name}: not UTF-8 text (undecodable byte at offset {e.start})") from None


def _read_yaml(path: str, seen: tuple[str, ...] = ()) -> dict:
    path = os.path.abspath(path)
    if path in seen:
        raise ConfigError(f"include: {path} includes itself")
    text = _read_config_text(path, f"{path} (included by {seen[-1]})" if seen else path)
    try:
        raw = load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path}{where}: invalid YAML ({getattr(e, 'problem', e)})") from None
    except YamlRefused as e:
        where = f" line {e.line}" if e.line else ""
        raise ConfigError(f"config file {path}{where}: refused: {e.problem}; expected {e.expected}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: expected a mapping at the top level")
    includes = raw.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) and i for i in includes):
        raise ConfigError(f"config file {path}: include={describe(includes)}: expected a file name or a list of them")
    merged: dict = {}
    for inc in includes:
        inc_path = inc if os.path.isabs(inc) else os.path.join(os.path.dirname(path), inc)
        merged = _deep_merge(merged, _read_yaml(inc_path, seen + (path,)))
    return _deep_merge(merged, raw)


def apply_override(raw: dict, override: str) -> dict:
    """Apply one ``dotted.key=value`` override (value parsed as YAML) to a raw config dict."""
    if "=" not in override:
        raise ConfigError(f"override {describe(override)}: expected dotted.key=value")
    key, text = override.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {describe(override)}: expected dotted.key=value")
    if len(text) > OVERRIDE_MAX_CHARS:  # refused before YAML reads it: parsing costs ~8 s per MB
        raise ConfigError(f"override {key}: a value of {len(text)} characters; expected at most "
                          f"{OVERRIDE_MAX_CHARS} (put long lists in a config file)")
    try:
        value = load_yaml(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    except YamlRefused as e:
        raise ConfigError(f"override {key}: refused: {e.problem}; expected {e.expected}") from None
    out = dict(raw)
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        child = dict(child) if isinstance(child, dict) else {}
        node[part] = child
        node = child
    node[parts[-1]] = value
    return out


def add_config_arguments(parser) -> None:
    """The command-line shape every maxfp4 tool shares: CONFIG [more.yaml ...] [key=value ...]."""
    parser.add_argument("config", help="YAML config file (see configs/)")
    parser.add_argument("overrides", nargs="*",
                        help="more YAML files (merged in order, e.g. configs/precision/fp8.yaml) "
                             "and dotted.key=value overrides, values parsed as YAML")


def config_from_arguments(args) -> Config:
    """Load the config named by :func:`add_config_arguments`' arguments."""
    files = [args.config] + [a for a in args.overrides if "=" not in a]
    return load_config(files, [a for a in args.overrides if "=" in a])


def load_config(path: str | typing.Sequence[str] | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read ``path`` (None: all defaults; several files merge left to right), apply overrides,
    convert and validate."""
    paths = [path] if isinstance(path, str) else list(path or [])
    raw: dict = {}
    for p in paths:
        raw = _deep_merge(raw, _read_yaml(p))
    if paths and "name" not in (raw.get("run") or {}):
        # A config without a run name runs in a directory named after its file, not in another config's run.
        raw = _deep_merge(raw, {"run": {"name": os.path.splitext(os.path.basename(paths[0]))[0]}})
    for ov in overrides:
        raw = apply_override(raw, ov)
    return config_from_dict(raw)


def _implied(cfg: Config) -> Config:
    """A hybrid stack's depth is its pattern's length."""
    if cfg.model.kind == "hybrid" and cfg.model.pattern:
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=len(cfg.model.pattern)))
    return cfg


def config_from_dict(raw: dict) -> Config:
    """Convert and validate a nested dict of config sections (YAML already read)."""
    cfg = _implied(_build(Config, raw))
    validate(cfg)
    return cfg


def saved_model_config(section: dict, where: str) -> ModelConfig:
    """The ModelConfig of a model section saved with a checkpoint or export (``where`` names it in
    the one-line error when it no longer validates)."""
    try:
        return config_from_dict({"model": section}).model
    except ConfigError as e:
        raise ConfigError(f"{where}: the saved model config is not usable ({e})") from None


