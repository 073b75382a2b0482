"""Elastic restarts: a run checkpointed on one device count resumes on another with the same
global batch, learning-rate schedule and data position (maxfp4/elastic.py, docs/CHECKPOINTS.md)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from maxfp4 import elastic
from maxfp4.config import ConfigError, load_config
from maxfp4.config_diff import math_differences
from maxfp4.data import make_batches
from tests.conftest import TINY, cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _saved(global_batch=8, microbatches=1, data=8, fsdp=1):
    """A checkpoint's saved config dict, as the run that wrote it resolved its mesh."""
    return {"data": {"global_batch": global_batch}, "train": {"microbatches": microbatches},
            "mesh": {"data": data, "fsdp": fsdp, "tensor": 1}}


def _fit(cfg, mesh, saved):
    said = []
    out = elastic.fit_to_mesh(cfg, dict(zip(("data", "fsdp", "tensor"), mesh)), saved, say=said.append)
    return out, said


# ----------------------------------------------------------------------------- the start-up rule


def test_first_start_keeps_the_config(tiny_cfg):
    cfg = tiny_cfg("mesh.data=-1", "mesh.fsdp=2")
    out, said = _fit(cfg, (4, 2, 1), None)
    assert out == cfg and said == []


def test_a_checkpoint_records_the_mesh_it_was_sharded_over(tiny_cfg, tmp_path):
    """The saved config's mesh axes are the sizes the state had (mesh.data=-1 resolved), so the
    next start knows the rows a device; config.yaml keeps -1, so it still runs anywhere."""
    import jax
    from maxfp4.checkpoint import Checkpointer, saved_config
    from maxfp4.parallel.mesh import make_mesh
    from maxfp4.optim import make_optimizer
    from maxfp4.train import init_state
    cfg = tiny_cfg("mesh.data=-1", "mesh.fsdp=2", "run.name=mesh")
    mesh = make_mesh(cfg.mesh, jax.devices()[:4])
    state, _ = init_state(cfg, mesh, make_optimizer(cfg))
    ck = Checkpointer(cfg.run_dir, cfg.checkpoint)
    ck.save(1, state, {"next_index": 1, "global_batch": 8}, cfg.to_dict())
    ck.close()
    saved, _ = saved_config(cfg.run_dir)
    assert saved["mesh"] == {"data": 2, "pipeline": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 1,
                             "pipeline_repeats": 1, "pipeline_overlap": False, "shard_optimizer_over_data": False,
                             "sequence_parallel": False}
    assert elastic.saved_rows_per_device(saved) == 2
    assert ck.restore(1, state)[1] == {"next_index": 1, "global_batch": 8}  # integrity holds


def test_fewer_devices_raise_microbatches_to_the_checkpoints_rows_a_device(tiny_cfg):
    """8 rows on 8 devices (1 each); restarted on 4: 2 microbatches of 1 row a device."""
    out, said = _fit(tiny_cfg(), (4, 1, 1), _saved(data=8))
    assert out.train.microbatches == 2 and out.data.global_batch == 8
    assert said == ["elastic: 4 data x fsdp devices, the checkpoint trained with 1 row(s) a device a microbatch: "
                    "train.microbatches 1 -> 2 (1 row(s) a device a microbatch), data.global_batch=8 kept"]
    out, _ = _fit(tiny_cfg(), (2, 1, 1), _saved(data=8))
    assert out.train.microbatches == 4


def test_more_devices_lower_microbatches_again(tiny_cfg):
    """The checkpoint of the 4-device start (2 microbatches) resumed on 8 devices with the
    config of the first start: 1 microbatch again, said against the checkpoint's 2."""
    out, said = _fit(tiny_cfg(), (8, 1, 1), _saved(microbatches=2, data=4))
    assert out.train.microbatches == 1 and len(said) == 1 and "train.microbatches 2 -> 1" in said[0]


def test_microbatches_raised_by_the_user_are_kept(tiny_cfg):
    out, said = _fit(tiny_cfg("train.microbatches=4"), (2, 1, 1), _saved(microbatches=4, data=2))
    assert out.train.microbatches == 4 and said == []


def test_elastic_off_or_an_old_checkpoint_without_a_resolved_mesh_changes_nothing(tiny_cfg):
    out, said = _fit(tiny_cfg("train.elastic=false"), (4, 1, 1), _saved(data=8))
    assert out.train.microbatches == 1 and said == []
    out, said = _fit(tiny_cfg(), (4, 1, 1), _saved(data=-1))
    assert out.train.microbatches == 1 and said == []


def test_a_batch_no_microbatch_count_can_split_is_one_line(tiny_cfg):
    with pytest.raises(ConfigError) as e:
        _fit(tiny_cfg("data.global_batch=12"), (8, 1, 1), _saved(global_batch=12, data=4))
    assert str(e.value).startswith("data.global_batch=12: the checkpoint's batch cannot split over the 8 data x "
                                   "fsdp devices") and "\n" not in str(e.value)


