"""scripts/slurm/train.sbatch on a real one-node Slurm cluster: two CPU tasks find each other
through Slurm's variables alone and train one 2-device model; a run of two tasks continues as a
job of one (elastic restart).

Needs Slurm (slurm-wlm + munge). As root, a missing cluster is installed and started with
scripts/slurm/local_cluster.sh; otherwise the test fails with a line saying how to get one.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBATCH_SCRIPT = os.path.join(REPO, "scripts", "slurm", "train.sbatch")
CLUSTER = os.path.join(REPO, "scripts", "slurm", "local_cluster.sh")
# The tiny model of tests/test_multiprocess.py, 3 steps, data-parallel over the 2 processes.
TINY = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
    "model.vocab_size=512", "data.source=builtin", "data.seq_len=32", "data.global_batch=8",
    "train.steps=3", "train.log_every=1", "optim.warmup_steps=1", "optim.lr=1e-2", "mesh.data=2",
]
TIMEOUT_S = 240
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}

pytestmark = pytest.mark.slurm


def _cluster_up() -> bool:
    """slurmctld answers and a node is up (it may be busy: the job then waits its turn)."""
    if not shutil.which("sinfo"):
        return False
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return r.returncode == 0 and any(s in ("idle", "mixed", "allocated", "completing") for s in r.stdout.split())


@pytest.fixture(scope="module")
def cluster():
    if _cluster_up():
        return
    if os.geteuid() != 0:
        pytest.fail("no running Slurm cluster: as root run `bash scripts/slurm/local_cluster.sh install && "
                    "bash scripts/slurm/local_cluster.sh start`", pytrace=False)
    for cmd in ("install", "start"):
        r = subprocess.run(["bash", CLUSTER, cmd], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"local_cluster.sh {cmd} failed:\n{r.stdout}\n{r.stderr}"


def _job_fields(job_id: str) -> dict:
    r = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return {}
    return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)


def _sbatch(tmp_path, name: str, tasks: int, *overrides: str) -> tuple[str, dict, str]:
    """Submit train.sbatch with ``tasks`` CPU tasks on one node and wait for the job to finish:
    (job id, its scontrol fields, its log)."""
    # slurmd starts the job in another working directory: every path is absolute.
    out = tmp_path / f"{name}.out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    # conftest.py asks for 8 virtual devices; here each process must have exactly one (the
    # script's default): the session's other XLA flags (quick compilation) without the count.
    env["XLA_FLAGS"] = cpu_env()["XLA_FLAGS"]
    env.update(MAXFP4_CPU="1", MAXFP4_PYTHON=sys.executable)
    submit = subprocess.run(
        ["sbatch", "--parsable", "--job-name=maxfp4-test", "--nodes=1", f"--ntasks-per-node={tasks}",
         "--gpus-per-node=0", "--cpus-per-task=1", "--time=5", "--no-requeue",
         f"--chdir={tmp_path}", f"--output={out}",
         SBATCH_SCRIPT, os.path.join(REPO, "configs", "quickstart.yaml"), *TINY, *overrides,
         f"run.output_dir={tmp_path}", "run.name=slurm"],
        env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.strip().split(";")[0]

    deadline = time.monotonic() + TIMEOUT_S
    fields = {}
    while time.monotonic() < deadline:
        fields = _job_fields(job_id)
        if fields.get("JobState") in FINISHED:
            break
        time.sleep(1)
    else:
        subprocess.run(["scancel", job_id], timeout=30)
        log = out.read_text() if out.exists() else "(no output file)"
        pytest.fail(f"job {job_id} not finished after {TIMEOUT_S} s ({fields.get('JobState')}):\n{log[-3000:]}")
    log = out.read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields, log[-3000:])
    return job_id, fields, log


def _metrics(tmp_path) -> list[dict]:
    with open(tmp_path / "slurm" / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


def test_sbatch_two_cpu_tasks_train_one_mesh(cluster, tmp_path):
    job_id, _, log = _sbatch(tmp_path, "job", 2)
    for rank in (0, 1):
        assert re.search(rf"^\[process {rank}\] Slurm job {job_id}, task {rank} of 2 .*; 1 local of 2 devices$",
                         log, re.M), log[-3000:]
    assert "on 2 cpu device(s)" in log
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    losses = [r["loss"] for r in records]
    assert losses[-1] < losses[0], losses


def test_a_run_of_two_tasks_continues_as_a_job_of_one(cluster, tmp_path):
    """A node lost, on the one-node cluster: the run checkpointed by a 2-task job resumes in a
    1-task job of the same run.name, its global batch kept by 2 microbatches of the 4 rows a
    device it trained with (maxfp4.elastic), and trains on to step 6."""
    elastic = ["mesh.data=-1", "optim.schedule_steps=6"]
    _sbatch(tmp_path, "first", 2, *elastic)
    _, _, log = _sbatch(tmp_path, "second", 1, *elastic, "train.steps=6")
    assert "on 1 node(s)" in log and ": 1 tasks," in log
    assert ("elastic: 1 data x fsdp devices, the checkpoint trained with 4 row(s) a device a microbatch: "
            "train.microbatches 1 -> 2 (4 row(s) a device a microbatch), data.global_batch=8 kept") in log, log[-3000:]
    assert "resumed from" in log and "on 1 cpu device(s)" in log
    records = _metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[-1]["loss"] < records[0]["loss"]
