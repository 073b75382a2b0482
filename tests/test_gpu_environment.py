"""The GPU settings the trainer puts in its environment before JAX starts the GPU backend."""

import os
import re
import subprocess
import sys

import pytest

from maxfp4.config import ConfigError, load_config
from maxfp4.distributed import GPU_ENVIRONMENT_DEFAULTS, set_gpu_environment_defaults, set_gpu_memory_fraction


def test_defaults_fill_only_what_the_environment_leaves_unset():
    env = {"PATH": "/bin"}
    assert set_gpu_environment_defaults(env) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert env == {"PATH": "/bin", **GPU_ENVIRONMENT_DEFAULTS}

    mine = {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}
    assert set_gpu_environment_defaults(mine) == {}
    assert mine == {"CUDA_DEVICE_MAX_CONNECTIONS": "32"}  # a user's own value wins


def test_the_memory_fraction_is_the_configs_unless_the_environment_sets_one():
    env = {}
    assert set_gpu_memory_fraction(0.92, env) == "0.92" and env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.92"}
    mine = {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".6"}
    assert set_gpu_memory_fraction(0.92, mine) == ".6" and mine == {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".6"}


def test_a_memory_fraction_out_of_range_is_one_line():
    with pytest.raises(ConfigError, match=r"run.gpu_memory_fraction=1.5: expected a fraction in \[0.1, 0.99\]"):
        load_config(None, ["run.gpu_memory_fraction=1.5"])


@pytest.mark.gpu
def test_the_trainer_reserves_its_configured_share_of_the_gpu(tmp_path):
    """The trainer sets the fraction before JAX starts the GPU backend: its preflight reads the
    allocator's limit back as that share of the card (nvidia-smi's total), to 2%."""
    total_mib = float(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, check=True).stdout.split()[0])
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    env["CUDA_VISIBLE_DEVICES"] = "0"
    out = subprocess.run([sys.executable, "-m", "maxfp4.train", "configs/quickstart.yaml", "train.steps=1",
                          f"run.output_dir={tmp_path}", "run.gpu_memory_fraction=0.5", "checkpoint.enabled=false",
                          "optim.warmup_steps=0"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    limit_gib = float(re.search(r"of ([0-9.]+) GiB per device", out.stdout + out.stderr).group(1))
    assert abs(limit_gib * 1024 / total_mib - 0.5) <= 0.02, (limit_gib, total_mib)
