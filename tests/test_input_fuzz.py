"""Untrusted input never crashes the loaders with anything but a one-line user error: random
YAML-ish config text and override strings end in ConfigError or a valid config, random bytes as
a data file or a tokenizer model end in DataError. The YAML is read with a safe loader, so a
config cannot construct Python objects."""

import os
import tempfile

import yaml

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from maxfp4.config import ConfigError, load_config
from maxfp4.errors import DataError, UserError

FUZZ = settings(max_examples=100, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Text that looks like our configs: keys of every level, YAML punctuation, numbers, tags.
TOKENS = ["run", "model", "data", "train", "optim", "mesh", "precision", "resilience", "fault", "include",
          "d_model", "n_heads", "steps", "paths", "rules", "recipes", "name", "lr", "nonfinite_at_steps",
          "spike_sigmas", ":", ": ", "\n", "\n  ", "- ", "[", "]", "{", "}", ",", "'", '"', "#", "&a", "*a",
          "!!python/object:os.system", "!!binary", "0", "-1", "3e-4", "1e999", ".nan", "true", "null", "~",
          "|", ">", "?", "%", "@", "\t", "<<: ", "=", ".", "x" * 3]
yamlish = st.lists(st.sampled_from(TOKENS) | st.text(max_size=4), max_size=40).map("".join)
KEYS = ["run.name", "run.seed", "model.d_model", "model.n_heads", "model.kind", "model.pattern", "data.paths",
        "data.source", "train.steps", "optim.lr", "mesh.data", "precision.rules", "precision.recipes",
        "checkpoint.async", "resilience.fault.nonfinite_at_steps", "resilience.spike_window", "include",
        "model", "a.b.c", "run..name", ".", ""]
override = st.builds(lambda k, sep, v: k + sep + v, st.sampled_from(KEYS) | st.text(max_size=8),
                     st.sampled_from(["=", "", "=="]), yamlish)


# Well-formed YAML values of every shape, for the converters and validators behind the parser.
scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True)
           | st.sampled_from(["bf16", "nvfp4", "fp8_delayed", "0:2", "-4:", "lm_head", "mlp_up", "M*-", ""])
           | st.text(max_size=6))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(["classes", "layers", "recipe", "rht", "amax_history",
                                                         "margin", "x"]) | st.text(max_size=4), inner, max_size=3),
                      max_leaves=8)
structured = st.builds(lambda k, v: f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}",
                       st.sampled_from(KEYS[:-3]), values)


def _loads_or_refuses(paths, overrides):
    try:
        load_config(paths, overrides)
    except ConfigError:
        pass


@FUZZ
@given(text=yamlish)
def test_random_config_files_load_or_raise_config_error(text):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "c.yaml")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        _loads_or_refuses(path, [])


@FUZZ
@given(overrides=st.lists(override, max_size=4))
def test_random_overrides_load_or_raise_config_error(overrides):
    _loads_or_refuses(None, overrides)


@FUZZ
@given(overrides=st.lists(structured, min_size=1, max_size=3))
def test_structured_overrides_load_or_raise_config_error(overrides):
    _loads_or_refuses(None, overrides)


def _write_bytes(directory: str, name: str, raw: bytes) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as fh:
        fh.write(raw)
    return path


@FUZZ
@given(raw=st.binary(max_size=300))
def test_random_bytes_as_config_file(raw):
    with tempfile.TemporaryDirectory() as tmp:
        _loads_or_refuses(_write_bytes(tmp, "c.yaml", raw), [])


@settings(max_examples=40, deadline=2000)
@given(raw=st.binary(max_size=2000))
def test_random_bytes_as_text_data_and_tokenizer(raw):
    from maxfp4.data.sources import read_text_file
    from maxfp4.data.tokenizer import Tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        path = _write_bytes(tmp, "f.bin", raw)
        try:
            assert isinstance(read_text_file(path), str)
        except DataError:
            pass
        try:
            Tokenizer(path)
        except DataError:
            pass


def test_yaml_python_tags_are_refused(tmp_path):
    """A safe loader does not construct objects: the tag is an error, not a call."""
    path = tmp_path / "evil.yaml"
    path.write_text("run:\n  name: !!python/object/apply:os.system ['touch pwned']\n")
    try:
        load_config(str(path))
    except UserError as e:
        assert "invalid YAML" in str(e)
    else:
        raise AssertionError("a python tag was accepted")
    assert not (tmp_path / "pwned").exists()


# ----------------------------------------------------------------------------- every field, hostile values

