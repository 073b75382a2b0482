"""run.trackers: W&B (offline run directory) and MLflow (file store) through their own libraries,
resumed into the same tracker runs after a restart, and trackers that fail never stop training."""

import glob
import io
import json
import os
import shutil
import struct
import sys

import jax
import pytest

from maxfp4.config import ConfigError
from maxfp4.train import train
from maxfp4.trackers import Trackers


def wandb_records(run_file: str) -> list:
    """The records of a W&B offline run file, read by hand: a 7-byte header, then LevelDB's log
    format (32 KiB blocks of chunks with a 7-byte header: crc32, length, type; full=1 or first=2,
    middle=3, last=4), each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)


def test_every_scalar_config_and_file_reach_wandb_and_mlflow_and_a_restart_resumes_their_runs(tiny_cfg, tmp_path, offline):
    from mlflow import MlflowClient

    common = ["run.name=tracked", "run.trackers=[tensorboard,wandb,mlflow]", "optim.schedule_steps=8"]
    out = io.StringIO()
    train(tiny_cfg(*common, "train.steps=3"), devices=jax.devices()[:1], stream=out)
    run_dir = tmp_path / "tracked"
    ids = json.loads((run_dir / "trackers.json").read_text())
    train(tiny_cfg(*common, "train.steps=5"), devices=jax.devices()[:1], stream=out)
    assert json.loads((run_dir / "trackers.json").read_text()) == ids  # the restart logged into the same runs
    assert "warning" not in out.getvalue()
    jsonl = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in jsonl}
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))

    # MLflow: the file store beside the runs holds one run with every step's loss, the config, the files.
    client = MlflowClient(tracking_uri=f"file://{tmp_path}/mlruns")
    history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "loss")}
    assert history == losses
    assert {m.step for m in client.get_metric_history(ids["mlflow"], "grad_norm")} == set(losses)
    run = client.get_run(ids["mlflow"])
    assert run.data.params["model.d_model"] == "64" and run.data.params["run.trackers"] == "['tensorboard', 'wandb', 'mlflow']"
    assert run.info.status == "FINISHED"
    assert {"config.yaml", "precision_table.txt", "loss.png"} <= {f.path for f in client.list_artifacts(ids["mlflow"])}

    # W&B: two offline attempts of one run id, their history together holds every step once or more.
    files = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / f"run-{ids['wandb']}.wandb")))
    assert len(files) == 2
    logged, config, artifacts = {}, {}, set()
    for f in files:
        for record in wandb_records(f):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                if "loss" in item:
                    logged[item["step"]] = item["loss"]
            elif kind in ("run", "config"):
                updates = record.run.config.update if kind == "run" else record.config.update
                config.update({u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates})
            elif kind == "artifact":
                artifacts |= {m.path for m in record.artifact.manifest.contents}
    assert logged == losses
    assert config["model.d_model"] == 64, sorted(config)[:5]
    assert {"config.yaml", "precision_table.txt", "loss.png"} <= artifacts


def test_a_tracker_that_fails_to_start_or_loses_its_store_warns_once_and_the_rest_go_on(tmp_path, monkeypatch, offline):
    lines = []
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    trackers = Trackers(["tensorboard", "mlflow"], str(tmp_path), config={"a": 1}, say=lines.append)
    assert trackers.names == ["tensorboard"] and len(lines) == 1 and lines[0].startswith("warning: tracker mlflow failed")

    lines.clear()
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    trackers = Trackers(["mlflow", "tensorboard"], str(run_dir), config={"a": 1}, say=lines.append)
    trackers.log_scalars(1, {"loss": 2.0})
    shutil.rmtree(tmp_path / "mlruns")  # the store is gone, as a lost server would be
    for step in (2, 3, 4):
        trackers.log_scalars(step, {"loss": 1.0})
    trackers.close()
    assert len(lines) == 1 and "tracker mlflow failed" in lines[0] and "training goes on" in lines[0]
    assert trackers.names == [] and glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))


def test_unknown_tracker_and_missing_library_are_one_line_before_anything_is_written(tiny_cfg, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"run.trackers=\['wandbb'\]: expected names from tensorboard, wandb, "
                                          r"mlflow \(did you mean 'wandb'\?\)"):
        tiny_cfg("run.trackers=[wandbb]")
    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python marks a package as not importable
    with pytest.raises(ConfigError, match=r'needs the wandb package, which is not installed; pip install -e "\.\[wandb\]"'):
        train(tiny_cfg("run.trackers=[wandb]", "run.name=nolib"), devices=jax.devices()[:1], stream=io.StringIO())
    assert not os.path.exists(tmp_path / "nolib")
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # a core dependency: no extra installs it
    with pytest.raises(ConfigError, match=r"needs the tensorboardX package, which is not installed; pip install "
                                          r"tensorboardX or drop tensorboard"):
        train(tiny_cfg("run.name=nolib"), devices=jax.devices()[:1], stream=io.StringIO())
    assert not os.path.exists(tmp_path / "nolib")
