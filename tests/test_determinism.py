"""run.deterministic: the option, its validation, what reaches the compiled step, and two CPU runs
of a tiny NVFP4 model (stochastic rounding on) that agree bit for bit. The GPU half, where the
deterministic ops matter, is tests/test_gpu_determinism.py."""
import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from maxfp4.checkpoint import read_params
from maxfp4.compiler import DETERMINISTIC_OPTIONS, check_compiler_options, compiler_options, determinism_summary
from maxfp4.config import ConfigError, load_config
from maxfp4.model import get_model
from maxfp4.precision import formats as F
from maxfp4.train import train

from tests.conftest import TINY


def test_the_option_adds_xlas_deterministic_ops_and_xla_knows_them():
    assert not load_config(None, []).run.deterministic  # off by default
    for platform in ("gpu", "cpu"):
        on = compiler_options(platform, {}, deterministic=True)
        assert {k: on[k] for k in DETERMINISTIC_OPTIONS} == DETERMINISTIC_OPTIONS
        assert not set(DETERMINISTIC_OPTIONS) & set(compiler_options(platform, {}, deterministic=False))
    # The user's own options stay beside them.
    on = compiler_options("gpu", {"xla_gpu_enable_triton_gemm": True}, deterministic=True)
    assert on["xla_gpu_enable_triton_gemm"] is True and on["xla_gpu_deterministic_ops"] is True
    # This XLA accepts the option names (an unknown name fails this compile: test_train.py).
    check_compiler_options(compiler_options("gpu", {}, deterministic=True), jax.devices()[0])
    assert determinism_summary(on).startswith("deterministic: on (xla_gpu_deterministic_ops")
    assert determinism_summary({}).startswith("deterministic: off")


@pytest.mark.parametrize("overrides, fragment", [
    (["run.deterministic=maybe"], "run.deterministic='maybe': expected true or false"),
    (["run.deterministic=true", "train.compiler_options={xla_gpu_deterministic_ops: false}"],
     "train.compiler_options.xla_gpu_deterministic_ops=False: expected True or unset with run.deterministic=true"),
    (["run.deterministic=true", "train.compiler_options={xla_gpu_exclude_nondeterministic_ops: false}"],
     "train.compiler_options.xla_gpu_exclude_nondeterministic_ops=False: expected True"),
])
def test_bad_deterministic_settings_are_one_line_config_errors(overrides, fragment):
    """A bad value is refused by the loader; options that contradict run.deterministic by the
    trainer's start-up (maxfp4.compiler owns the options), before the run directory is touched."""
    with pytest.raises(ConfigError) as error:
        cfg = load_config(None, overrides)
        compiler_options("cpu", cfg.train.compiler_options, cfg.run.deterministic)
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_stochastic_rounding_bits_do_not_depend_on_how_the_tensor_is_split():
    """The NVFP4 gradient's random bits come from the key and each element's global position
    (JAX's partitionable threefry), so a run on one device and one on eight round alike."""
    assert jax.config.jax_threefry_partitionable
    x = jax.random.normal(jax.random.key(0), (64, 128), jnp.float32)
    key = jax.random.key(7)
    one = np.asarray(jax.jit(lambda x: F.qdq_nvfp4(x, key=key))(x))
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))
    split = np.asarray(jax.jit(lambda x: F.qdq_nvfp4(x, key=key), out_shardings=rows)(jax.device_put(x, rows)))
    np.testing.assert_array_equal(split.view(np.uint32), one.view(np.uint32))
    # And the key matters: another key rounds some elements the other way.
    other = np.asarray(jax.jit(lambda x: F.qdq_nvfp4(x, key=jax.random.key(8)))(x))
    assert np.any(other != one)


def _params(run_dir, cfg):
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.eval_shape(lambda k: get_model(cfg.model).init_params(cfg.model, k), jax.random.key(0))
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), shapes)
    return jax.tree.map(np.asarray, read_params(run_dir, cfg.train.steps, abstract))


def test_two_deterministic_nvfp4_runs_agree_bit_for_bit_and_say_so(tmp_path, capsys):
    """Same config and seed, two runs: every metric and every parameter bit equal; the log line
    and the run's config.yaml record the mode."""
    runs = []
    for name in ("a", "b"):
        cfg = load_config(None, TINY + [
            f"run.output_dir={tmp_path}", f"run.name={name}", "run.deterministic=true", "run.seed=3",
            "precision.default=nvfp4", "precision.rules=[{classes: [lm_head], recipe: bf16}]",
            "model.n_layers=1", "train.steps=3", "resilience.preflight=false"])
        records = train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
        runs.append((records, _params(cfg.run_dir, cfg)))
        with open(tmp_path / name / "config.yaml", encoding="utf-8") as fh:
            assert yaml.safe_load(fh)["run"]["deterministic"] is True
    assert capsys.readouterr().out.count("deterministic: on (xla_gpu_deterministic_ops") == 2
    (rec_a, params_a), (rec_b, params_b) = runs
    assert len(rec_a) == cfg.train.steps
    for a, b in zip(rec_a, rec_b):
        assert (a["step"], a["loss"], a["grad_norm"]) == (b["step"], b["loss"], b["grad_norm"])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params_a), jax.tree.leaves(params_b)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), jax.tree_util.keystr(path)
    # The runs trained: the parameters moved from their initial values.
    assert rec_a[-1]["loss"] != rec_a[0]["loss"]
