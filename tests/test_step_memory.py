"""The train step compiled at its first call and held to the device's memory (maxfp4.step_memory)."""

import jax
import numpy as np
import pytest

from maxfp4.optim import make_optimizer, make_schedule
from maxfp4.parallel.mesh import batch_sharding, make_mesh
from maxfp4.precision import resolve_policy
from maxfp4.step_memory import CheckedStep, StepDoesNotFit, planned_bytes
from maxfp4.train import init_state, jit_train_step
from tests.test_step import _batch


def _jitted_step(cfg):
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    optimizer = make_optimizer(cfg)
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    state, state_sh = init_state(cfg, mesh, optimizer, policy)
    step = jit_train_step(cfg, policy, optimizer, make_schedule(cfg), mesh, state_sh, {})
    batches = [{k: jax.device_put(v, batch_sharding(mesh)) for k, v in _batch(cfg, seed=i).items()} for i in range(2)]
    return state, step, batches, lambda: init_state(cfg, mesh, optimizer, policy)[0]


def _host(tree):
    return [np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
            for x in jax.tree.leaves(tree)]


def test_checked_step_runs_the_steps_jit_runs_and_says_xlas_plan(tiny_cfg):
    cfg = tiny_cfg("mesh.data=1")
    state, step, batches, fresh_state = _jitted_step(cfg)
    said = []
    checked = CheckedStep(step, limit_bytes=2**40, say=said.append)
    state_a, state_b = state, fresh_state()  # the steps donate their state
    for batch in batches:
        state_a, metrics_a = checked(state_a, batch)
        state_b, metrics_b = step(state_b, batch)
        assert float(metrics_a["loss"]) == float(metrics_b["loss"])
    for a, b in zip(_host(state_a), _host(state_b)):
        assert np.array_equal(a, b)  # the same program: bit for bit
    expected = planned_bytes(step.lower(state_b, batches[0]).compile().memory_analysis())
    # the state's bytes, at least: the plan holds the arguments
    assert checked.planned == expected >= sum(x.nbytes for x in jax.tree.leaves(state_b))
    size = f"{expected / 2**30:.1f} GiB" if expected >= 2**30 else f"{expected / 2**20:.1f} MiB"
    assert said == [f"train step compiled: {size} a device by XLA's buffer assignment of the device's 1024.0 GiB"]


def test_a_step_planned_over_the_device_is_refused_in_one_line_before_it_runs(tiny_cfg):
    cfg = tiny_cfg("mesh.data=1")
    state, step, batches, _ = _jitted_step(cfg)
    planned = planned_bytes(step.lower(state, batches[0]).compile().memory_analysis())
    checked = CheckedStep(step, limit_bytes=planned - 1)
    with pytest.raises(StepDoesNotFit) as refused:
        checked(state, batches[0])
    line = str(refused.value)
    assert "\n" not in line and f"needs {planned / 2**20:.1f} MiB a device by XLA's buffer assignment" in line
    assert "shard more (mesh.fsdp)" in line and "nothing was trained" in line
    assert int(state.step) == 0  # not donated: nothing ran
    assert all(not x.is_deleted() for x in jax.tree.leaves(state))


def test_training_on_a_device_too_small_for_the_compiled_step_stops_before_step_one(tiny_cfg, tmp_path, monkeypatch):
    """A device whose allocator limit (what memory_stats() reports on a GPU; the CPU reports
    none) is below the compiled step's plan: the run stops at the first call with the one
    line, no step, no checkpoint, no crash report."""
    import io

    import maxfp4.train as train_module

    monkeypatch.setattr(train_module, "device_limit_bytes", lambda device: 2**20)
    with pytest.raises(StepDoesNotFit, match=r"over the device's 1\.0 MiB; shard more"):
        train_module.train(tiny_cfg("run.name=small", "mesh.data=1", "checkpoint.every=1"),
                           devices=jax.devices()[:1], stream=io.StringIO())
    run = tmp_path / "small"
    assert (run / "config.yaml").exists() and not (run / "crash.json").exists()
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text() == ""
