"""SIGTERM on a GPU run whose grouped GEMMs use jax's Pallas Mosaic GPU example kernels: importing
them installs absl's failure signal handler (through jax's test utilities), whose alarm aborted
such runs 3 s after the signal, in the middle of their graceful stop. The run must still stop as
every run does: the running step checkpointed, exit code 143, no abort."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sigterm_stops_an_moe_run_with_the_mosaic_grouped_gemms_gracefully(tmp_path):
    # Expert shapes that tile (multiples of 128), and the Mosaic kernels forced: refused off Hopper.
    proc = subprocess.Popen(
        [sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "tiny-moe.yaml"),
         "model.d_model=128", "model.moe.d_ff=128", "model.moe.grouped_gemm=mosaic", "train.steps=100000",
         "train.log_every=1", "optim.schedule_steps=100000", f"run.output_dir={tmp_path}", "run.name=moe"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "moe" / "metrics.jsonl"
    deadline = time.time() + 300
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 3:
        assert proc.poll() is None and time.time() < deadline, "training did not get going"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 143, out[-3000:]
    assert "checkpoint saved, rerun to resume" in out and "SIGTERM received" not in out, out[-3000:]
    last = json.loads(metrics.read_text().splitlines()[-1])["step"]
    assert str(last) in os.listdir(tmp_path / "moe" / "checkpoints")
