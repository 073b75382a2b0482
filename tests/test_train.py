"""End to end: the trainer learns on real text and writes the run directory."""

import glob
import io
import json
import os

import jax

from maxfp4.config import load_config
from maxfp4.plot import main as plot_main
from maxfp4.train import train

REQUIRED_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "mfu", "step_time_s"}


def test_loss_falls_on_builtin_text_and_run_dir_is_complete(tmp_path):
    cfg = load_config(None, [
        "model.d_model=96", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.d_ff=256", "model.vocab_size=512", "data.source=builtin", "data.seq_len=64",
        "data.global_batch=8", "train.steps=80", "train.log_every=10", "optim.lr=3e-3",
        "optim.warmup_steps=8", f"run.output_dir={tmp_path}", "run.name=tiny"])
    out = io.StringIO()
    records = train(cfg, devices=jax.devices()[:1], stream=out)

    first, last = records[0], records[-1]
    assert first["step"] == 1 and last["step"] == 80
    # ln(512) = 6.24 at the start; a model that learns nothing stays near the unigram entropy.
    assert first["loss"] - last["loss"] > 1.5, (first["loss"], last["loss"])

    run_dir = tmp_path / "tiny"
    for name in ("config.yaml", "precision_table.txt", "metrics.jsonl", "tokenizer.model"):
        assert (run_dir / name).is_file(), name
    assert glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 10, 20, 30, 40, 50, 60, 70, 80]
    for rec in lines:
        assert REQUIRED_KEYS <= set(rec)
    assert all(rec["tokens_per_s"] > 0 for rec in lines[1:])
    assert lines[-1]["mfu"] is None  # no MFU on CPU
    # The resolved config round-trips to the same run.
    again = load_config(str(run_dir / "config.yaml"))
    assert again == cfg
    assert "bf16" in (run_dir / "precision_table.txt").read_text()
    assert "step     80/80" in out.getvalue()

    png = tmp_path / "cmp.png"
    assert plot_main([str(run_dir), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert plot_main([str(tmp_path / "nope"), "-o", str(png)]) == 2


def test_profile_steps_write_a_trace_and_disabled_checkpoints_write_none(tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.steps=3", "train.profile_steps=[2,3]", "checkpoint.enabled=false", "run.name=prof")
    train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    run_dir = tmp_path / "prof"
    traces = glob.glob(str(run_dir / "profile" / "**" / "*.xplane.pb"), recursive=True)
    assert traces and all(os.path.getsize(t) > 0 for t in traces)
    assert not glob.glob(str(run_dir / "checkpoints" / "*"))


def test_unknown_compiler_option_is_a_config_error_before_the_run_dir_exists(tiny_cfg, tmp_path):
    import pytest

    from maxfp4.config import ConfigError

    cfg = tiny_cfg("train.compiler_options={xla_no_such_option: true}", "run.name=badopt")
    with pytest.raises(ConfigError, match="xla_no_such_option"):
        train(cfg, devices=jax.devices()[:1])
    assert not (tmp_path / "badopt").exists()
