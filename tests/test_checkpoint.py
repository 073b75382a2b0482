"""Orbax checkpoints: a rerun with the same run name resumes exactly (parameters, optimizer,
FP8 scaling state, data position, RNG)."""

import io
import json
import os

from maxfp4.config import load_config
from maxfp4.train import train

BASE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
        "model.vocab_size=512", "data.source=builtin", "data.seq_len=32", "data.global_batch=8",
        "train.log_every=1", "optim.warmup_steps=1", "optim.lr=3e-3", "optim.schedule_steps=6",
        "mesh.data=1", "precision.default=fp8_delayed", "precision.rules=[{classes: [mlp_down], recipe: nvfp4}]",
        "precision.recipes={fp8_delayed: {amax_history: 4}}"]


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return {r["step"]: r["loss"] for r in map(json.loads, fh)}


def test_resume_continues_exactly(tmp_path):
    import jax
    dev = jax.devices()[:1]
    full = load_config(None, BASE + [f"run.output_dir={tmp_path}", "run.name=full", "train.steps=6"])
    train(full, devices=dev, stream=io.StringIO())

    tok = [f"data.tokenizer={tmp_path / 'full' / 'tokenizer.model'}"]
    first = load_config(None, BASE + tok + [f"run.output_dir={tmp_path}", "run.name=split", "train.steps=3",
                                            "checkpoint.every=2", "checkpoint.keep=2"])
    train(first, devices=dev, stream=io.StringIO())
    ckpts = sorted(os.listdir(tmp_path / "split" / "checkpoints"))
    assert ckpts == ["2", "3"], ckpts  # every 2 steps and at the end
    out = io.StringIO()
    second = load_config(None, BASE + tok + [f"run.output_dir={tmp_path}", "run.name=split", "train.steps=6",
                                             "checkpoint.every=2", "checkpoint.keep=2"])
    recs = train(second, devices=dev, stream=out)
    assert [r["step"] for r in recs] == [4, 5, 6]
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "split")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # the rerun appended to the same metrics file
    for step in range(1, 7):
        # Same program, same inputs, same state: identical up to float32 noise of 1e-6.
        assert abs(a[step] - b[step]) <= 1e-6 * a[step], (step, a[step], b[step])
    assert sorted(os.listdir(tmp_path / "split" / "checkpoints")) == ["4", "6"]  # keep=2
