"""On a GPU: with run.deterministic=true, two training processes of the same config and seed give
the same loss and gradient norm at every step and bit-identical final parameters, for NVFP4
(stochastic rounding, Hadamard-transform kernels) and FP8 delayed scaling. Each run is its own
process with no persistent compilation cache, so both compile (autotuning included) and run
independently, as a rerun of a crashed job would. Data: the builtin corpus, so rows hold several
documents and attention takes cuDNN's packed kernel, whose backward sums dQ with atomics unless
told not to. About two minutes on an H100.

    python -m pytest -m gpu tests/test_gpu_determinism.py
"""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from maxfp4.checkpoint import read_params
from maxfp4.config import load_config
from maxfp4.model import get_model

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 20
# quickstart's 5M-parameter model, four blocks; 16 x 256 tokens a step.
SMALL = ["model.n_layers=4", "data.seq_len=256", "data.global_batch=16", f"train.steps={STEPS}",
         "train.log_every=1", "optim.warmup_steps=5", "run.seed=1", "run.deterministic=true",
         "run.compile_cache_dir=", "resilience.preflight=false"]
PRESETS = {"nvfp4": ["configs/precision/nvfp4.yaml", "precision.rules=[{classes: [lm_head], recipe: bf16}]"],
           "fp8_delayed": ["configs/precision/fp8.yaml"]}


def _train(tmp_path, name: str, preset: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    # Without the CPU-only flags tests/conftest.py adds (quick LLVM pipeline, virtual devices).
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(
        ("--xla_force_host_platform_device_count", "--xla_backend_optimization_level",
         "--xla_llvm_disable_expensive_passes", "--xla_cpu_use_fusion_emitters")))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH", "")) if p)  # and carried wheels
    args = ["configs/quickstart.yaml", *preset, *SMALL, f"run.output_dir={tmp_path}", f"run.name={name}"]
    proc = subprocess.run([sys.executable, "-m", "maxfp4.train", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "deterministic: on" in proc.stdout, proc.stdout[-2000:]
    return str(tmp_path / name)


def _records(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _params(run_dir: str, preset: list[str]):
    cfg = load_config([os.path.join(REPO, "configs/quickstart.yaml")] +
                      [os.path.join(REPO, p) for p in preset if "=" not in p], [p for p in preset if "=" in p] + SMALL)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    shapes = jax.eval_shape(lambda k: get_model(cfg.model).init_params(cfg.model, k), jax.random.key(0))
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu), shapes)
    return read_params(run_dir, STEPS, abstract)


@pytest.mark.parametrize("recipe", sorted(PRESETS))
def test_two_deterministic_runs_are_bit_identical(tmp_path, recipe):
    preset = PRESETS[recipe]
    first, second = (_train(tmp_path, f"{recipe}-{i}", preset) for i in (1, 2))
    with open(os.path.join(first, "precision_table.txt"), encoding="utf-8") as fh:
        assert recipe in fh.read()  # the preset is what ran
    a, b = _records(first), _records(second)
    assert [r["step"] for r in a] == list(range(1, STEPS + 1)), [r["step"] for r in a]
    differing = [(x["step"], x["loss"], y["loss"], x["grad_norm"], y["grad_norm"]) for x, y in zip(a, b)
                 if (x["loss"], x["grad_norm"]) != (y["loss"], y["grad_norm"])]
    assert not differing, f"steps whose loss or gradient norm differ: {differing[:5]}"
    assert a[-1]["loss"] < a[0]["loss"]  # it trained
    pa, pb = _params(first, preset), _params(second, preset)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(pa), jax.tree.leaves(pb)):
        x, y = np.asarray(x), np.asarray(y)
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32)), (
            f"{jax.tree_util.keystr(path)}: {np.mean(x != y):.3%} of the parameters differ")


@pytest.mark.parametrize("recipe", sorted(PRESETS))
def test_rerun_of_a_skipped_step_reproduces_a_persistent_fault_on_gpu(tmp_path, recipe):
    """``resilience.rerun_skipped`` on a GPU: the second evaluation of a step is a second copy of
    the computation in the compiled step, so the verdict is only worth having if a healthy GPU
    gives the same bits twice. A persistent fault (NaN gradients at steps 8 and 12) and a loss
    spike (x10 at step 16) must each be reproduced (verdict 1), and the good steps not re-run."""
    faults = ["resilience.rerun_skipped=true", "resilience.spike_warmup=4",
              "resilience.fault.nonfinite_at_steps=[8,12]", "resilience.fault.loss_scale=10",
              "resilience.fault.loss_scale_at_step=16"]
    records = _records(_train(tmp_path, f"rerun-{recipe}", PRESETS[recipe] + faults))
    verdicts = {r["step"]: r["rerun_verdict"] for r in records}
    assert verdicts[8] == verdicts[12] == verdicts[16] == 1, verdicts
    assert all(v == 0 for step, v in verdicts.items() if step not in (8, 12, 16) and step < 16), verdicts
