"""Context parallelism on GPUs: tokens/s per GPU and MFU of long sequences split over mesh.context,
against the same model at 8,192 tokens without a split (the goal: within 15% per GPU at 64k).

One run a (model, sequence length, context degree, precision), each in its own process through
benchmarks/train_throughput.py; the context degrees that do not divide the visible GPUs are
skipped, the rest of the GPUs go to mesh.data (one sequence a data rank). Prints one table and
writes JSON:

    python benchmarks/context_throughput.py --models llama3-8b nemotron-h-8b \\
        --seq-lens 32768 65536 --contexts 2 4 --precisions bf16 fp8 [--steps 5 --warmup 2 --json out.json]

``--skip-baseline`` leaves out the 8,192-token runs (one of them takes ~2 minutes of a GPU call,
compile included), for a call that measures only long sequences against a baseline already in
docs/PERFORMANCE.md.

The exposed communication of a run is read from a profile of it (benchmarks/profile_step.sh
with the same overrides; its summary lists the collectives in flight over compute gaps).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_throughput  # noqa: E402  (the runner: one process a run, the same figures)

BASELINE_SEQ = 8192
PRECISION_FILES = {"bf16": "configs/precision/bf16.yaml", "fp8": "configs/precision/fp8.yaml"}


def run_args(model: str, seq_len: int, context: int, precision: str, gpus: int) -> list[str]:
    """The trainer's arguments for one run: the model's config at ``seq_len`` with ``context``
    GPUs a sequence, the other GPUs data-parallel, full remat, the FSDP axis off (the context
    axis shards the parameters)."""
    return [f"configs/{model}.yaml", PRECISION_FILES[precision], f"data.seq_len={seq_len}",
            f"data.global_batch={gpus // context}", "train.remat=full", "train.scan_layers=true",
            f"mesh.data={gpus // context}", "mesh.fsdp=1", f"mesh.context={context}", "mesh.tensor=1"]


def baseline_args(model: str, precision: str, gpus: int) -> list[str]:
    """The same model at 8,192 tokens without a split: FSDP over the GPUs, one sequence each."""
    return [f"configs/{model}.yaml", PRECISION_FILES[precision], f"data.seq_len={BASELINE_SEQ}",
            f"data.global_batch={gpus}", "train.remat=full", "train.scan_layers=true",
            "mesh.data=1", "mesh.fsdp=-1", "mesh.context=1", "mesh.tensor=1"]


def format_table(results: list[dict]) -> str:
    head = f"{'run':<36}{'GPUs':>5}{'step s':>9}{'tok/s/GPU':>11}{'MFU':>7}{'vs 8k':>8}{'peak GiB':>10}"
    lines = [head, "-" * len(head)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['label']:<36} error: {r['error']}")
            continue
        ratio = f"{r['vs_baseline']:.2f}" if r.get("vs_baseline") else "-"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        lines.append(f"{r['label']:<36}{r['devices']:>5}{r['step_time_s']:>9.2f}{r['tokens_per_s_per_device']:>11.0f}"
                     f"{mfu:>7}{ratio:>8}{(r['peak_memory_gib'] or 0):>10.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama3-8b", "nemotron-h-8b"])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[32768, 65536])
    parser.add_argument("--contexts", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--precisions", nargs="+", choices=sorted(PRECISION_FILES), default=["bf16", "fp8"])
    parser.add_argument("--gpus", type=int, default=0, help="GPUs to use (0: every visible one)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json")
    parser.add_argument("--skip-baseline", action="store_true", help="no 8,192-token runs (no 'vs 8k' column)")
    ns = parser.parse_args(argv)
    gpus = ns.gpus
    if not gpus:
        import jax
        gpus = jax.device_count()

    results = []
    for model in ns.models:
        for precision in ns.precisions:
            base = {"error": "skipped"}
            if not ns.skip_baseline:
                base = train_throughput.run_child(f"{model} 8k c1 {precision}", baseline_args(model, precision, gpus),
                                                  ns.steps, ns.warmup, ns.timeout)
                results.append(base)
                print(format_table([base]).splitlines()[-1], flush=True)
            for seq_len in ns.seq_lens:
                for context in ns.contexts:
                    if gpus % context:
                        continue
                    label = f"{model} {seq_len // 1024}k c{context} {precision}"
                    r = train_throughput.run_child(label, run_args(model, seq_len, context, precision, gpus),
                                                   ns.steps, ns.warmup, ns.timeout)
                    if "error" not in r and "error" not in base:
                        r["vs_baseline"] = r["tokens_per_s_per_device"] / base["tokens_per_s_per_device"]
                    results.append(r)
                    print(format_table([r]).splitlines()[-1], flush=True)
    print()
    print(format_table(results))
    return train_throughput.write_results(results, ns.json)


if __name__ == "__main__":
    sys.exit(main())
