"""Preflight pieces in process (the CLI and the start-up run are tested end to end in
tests/test_fault_tolerance.py): the flagging rules, a real GEMM timing, the checks' table."""

import jax
import numpy as np
import pytest

from maxfp4.config import load_config
from maxfp4.reliability.preflight import (check_memory, checkpoint_bytes, format_table, gemm_rates, memory_per_device,
                              run_checks, slow_devices, state_sizes, widest_block_recipe)
from maxfp4.reliability.stragglers import slow_processes


def test_straggler_and_slow_device_thresholds():
    assert slow_processes(np.array([0.10, 0.11, 0.30, 0.10]), 1.2) == [2]
    assert slow_processes(np.array([0.001, 0.002]), 1.2) == []  # jitter of milliseconds is no straggler
    assert slow_processes(np.array([5.0]), 1.2) == []
    assert slow_devices([100.0, 98.0, 60.0, 101.0], 0.7) == [2]
    assert slow_devices([100.0, 98.0, 75.0], 0.7) == []


def test_gemm_is_timed_on_each_device():
    rates = gemm_rates(jax.devices()[:2], n=64, iters=1, repeats=1)
    assert len(rates) == 2 and all(r > 0 for r in rates)


def test_checks_pass_for_a_tiny_config_and_estimates_scale(tiny_cfg):
    cfg = tiny_cfg("mesh.data=8")
    checks = run_checks(cfg, jax.devices())
    assert [c.name for c in checks] == ["devices", "gemm", "allreduce", "data", "output", "memory"]
    assert [c.ok for c in checks] == [True, None, True, True, True, True]  # no GEMM off GPU; memory against the host's
    assert "psum over 8 device(s) correct" in format_table(checks)
    n_params, prec = state_sizes(cfg)
    assert checkpoint_bytes(n_params, prec) == 12 * n_params + prec
    one = memory_per_device(cfg, n_params, {"data": 8, "fsdp": 1, "tensor": 1})
    sharded = memory_per_device(cfg, n_params, {"data": 1, "fsdp": 8, "tensor": 1})
    assert sharded < one  # FSDP splits the weights and moments


class _DeviceWithLimit:
    """A device as check_memory reads one: its process and a memory limit (a GPU's
    ``memory_stats()``; the CPU reports none)."""
    process_index = 0

    def __init__(self, limit: int):
        self.limit = limit

    def memory_stats(self):
        return {"bytes_limit": self.limit}


def test_memory_check_fails_past_the_estimates_margin_and_names_what_to_change(tiny_cfg):
    """The planner's estimate may be 17% over a measured peak: a device it puts up to 20% short
    passes (the compiled step is checked exactly, maxfp4.step_memory); past that it fails."""
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    for remat, suggests_full in (("none", True), ("full", False)):
        cfg = tiny_cfg(f"train.remat={remat}")
        n_params, _ = state_sizes(cfg)
        need = memory_per_device(cfg, n_params, mesh)
        assert check_memory(cfg, [_DeviceWithLimit(int(need / 0.8))], n_params, mesh).ok
        assert check_memory(cfg, [_DeviceWithLimit(int(need / 1.15))], n_params, mesh).ok
        failed = check_memory(cfg, [_DeviceWithLimit(int(need / 1.25))], n_params, mesh)
        assert failed.ok is False and "by more than the estimate's 20% margin" in failed.detail
        assert ("set train.remat=full" in failed.detail) == suggests_full
        assert "resilience.preflight=false" in failed.detail


def test_memory_estimate_is_the_planners_in_the_recipe_the_config_runs():
    """The preflight's estimate is the planner's row for the recipe the blocks run (BF16, FP8),
    not the catalog's widest (FP32 would double the kept operands and working weights)."""
    from maxfp4.plan import cost
    mesh = {"data": 1, "fsdp": 1, "tensor": 1}
    for overrides, column in (([], "bf16"), (["precision.default=fp8_delayed"], "fp8")):
        cfg = load_config("configs/dense-1p3b.yaml", overrides)
        assert widest_block_recipe(cfg) == cost.PLAN_RECIPES[column]
        n_params = cost.param_count(cfg.model)
        planned = cost.project(cfg, (1, 1, 1), "h200", column)["memory_per_device_gb"] * 1e9
        assert memory_per_device(cfg, n_params, mesh) == pytest.approx(planned, rel=1e-9)


def test_memory_estimate_with_context_and_expert_axes_is_the_planners(capsys):
    """A context group's device holds T/C tokens of its rows and 1/C of the state: the
    preflight's estimate is the planner's context row (the 64k config on 4 H200s at context=4,
    48 GB where the whole sequence a device was 189), not a refusal. The expert axis splits the
    batch outside the experts as data does: expert=2 estimates as data=2 but for the experts'
    state, which it halves."""
    import json

    from maxfp4.plan import command as plan
    cfg = load_config("configs/llama3-8b-64k.yaml")
    n_params, _ = state_sizes(cfg)
    shape = {"data": 1, "pipeline": 1, "fsdp": 1, "context": 4, "expert": 1, "tensor": 1}
    assert plan.main(["configs/llama3-8b-64k.yaml", "--gpus", "4", "--gpu", "h200", "--tokens", "1e9", "--json"]) == 0
    row = {r["precision"]: r for r in json.loads(capsys.readouterr().out)}["bf16"]
    assert row["context"] == 4
    assert memory_per_device(cfg, n_params, shape) == pytest.approx(row["memory_per_device_gb"] * 1e9, rel=1e-6)
    assert memory_per_device(cfg, n_params, dict(shape, context=1)) > 3 * row["memory_per_device_gb"] * 1e9

    from maxfp4.model_spec import model_spec
    moe = load_config("configs/moe-1b-active.yaml")
    n_moe, _ = state_sizes(moe)
    experts = sum(lin.params_total for b in model_spec(moe.model).blocks for lin in b.linears if lin.experts)
    flat = {"data": 1, "pipeline": 1, "fsdp": 1, "context": 1, "expert": 1, "tensor": 1}
    as_data = memory_per_device(moe, n_moe, dict(flat, data=2))
    as_expert = memory_per_device(load_config("configs/moe-1b-active.yaml", ["mesh.data=1", "mesh.expert=2"]), n_moe,
                                  dict(flat, expert=2))
    from maxfp4.plan import cost
    halved = experts / 2 * (cost.MASTER_BYTES + cost.ADAM_BYTES + cost.GRAD_BYTES)
    assert as_expert < as_data and as_data - as_expert >= halved