def _leaf_fields(cls=None, prefix=""):
    """(dotted key, type) of every leaf field of Config, found by walking the dataclasses, so a
    field added later is fuzzed without touching this file."""
    import dataclasses
    import typing

    from maxfp4.config import Config
    cls = cls or Config
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.metadata.get("key", f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_fields(hints[f.name], key + ".")
        else:
            yield key, hints[f.name]


LEAVES = list(_leaf_fields())
STRING_LEAVES = [k for k, t in LEAVES if t is str or t == tuple[str, ...]]
CONTROL = st.sampled_from(["\0", "\n", "\r", "\x1b[2J", "\x7f", "\x85", "\ud800", "\t"])
# No shrink phase: a failing example is reported as generated, instead of minutes spent shrinking it.
HOSTILE_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
                        phases=[Phase.explicit, Phase.reuse, Phase.generate])
BOUNDARY_VALUES = [2**31 - 1, 2**31, -2**31 - 1, 2**63, 10**400, -10**40, ".inf", "-.inf", ".nan", "1e400", "-1e400"]


def _alias_bomb_value(levels, width):
    """YAML flow text for one value: ``width**levels`` values once its aliases are expanded."""
    text = "[" + ", ".join(["&l0 [lol, lol]"] + [f"&l{k} [" + ", ".join([f"*l{k - 1}"] * width) + "]"
                                                  for k in range(1, levels)]) + "]"
    return text


class _address_space_cap:
    """Cap this process's address space at its current size + ``extra`` bytes while the block
    runs (soft limit only, restored after), so a loader that expands an alias bomb fails with
    MemoryError instead of taking the machine's memory."""

    def __init__(self, extra=2 << 30):
        import resource
        self.resource, self.extra = resource, extra

    def __enter__(self):
        r = self.resource
        self.saved = r.getrlimit(r.RLIMIT_AS)
        with open("/proc/self/statm") as fh:
            current = int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        cap = current + self.extra
        if self.saved[1] != r.RLIM_INFINITY:
            cap = min(cap, self.saved[1])
        r.setrlimit(r.RLIMIT_AS, (cap, self.saved[1]))

    def __exit__(self, *exc):
        self.resource.setrlimit(self.resource.RLIMIT_AS, self.saved)


def _refused_in_one_line(overrides):
    try:
        with _address_space_cap():
            load_config(None, overrides)
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message and "\0" not in message and len(message) < 400, message


def test_every_leaf_field_is_fuzzed():
    keys = dict(LEAVES)
    assert {"run.name", "run.seed", "optim.lr", "data.paths", "data.mixture", "train.compiler_options"} <= set(keys)
    assert "run.name" in STRING_LEAVES and "data.paths" in STRING_LEAVES


@HOSTILE_FUZZ
@given(key=st.sampled_from([k for k, _ in LEAVES]), levels=st.integers(2, 12), width=st.integers(2, 12))
def test_nested_aliases_in_any_field_are_bounded(key, levels, width):
    """Up to 12**12 values from a few hundred bytes: a valid config or a one-line error, fast."""
    import time
    start = time.monotonic()
    _refused_in_one_line([f"{key}={_alias_bomb_value(levels, width)}"])
    assert time.monotonic() - start < 5


@HOSTILE_FUZZ
@given(key=st.sampled_from([k for k, _ in LEAVES]),
       value=st.integers(-10**40, 10**40) | st.sampled_from([2**31 - 1, 2**31, -2**31 - 1, 2**63, 10**400,
                                                             ".inf", "-.inf", ".nan", "1e400", "-1e400"]))
def test_huge_integers_and_non_finite_numbers_in_any_field(key, value):
    _refused_in_one_line([f"{key}={value}"])


def test_every_boundary_number_in_every_field_is_accepted_or_refused_in_one_line():
    """The sampled test above, exhaustively over the boundary values: each field x each value."""
    for key, _ in LEAVES:
        for value in BOUNDARY_VALUES:
            _refused_in_one_line([f"{key}={value}"])


@HOSTILE_FUZZ
@given(key=st.sampled_from(STRING_LEAVES), before=st.text(max_size=5), control=CONTROL, after=st.text(max_size=5))
def test_control_characters_in_every_string_field_are_refused(key, before, control, after):
    import json
    text = before + control + after
    value = json.dumps(text)  # a YAML double-quoted scalar carrying the character escaped
    try:
        load_config(None, [f"{key}={value}"])
    except ConfigError as e:
        assert "\n" not in str(e) and "\0" not in str(e)
        return
    raise AssertionError(f"{key}={text!r} was accepted")
