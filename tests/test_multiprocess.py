"""Two real JAX processes on loopback (gloo collectives) x 4 CPU devices each train exactly like
one process with 8 devices and like one device: same global batch, same losses."""

import json
import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
    "model.vocab_size=512", "data.source=builtin", "data.seq_len=32", "data.global_batch=8",
    "train.steps=3", "train.log_every=1", "optim.warmup_steps=1", "optim.lr=1e-2",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line)["loss"] for line in fh]


def _train(tmp_path, name, devices, extra=(), n_proc=1):
    args = [sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml"),
            *COMMON, f"run.output_dir={tmp_path}", f"run.name={name}", *extra]
    if n_proc == 1:
        subprocess.run(args, env=cpu_env(devices), check=True, capture_output=True, timeout=300)
        return _losses(tmp_path / name), None
    port = _free_port()
    procs = [subprocess.Popen(args + [f"distributed.coordinator=127.0.0.1:{port}",
                                      f"distributed.num_processes={n_proc}", f"distributed.process_id={i}"],
                              env=cpu_env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(n_proc)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return _losses(tmp_path / name), outs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ref")
    # Train the tokenizer once and share it, so every run sees identical token ids.
    one, _ = _train(tmp, "one_device", 1, ["mesh.data=1"])
    return tmp, one


def test_two_processes_match_one_process_and_one_device(reference, tmp_path):
    tmp, one = reference
    tok = [f"data.tokenizer={tmp / 'one_device' / 'tokenizer.model'}"]
    eight, _ = _train(tmp_path, "eight", 8, tok + ["mesh.data=2", "mesh.fsdp=4"])
    two, outs = _train(tmp_path, "two", 4, tok + ["mesh.data=2", "mesh.fsdp=4"], n_proc=2)
    assert len(one) == len(eight) == len(two) == 3
    # BF16 GEMMs reduce in a different order when split: agreement to 2e-3 relative.
    for a, b, c in zip(one, eight, two):
        assert abs(a - b) <= 2e-3 * a and abs(a - c) <= 2e-3 * a, (one, eight, two)
    assert one[-1] < one[0]
    # Both processes joined one 8-device mesh; only process 0 printed progress.
    assert all("[process" in o for o in outs)
    assert "8 cpu device(s)" in outs[0]
    assert "step      3/3" in outs[0] and "step      3/3" not in outs[1]


def test_two_processes_train_the_hybrid_with_its_kernels_on_each_devices_rows(reference, tmp_path):
    """The hybrid's Mamba-2 kernels (interpret mode) run per device on its rows of the batch
    (shard_map): across two real processes the losses match one device's, to 2e-3 relative as
    above. One Mamba-2 block: the hybrid's attention and MLP blocks are the dense model's
    layers, split across processes by the test above (and the hybrid's own layout of them over
    eight devices in tests/test_step.py), and each block kind adds to every process's compile
    time."""
    tmp, _ = reference
    hybrid = [f"data.tokenizer={tmp / 'one_device' / 'tokenizer.model'}", "model.kind=hybrid",
              "model.pattern=M", "model.mamba.head_dim=16", "model.mamba.d_state=16",
              "model.mamba.chunk_size=16", "model.mamba.kernels=pallas"]
    one, _ = _train(tmp_path, "hybrid_one", 1, hybrid + ["mesh.data=1"])
    two, _ = _train(tmp_path, "hybrid_two", 4, hybrid + ["mesh.data=2", "mesh.fsdp=4"], n_proc=2)
    assert len(one) == len(two) == 3 and one[-1] < one[0]
    for a, c in zip(one, two):
        assert abs(a - c) <= 2e-3 * a, (one, two)