def test_changed_microbatches_resume_only_while_elastic():
    old = load_config(None, TINY).to_dict()
    new = load_config(None, TINY + ["train.microbatches=2"]).to_dict()
    assert math_differences(old, new) == []
    rigid = load_config(None, TINY + ["train.microbatches=2", "train.elastic=false"]).to_dict()
    assert math_differences(old, rigid) == ["train.microbatches: 1 -> 2"]


# ----------------------------------------------------------------------------- the data position


@pytest.mark.parametrize("source", ["builtin", "synthetic"])
@pytest.mark.parametrize("before, after", [(2, 1), (1, 4)])
def test_data_position_is_global_across_process_counts(tmp_path, source, before, after):
    """The saved position counts global batches: the iterators of another process count continue
    with the same global batches (their shares concatenate to what the old processes would have
    read next), across the builtin corpus's first epoch boundary (8 batches of 512 rows)."""
    cfg = load_config(None, [f"data.source={source}", "model.vocab_size=512", "data.seq_len=64",
                             "data.global_batch=512", f"run.output_dir={tmp_path}"])
    run_dir = str(tmp_path / "run")
    old = [make_batches(cfg, run_dir, process_index=p, process_count=before) for p in range(before)]
    for it in old:
        for _ in range(7):
            next(it)
    states = [it.get_state() for it in old]
    assert all(s == states[0] for s in states)  # every process saves the same position
    expected = []
    for _ in range(3):
        shares = [next(it) for it in old]
        expected.append({k: np.concatenate([s[k] for s in shares]) for k in ("inputs", "targets", "loss_mask")})
    new = [make_batches(cfg, run_dir, process_index=p, process_count=after) for p in range(after)]
    for it in new:
        it.set_state(states[0])
    for want in expected:
        got = [next(it) for it in new]
        for k, v in want.items():
            np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), v, err_msg=k)


# ----------------------------------------------------------------------------- real processes

# The tiny model of tests/test_multiprocess.py on the builtin corpus; the schedule pinned to 18
# steps so that stopping at 6 and 12 does not change it.
COMMON = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
    "model.vocab_size=512", "data.source=builtin", "data.seq_len=32", "data.global_batch=8",
    "train.log_every=1", "optim.warmup_steps=2", "optim.lr=1e-2", "optim.schedule_steps=18",
    "resilience.preflight=false", "mesh.data=-1",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(run_dir, steps: int, processes: int, devices: int, extra=()) -> list[str]:
    args = [sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml"), *COMMON,
            f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}", f"train.steps={steps}", *extra]
    if processes > 1:
        port = _free_port()
        args += [f"distributed.coordinator=127.0.0.1:{port}", f"distributed.num_processes={processes}"]
    procs = [subprocess.Popen(args + ([f"distributed.process_id={i}"] if processes > 1 else []),
                              env=cpu_env(devices), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(processes)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    return outs


def _records(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as fh:
        return [json.loads(line) for line in fh]


def test_two_processes_then_one_then_two_follow_the_uninterrupted_run(tmp_path):
    """2 processes x 4 devices for 6 steps, 1 x 4 for 6 (microbatches 1 -> 2), 2 x 4 for 6
    (back to 1), against an uninterrupted 2 x 4 run of 18 steps: the same learning rate at every
    step (the schedule is the step's), and the same losses to 2e-3 relative (the tolerance of
    tests/test_multiprocess.py for the changed reduction order of split BF16 GEMMs; here the
    microbatches' summation order and one process's reductions). The 2 x 4 starts compile the
    reference's step again, so they load it from the session's compilation cache."""
    whole = tmp_path / "whole"
    _train(whole, 18, 2, 4)  # trains the tokenizer the elastic run shares
    tok = [f"data.tokenizer={whole / 'tokenizer.model'}"]
    run = tmp_path / "elastic"
    _train(run, 6, 2, 4, tok)
    outs = _train(run, 12, 1, 4, tok)
    assert ("elastic: 4 data x fsdp devices, the checkpoint trained with 1 row(s) a device a microbatch: "
            "train.microbatches 1 -> 2") in outs[0]
    outs = _train(run, 18, 2, 4, tok)
    assert "train.microbatches 2 -> 1" in outs[0] and "elastic:" not in outs[1]  # process 0 says it
    ref, got = _records(whole), _records(run)
    assert [r["step"] for r in got] == list(range(1, 19)) == [r["step"] for r in ref]
    for a, b in zip(ref, got):
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-6)
        assert abs(a["loss"] - b["loss"]) <= 2e-3 * a["loss"], (a["step"], a["loss"], b["loss"])
    assert got[-1]["loss"] < got[0]["loss"]
