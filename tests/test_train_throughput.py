"""benchmarks/train_throughput.py's command line: a run is LABEL=ARGS, checked before any runs."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
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
