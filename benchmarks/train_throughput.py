"""Training throughput of whole configs: step time, tokens/s, TFLOP/s, MFU and peak memory.

Each run is a config plus overrides, trained on synthetic data for ``--warmup + --steps``
steps with checkpoints off, in its own process (so one run's memory or failure cannot touch the
next). Step times are the median of the steps after the warm-up (the first includes compile).
Prints one table and writes JSON:

    python benchmarks/train_throughput.py \\
        --run "dense-1p3b bf16=configs/dense-1p3b.yaml configs/precision/bf16.yaml" \\
        --run "dense-1p3b fp8=configs/dense-1p3b.yaml configs/precision/fp8.yaml train.remat=save_gemm" \\
        [--steps 10 --warmup 3 --timeout 600 --json out.json] [--cold]

Each row also gives the first step's time (``1st s``) and its compile split into jax's tracing
and lowering and XLA's compile; ``--cold`` gives each run empty compilation caches of its own
(JAX's persistent cache, the CUDA driver's cache of JIT-compiled PTX, Triton's).

A run is ``LABEL=ARGS``: ARGS are what ``python -m maxfp4.train`` takes (YAML files, then
dotted overrides). All visible devices are used, with the config's mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

RESULT_TAG = "THROUGHPUT_RESULT "


def measure_one(args: list[str], steps: int, warmup: int) -> dict:
    """Train in this process and return the measured figures (run in a child process)."""
    from maxfp4.config import load_config
    from maxfp4.distributed import set_gpu_memory_fraction

    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    with tempfile.TemporaryDirectory() as out_dir:
        # A long schedule horizon keeps any warm-up valid for these few steps.
        cfg = load_config(files, ["optim.schedule_steps=100000"] + overrides + [
            "data.source=synthetic", "checkpoint.enabled=false", "train.log_every=1",
            f"train.steps={warmup + steps}", f"run.output_dir={out_dir}", "run.name=bench"])
        set_gpu_memory_fraction(cfg.run.gpu_memory_fraction)  # as the trainer's main does, before JAX starts
        import jax

        from maxfp4.precision import resolve_policy
        from maxfp4.train import train

        with open(os.devnull, "w") as quiet:
            records = train(cfg, stream=quiet)
    timed = [r for r in records if r["step"] > warmup]
    stats = jax.local_devices()[0].memory_stats() or {}
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    recipes = sorted({policy.recipe_for(c, i) for c in ("mlp_up", "attn_qkv", "mamba_in")
                      for i in range(cfg.model.n_layers)})
    step_time = statistics.median(r["step_time_s"] for r in timed)
    tokens = cfg.data.global_batch * cfg.data.seq_len
    n_dev = jax.device_count()
    tflops = statistics.median(r["tflops_per_device"] for r in timed)
    return {
        "devices": n_dev,
        "device": jax.devices()[0].device_kind,
        "mesh": {"data": cfg.mesh.data, "fsdp": cfg.mesh.fsdp, "tensor": cfg.mesh.tensor},
        "recipes": recipes,
        "remat": cfg.train.remat,
        "tokens_per_step": tokens,
        "step_time_s": step_time,
        "tokens_per_s": tokens / step_time,
        "tokens_per_s_per_device": tokens / step_time / n_dev,
        "tflops_per_device": tflops,
        "mfu": statistics.median(r["mfu"] for r in timed) if timed[0]["mfu"] is not None else None,
        "mfu_policy_peak": (statistics.median(r["mfu_policy_peak"] for r in timed)
                            if timed[0]["mfu_policy_peak"] is not None else None),
        "peak_memory_gib": stats.get("peak_bytes_in_use", 0) / 2**30 or None,
        "final_loss": records[-1]["loss"],
        # the first step of the process: tracing, compiling (or loading from the persistent
        # cache, run.compile_cache_dir) and running it
        "first_step_s": records[0].get("first_step_s"),
        # its two compile phases: jax's tracing and lowering, XLA's compile (maxfp4.step_memory)
        "lower_s": records[0].get("lower_s"),
        "xla_compile_s": records[0].get("xla_compile_s"),
    }


def cold_environment(cache_root: str) -> dict[str, str]:
    """The environment of a run whose first step finds nothing compiled: besides its own empty
    JAX cache (``run.compile_cache_dir``), its own empty CUDA driver cache of JIT-compiled PTX
    and Triton cache, which kernels compiled by earlier processes on the machine would
    otherwise warm."""
    return {**os.environ, "CUDA_CACHE_PATH": os.path.join(cache_root, "cuda"),
            "TRITON_CACHE_DIR": os.path.join(cache_root, "triton")}


def run_child(label: str, args: list[str], steps: int, warmup: int, timeout: float,
              env: dict[str, str] | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--steps", str(steps), "--warmup", str(warmup), "--", *args]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"label": label, "args": args, "error": f"timed out after {timeout:.0f} s"}
    wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return {"label": label, "args": args, "wall_s": wall, **json.loads(line[len(RESULT_TAG):])}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"label": label, "args": args, "wall_s": wall, "error": " | ".join(tail)[-400:]}


def write_results(results: list[dict], json_path: str | None) -> int:
    """``results`` as JSON at ``json_path`` (if given); the exit code, 0 when no run failed."""
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=2)
    return 0 if all("error" not in r for r in results) else 1


def format_table(results: list[dict]) -> str:
    head = (f"{'run':<28}{'dev':>4}{'recipes':>22}{'remat':>10}{'step ms':>9}{'tok/s':>10}"
            f"{'tok/s/dev':>10}{'TFLOP/s':>9}{'MFU':>7}{'MFU pol':>8}{'peak GiB':>9}{'1st s':>7}{'lower s':>8}{'XLA s':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['label']:<28} error: {r['error']}")
            continue
        pct = lambda v: f"{100 * v:.1f}%" if v is not None else "-"  # noqa: E731
        lines.append(
            f"{r['label']:<28}{r['devices']:>4}{','.join(r['recipes']):>22}{r['remat']:>10}"
            f"{1e3 * r['step_time_s']:>9.1f}{r['tokens_per_s']:>10.0f}{r['tokens_per_s_per_device']:>10.0f}"
            f"{r['tflops_per_device']:>9.1f}{pct(r['mfu']):>7}{pct(r['mfu_policy_peak']):>8}"
            f"{(r['peak_memory_gib'] or 0):>9.1f}{(r.get('first_step_s') or 0):>7.1f}"
            f"{(r.get('lower_s') or 0):>8.1f}{(r.get('xla_compile_s') or 0):>7.1f}")
    return "\n".join(lines)


def split_run(spec: str) -> tuple[str, list[str]]:
    """``LABEL=ARGS`` -> (label, the arguments): the label ends at the first ``=``, so ARGS must
    begin with a YAML file or a dotted ``key=value``; anything else means the label had an ``=``."""
    label, _, args = spec.partition("=")
    words = shlex.split(args)
    first = words[0] if words else ""
    key = first.partition("=")[0]
    yaml_file = "=" not in first and first.endswith((".yaml", ".yml"))
    if not (yaml_file or ("=" in first and "." in key)):
        raise ValueError(f"--run {spec!r}: expected LABEL=ARGS, a label without '=' and ARGS beginning with a "
                         f"YAML file or a dotted key=value (got {first!r} after the label {label!r})")
    return label.strip(), words


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", action="append", default=[], help="LABEL=ARGS (repeatable)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (the first compiles)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cold", action="store_true",
                        help="each run with empty compilation caches of its own: JAX's, the CUDA driver's, Triton's "
                             "(a cold first step)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.child:
        from maxfp4.distributed import set_gpu_environment_defaults

        set_gpu_environment_defaults()  # as the trainer's own entry point does
        print(RESULT_TAG + json.dumps(measure_one(ns.rest, ns.steps, ns.warmup)), flush=True)
        return 0
    if not ns.run:
        parser.error("give at least one --run LABEL=ARGS")
    try:  # every run checked before the first starts
        runs = [split_run(spec) for spec in ns.run]
    except ValueError as e:
        parser.error(str(e))
    results = []
    with tempfile.TemporaryDirectory(prefix="maxfp4-cold-") as caches:
        for i, (label, args) in enumerate(runs):
            run_args = args + ([f"run.compile_cache_dir={caches}/{i}/jax"] if ns.cold else [])
            env = cold_environment(f"{caches}/{i}") if ns.cold else None
            results.append(run_child(label, run_args, ns.steps, ns.warmup, ns.timeout, env))
            print(format_table(results[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(results))
    return write_results(results, ns.json)


if __name__ == "__main__":
    sys.exit(main())
