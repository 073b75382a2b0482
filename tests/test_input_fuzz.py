"""Untrusted input never crashes the loaders with anything but a one-line user error: random
YAML-ish config text and override strings end in ConfigError or a valid config, random bytes as
a data file or a tokenizer model end in DataError. The YAML is read with a safe loader, so a
config cannot construct Python objects."""

import os
import tempfile

import yaml

from hypothesis import HealthCheck, given, settings
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
