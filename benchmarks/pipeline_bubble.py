"""The pipeline's bubble, measured: step time at M = P, 2P, 4P, 8P microbatches of a fixed size
for each ``mesh.pipeline_repeats`` V, against the schedule's formula (P - 1) / (V M + P - 1);
with ``--overlap both`` also with the hand-overs overlapped (``mesh.pipeline_overlap``, lag
L = 2: L (P - 1) / (V M + L (P - 1)), M a multiple of 2P when V > 1; the other M are skipped).

A pass of the schedule is V M + P - 1 ticks of equal work, so the step time is linear in M:
``step(M) = a M + b`` with ``b / a = L (P - 1) / V`` for a pure bubble. The script fits a and b per
V (least squares over the M values), and reports each M's measured bubble ``b / step(M)`` beside
the formula; what the fit's intercept holds beyond the bubble (the optimizer update, the
weights' all-to-all at V > 1, the loss's psum) shows up as a measured bubble above the formula.
Each run trains in its own process (``train_throughput.py``'s child) with all visible devices:

    python benchmarks/pipeline_bubble.py --devices 4 --pipeline 4 --repeats 1 2 --rows 1 \\
        -- configs/llama3-8b.yaml configs/precision/bf16.yaml model.n_layers=16 data.seq_len=2048 \\
        train.remat=full model.attention=xla [--steps 6 --warmup 2 --json bubble.json]

``--rows``: sequences a microbatch holds per device of the batch axes (data x fsdp), so a tick's
work is the same at every M; the global batch is M x rows x (devices / pipeline).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from train_throughput import run_child, write_results  # benchmarks/ is the script's directory

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from maxfp4.parallel.pipeline_schedule import bubble_fraction, handover_lag  # noqa: E402
from maxfp4.parallel.pipeline_stages import microbatches_problem  # noqa: E402


def fit_line(ms: list[int], steps_s: list[float]) -> tuple[float, float]:
    """Least-squares (a, b) of step = a M + b."""
    a, b = np.polyfit(np.asarray(ms, float), np.asarray(steps_s, float), 1)
    return float(a), float(b)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pipeline", type=int, required=True, help="mesh.pipeline (P)")
    parser.add_argument("--repeats", type=int, nargs="+", default=[1, 2], help="mesh.pipeline_repeats values (V)")
    parser.add_argument("--multiples", type=int, nargs="+", default=[1, 2, 4, 8], help="M / P values")
    parser.add_argument("--rows", type=int, default=1, help="sequences a microbatch has per batch device")
    parser.add_argument("--overlap", choices=["off", "on", "both"], default="off", help="mesh.pipeline_overlap")
    # given, not asked of JAX here: this process must not take the GPUs its children train on
    parser.add_argument("--devices", type=int, required=True, help="devices the runs use (all visible)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("args", nargs="+", help="config files and overrides, as maxfp4.train takes them")
    ns = parser.parse_args(argv)
    p, batch_devices = ns.pipeline, ns.devices // ns.pipeline
    rows = []
    overlaps = {"off": [False], "on": [True], "both": [False, True]}[ns.overlap]
    for v, overlap in [(v, o) for v in ns.repeats for o in overlaps]:
        per_v, lag = [], handover_lag(overlap)
        for mult in ns.multiples:
            m = mult * p
            if microbatches_problem(p, v, m, overlap):
                continue
            args = ns.args + ["mesh.data=1", f"mesh.fsdp={batch_devices}", f"mesh.pipeline={p}",
                              f"mesh.pipeline_repeats={v}", f"mesh.pipeline_overlap={str(overlap).lower()}",
                              f"train.microbatches={m}", f"data.global_batch={m * ns.rows * batch_devices}",
                              "resilience.preflight=false"]
            r = run_child(f"P={p} V={v} L={lag} M={m}", args, ns.steps, ns.warmup, ns.timeout)
            r.update(pipeline=p, repeats=v, lag=lag, microbatches=m, formula=bubble_fraction(p, m, v, lag))
            print(r["label"], r.get("error") or f"{1e3 * r['step_time_s']:.1f} ms", flush=True)
            per_v.append(r)
        ok = [r for r in per_v if "error" not in r]
        if len(ok) >= 2:
            a, b = fit_line([r["microbatches"] for r in ok], [r["step_time_s"] for r in ok])
            for r in ok:
                r.update(fit_a_s=a, fit_b_s=b, measured=b / (a * r["microbatches"] + b))
        rows += per_v
    head = f"{'P':>3}{'V':>3}{'L':>3}{'M':>5}{'step ms':>10}{'tok/s/dev':>11}{'measured':>10}{'formula':>9}"
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['pipeline']:>3}{r['repeats']:>3}{r['lag']:>3}{r['microbatches']:>5}  error: {r['error']}")
            continue
        measured = f"{100 * r['measured']:.1f}%" if "measured" in r else "-"
        print(f"{r['pipeline']:>3}{r['repeats']:>3}{r['lag']:>3}{r['microbatches']:>5}{1e3 * r['step_time_s']:>10.1f}"
              f"{r['tokens_per_s_per_device']:>11.0f}{measured:>10}{100 * r['formula']:>8.1f}%")
    return write_results(rows, ns.json)


if __name__ == "__main__":
    sys.exit(main())
