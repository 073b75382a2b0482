"""SIGTERM / SIGINT: the running step finishes, a checkpoint of it is written, the process exits
with 128 + signal, and a rerun resumes from exactly that step."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
        "model.vocab_size=256", "data.source=synthetic", "data.seq_len=32", "data.global_batch=4",
        "train.log_every=1", "optim.warmup_steps=1", "optim.schedule_steps=100000", "mesh.data=1"]


def _run(tmp_path, steps):
    env = cpu_env(1)
    return subprocess.Popen([sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml"),
                             *ARGS, f"run.output_dir={tmp_path}", "run.name=pre", f"train.steps={steps}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps(tmp_path):
    path = tmp_path / "pre" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_checkpoints_and_rerun_resumes(tmp_path, sig):
    proc = _run(tmp_path, 100000)
    deadline = time.time() + 180
    while len(_steps(tmp_path)) < 3:
        assert proc.poll() is None and time.time() < deadline, "training did not get going"
        time.sleep(0.2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, out[-2000:]
    assert "checkpoint saved, rerun to resume" in out
    saved = sorted(int(d) for d in os.listdir(tmp_path / "pre" / "checkpoints"))
    last = _steps(tmp_path)[-1]
    assert saved[-1] == last >= 3  # the step that was running when the signal came

    again = _run(tmp_path, last + 2)
    out2, _ = again.communicate(timeout=180)
    assert again.returncode == 0, out2[-2000:]
    assert "resumed from" in out2 and f"/{last}" in out2
    assert _steps(tmp_path)[-2:] == [last + 1, last + 2]


def test_unhandled_exception_writes_a_crash_report(tmp_path):
    env = cpu_env(1)
    proc = subprocess.run([sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml"),
                           *ARGS, f"run.output_dir={tmp_path}", "run.name=pre", "train.steps=10",
                           "resilience.fault.exception_at_step=4"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    report = json.loads((tmp_path / "pre" / "crash.json").read_text())
    assert report["error"].startswith("InjectedFault: resilience.fault.exception_at_step=4")
    assert "Traceback" in report["traceback"] and report["step"] == 4
    assert report["config"]["resilience"]["fault"]["exception_at_step"] == 4
    assert report["last_metrics"]["step"] == 3  # step 4's metrics were not yet logged
    assert "crash.json" in proc.stdout + proc.stderr
