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
        "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
        "model.d_ff=128", "model.vocab_size=512", "data.source=builtin", "data.seq_len=64",
        "data.global_batch=8", "train.steps=50", "train.log_every=10", "optim.lr=3e-3",
        "optim.warmup_steps=5", f"run.output_dir={tmp_path}", "run.name=tiny"])
    out = io.StringIO()
    records = train(cfg, devices=jax.devices()[:1], stream=out)

    first, last = records[0], records[-1]
    assert first["step"] == 1 and last["step"] == 50
    # ln(512) = 6.24 at the start; a model that learns nothing stays near the unigram entropy.
    # Measured drop after 50 steps: 1.83.
    assert first["loss"] - last["loss"] > 1.5, (first["loss"], last["loss"])

    run_dir = tmp_path / "tiny"
    for name in ("config.yaml", "precision_table.txt", "metrics.jsonl", "tokenizer.model"):
        assert (run_dir / name).is_file(), name
    assert glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == list(range(1, 51))  # every step; the terminal every 10
    for rec in lines:
        assert REQUIRED_KEYS <= set(rec)
    assert all(rec["tokens_per_s"] > 0 for rec in lines[1:])
    assert lines[-1]["mfu"] is None  # no MFU on CPU
    # The resolved config round-trips to the same run.
    again = load_config(str(run_dir / "config.yaml"))
    assert again == cfg
    assert "bf16" in (run_dir / "precision_table.txt").read_text()
    assert "step     50/50" in out.getvalue()

    png = tmp_path / "cmp.png"
    assert plot_main([str(run_dir), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert plot_main([str(tmp_path / "nope"), "-o", str(png)]) == 2


def test_profile_steps_write_a_trace_and_disabled_checkpoints_write_none(tiny_cfg, tmp_path):
    """The trace holds the profiled steps; writing it holds the host, so the steps fetched
    after it (up to the last profiled one) carry no step time, and the next ones do."""
    cfg = tiny_cfg("train.steps=6", "train.profile_steps=[2,3]", "checkpoint.enabled=false", "run.name=prof",
                   "train.log_every=1")
    train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    run_dir = tmp_path / "prof"
    traces = glob.glob(str(run_dir / "profile" / "**" / "*.xplane.pb"), recursive=True)
    assert traces and all(os.path.getsize(t) > 0 for t in traces)
    assert not glob.glob(str(run_dir / "checkpoints" / "*"))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    timed = {r["step"]: r.get("step_time_s") is not None for r in records if "loss" in r}
    assert timed == {1: False, 2: False, 3: False, 4: True, 5: True, 6: True}, records


def test_unknown_compiler_option_is_a_config_error_before_the_run_dir_exists(tiny_cfg, tmp_path):
    import pytest

    from maxfp4.config import ConfigError

    cfg = tiny_cfg("train.compiler_options={xla_no_such_option: true}", "run.name=badopt")
    with pytest.raises(ConfigError, match="xla_no_such_option"):
        train(cfg, devices=jax.devices()[:1])
    assert not (tmp_path / "badopt").exists()


def test_compile_cache_is_written_where_configured_and_an_existing_one_wins(tiny_cfg, tmp_path):
    """A training process with no cache set writes its compiled programs under
    run.compile_cache_dir (the next run with the same config loads them); in this process the
    test session's JAX_COMPILATION_CACHE_DIR is set, and the configured directory is left alone."""
    import subprocess
    import sys

    from maxfp4.compiler import use_compile_cache

    cache = tmp_path / "xla-cache"
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-m", "maxfp4.train", "configs/quickstart.yaml", "train.steps=2",
                           "model.n_layers=1", "data.global_batch=8", "optim.warmup_steps=1", "checkpoint.enabled=false",
                           f"run.output_dir={tmp_path}", "run.name=cached", f"run.compile_cache_dir={cache}"],
                          env=env, cwd=env["PYTHONPATH"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"compilation cache {cache}" in proc.stdout
    assert cache.is_dir() and any(cache.iterdir())  # the train step, at least

    elsewhere = tmp_path / "unused"
    session_cache = jax.config.jax_compilation_cache_dir
    assert session_cache and use_compile_cache(str(elsewhere)) == session_cache
    assert jax.config.jax_compilation_cache_dir == session_cache and not elsewhere.exists()


def test_the_cpu_emitter_flag_is_used_only_where_this_xla_takes_it():
    """tests/conftest.py (and benchmarks/adversarial.py) pass ``--xla_cpu_use_fusion_emitters``
    only where ``xla_knows_cpu_fusion_emitters_flag``: XLA aborts the process at a flag it does
    not know (jaxlib 0.11), and the whole suite with it. A process with the flag runs exactly
    when the function says so."""
    import subprocess
    import sys

    from maxfp4.compiler import xla_knows_cpu_fusion_emitters_flag

    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert (proc.returncode == 0 and proc.stdout.strip() == "3.0") == xla_knows_cpu_fusion_emitters_flag(), \
        proc.stderr[-500:]
    if not xla_knows_cpu_fusion_emitters_flag():  # the suite's own processes run without it
        assert "--xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]


def test_two_step_run_measures_its_rate_without_the_compile_and_says_so(tiny_cfg, tmp_path):
    """Step 2 sleeps 0.5 s on the host before its dispatch (a slow host, injected), so its real
    step time is at least 0.5 s: the rate may not exceed tokens / 0.5 s (the old measure left the
    sleep out and printed an absurd rate). Step 1 (tracing and compiling) is timed once, said
    once, and left out of tok/s; on CPU there is no peak, so no TFLOP/s or MFU is printed."""
    import time

    cfg = tiny_cfg("train.steps=2", "checkpoint.enabled=false", "run.name=two",
                   "resilience.fault.slow_process=0", "resilience.fault.slow_seconds=0.5")
    out = io.StringIO()
    start = time.perf_counter()
    records = train(cfg, devices=jax.devices()[:1], stream=out)
    wall_s = time.perf_counter() - start
    first, second = records
    assert first["step"] == 1 and first["tokens_per_s"] is None and first["step_time_s"] is None
    assert 0 < first["compile_s"] <= first["first_step_s"] < wall_s
    # The compile's two phases, timed inside the first dispatch.
    assert 0 < first["lower_s"] and 0 < first["xla_compile_s"]
    assert first["lower_s"] + first["xla_compile_s"] <= first["compile_s"]
    tokens = cfg.data.global_batch * cfg.data.seq_len
    assert 0.5 <= second["step_time_s"] < wall_s - first["first_step_s"]
    assert 0 < second["tokens_per_s"] <= tokens / 0.5
    assert second["tflops_per_device"] > 0 and second["mfu"] is None  # measured, but no CPU peak to divide by
    text = out.getvalue()
    lines = [l for l in text.splitlines() if l.startswith("step ")]
    assert "tracing and compiling (lowering " in lines[0] and " s, XLA " in lines[0]
    assert "(not counted in tok/s)" in lines[0] and "tok/s |" not in lines[0]
    assert text.count("compiling") == 1
    assert "tok/s" in lines[1] and "TFLOP" not in text and "MFU" not in text
    assert "measured 1 step(s)" in text and "not counted" in text.splitlines()[-1]


def test_failed_preflight_leaves_no_run_directory(tiny_cfg, tmp_path):
    """A preflight that fails (a data file that does not exist) ends with its one-line error and
    leaves neither the run directory nor the output directory it would have created."""
    import pytest

    from maxfp4.reliability.preflight import PreflightFailed

    out_dir = tmp_path / "fresh" / "runs"
    cfg = tiny_cfg("data.source=text", f"data.paths=[{tmp_path / 'missing.txt'}]", "run.name=pf",
                   f"run.output_dir={out_dir}")
    with pytest.raises(PreflightFailed, match="preflight data"):
        train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    assert not (tmp_path / "fresh").exists()
    # The disk check alone (python -m maxfp4.preflight) probes the directory and removes it again.
    from maxfp4.reliability.preflight import check_output
    assert check_output(cfg, 1000, 0).ok and not (tmp_path / "fresh").exists()
    # An existing output directory and what it holds are kept.
    out_dir.mkdir(parents=True)
    (out_dir / "other.txt").write_text("kept")
    with pytest.raises(PreflightFailed):
        train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    assert sorted(os.listdir(out_dir)) == ["other.txt"]
