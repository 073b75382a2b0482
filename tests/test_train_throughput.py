"""benchmarks/train_throughput.py's command line: a run is LABEL=ARGS, checked before any runs; --cold runs
find every compilation cache empty."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import train_throughput  # noqa: E402
from train_throughput import split_run  # noqa: E402


def test_a_run_splits_at_the_labels_end():
    label, args = split_run("dense fp8=configs/dense-1p3b.yaml configs/precision/fp8.yaml train.remat=full")
    assert label == "dense fp8"
    assert args == ["configs/dense-1p3b.yaml", "configs/precision/fp8.yaml", "train.remat=full"]
    assert split_run("overrides only=model.n_layers=2")[1] == ["model.n_layers=2"]


@pytest.mark.parametrize("spec", ["nvfp4 tf=false=configs/dense-1p3b.yaml", "no args", "empty="])
def test_a_label_with_an_equals_sign_or_no_args_is_refused_in_one_line_before_any_run(spec):
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "train_throughput.py"), "--run", spec,
                           "--run", "fine=configs/quickstart.yaml"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert "expected LABEL=ARGS" in proc.stderr and repr(spec) in proc.stderr
    assert proc.stdout == ""  # nothing ran, not even the valid second run


def test_a_cold_run_gets_empty_driver_and_triton_caches_of_its_own(tmp_path, monkeypatch):
    """``--cold``: the CUDA driver's JIT cache and Triton's cache point into the run's own
    (empty) folder; the rest of the environment passes through."""
    monkeypatch.setenv("CUDA_CACHE_PATH", "/somewhere/shared")
    monkeypatch.setenv("MAXFP4_PROBE", "kept")
    env = train_throughput.cold_environment(str(tmp_path / "3"))
    assert env["CUDA_CACHE_PATH"] == str(tmp_path / "3" / "cuda")
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "3" / "triton")
    assert env["MAXFP4_PROBE"] == "kept"
