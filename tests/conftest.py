"""Test setup (before JAX starts): 8 virtual CPU devices for mesh tests, XLA's quick CPU code
generation, and one persistent compilation cache for the session, shared with the training
processes the tests start (through the environment), so a rerun or resume of the same config
loads its step instead of compiling it again."""

import atexit
import gc
import importlib.util
import os
import shutil
import tempfile

from maxfp4.compiler import xla_knows_cpu_fusion_emitters_flag

flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    flags += " --xla_force_host_platform_device_count=8"
if "xla_backend_optimization_level" not in flags:
    # The tests' models are tiny, so compiling dominates running: LLVM's cheap pipeline took the
    # suite from 28.5 to 23.2 minutes on two cores (15.8 with the README's two workers). It
    # changes how fast the CPU code runs, not what it computes (no fast-math either way), and
    # the processes the tests start inherit it.
    flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_gpu_plugin = any(importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
if "xla_cpu_use_fusion_emitters" not in flags and not _gpu_plugin and xla_knows_cpu_fusion_emitters_flag():
    # XLA's CPU fusions through its older loop emitters instead of the MLIR fusion emitters:
    # compiling a tiny hybrid's training run took 4.7 s instead of 7.4 (the same losses, bit for
    # bit), and compiling is most of the suite's time. Only where JAX has no GPU plugin (a GPU
    # machine's tests do not compile for speed) and where XLA knows the flag (jaxlib 0.10).
    flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = flags.strip()
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="maxfp4-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")

import jax  # noqa: E402
import pytest  # noqa: E402

# One device's computations run on the calling thread, not dispatched asynchronously: the
# Mosaic GPU interpreter's callbacks build jax arrays eagerly while the kernel's computation
# waits for them, and on two cores an eager backward pass dispatched beside them deadlocked
# (tests/test_ssd_mosaic.py, every thread idle for 20 minutes). Read when the CPU client starts.
jax.config.update("jax_cpu_enable_async_dispatch", False)

from maxfp4.config import load_config  # noqa: E402

TINY = [
    "model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
    "model.d_ff=128", "model.vocab_size=256", "data.seq_len=32", "data.global_batch=8",
    "data.source=synthetic", "train.steps=4", "train.log_every=1", "optim.warmup_steps=1",
]


def cpu_env(devices=None, **extra) -> dict:
    """The environment for a process a test starts: this session's XLA flags (the quick
    pipeline above included) with ``devices`` virtual CPU devices in place of the session's 8
    (``None``: no device count, for a launcher that sets its own), on the CPU platform."""
    kept = [f for f in os.environ["XLA_FLAGS"].split() if not f.startswith("--xla_force_host_platform_device_count")]
    if devices is not None:
        kept.insert(0, f"--xla_force_host_platform_device_count={devices}")
    return dict(os.environ, XLA_FLAGS=" ".join(kept), JAX_PLATFORMS="cpu", **extra)


def run_losses(overrides, tmp_path, name, devices=4) -> dict[int, float]:
    """Per-step losses of a run of configs/quickstart.yaml with ``overrides``, trained in this
    process on the first ``devices`` devices into ``tmp_path / name`` (the same name resumes it)."""
    import io
    import json
    from maxfp4.train import train
    cfg = load_config("configs/quickstart.yaml", [*overrides, f"run.output_dir={tmp_path}", f"run.name={name}",
                                                  "resilience.preflight=false"])
    train(cfg, devices=jax.devices()[:devices], stream=io.StringIO())
    with open(tmp_path / name / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.fixture
def tiny_cfg(tmp_path):
    def make(*overrides):
        return load_config(None, TINY + [f"run.output_dir={tmp_path}"] + list(overrides))
    return make


@pytest.fixture
def x64():
    """float64 for this test only; restored afterwards so other tests keep FP32 defaults."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    """Collect the session's garbage once, then freeze the survivors (later collections skip them).
    After an xdist worker reports its end, pytest's unraisable-exception check runs five full
    collections, each walking every object the session keeps (JAX's caches of traced and compiled
    steps: 0.8 million objects and 0.4-0.7 s a collection after a fifth of the suite on two cores),
    and execnet sends SIGINT to a worker still running 5 s after the controller's shutdown: the
    KeyboardInterrupt lands in a gc callback as a stray traceback. This hook runs before the worker
    reports (xdist reports after every sessionfinish), so its one collection is outside those 5 s,
    and an exception from a finalizer it runs still reaches pytest's check."""
    gc.collect()
    gc.freeze()
