"""What run.deterministic costs: dense-1p3b's train step with the mode off and on, per precision
preset, each run in its own process (benchmarks/train_throughput.py measures it: synthetic
tokens, checkpoints off, median step time after the warm-up). Prints the model shape used and a
table, writes JSON:

    PYTHONPATH=$PWD python benchmarks/determinism.py [--precision bf16 fp8 nvfp4] [--blocks 24]
        [--steps 10 --warmup 3 --timeout 600 --json determinism.json] [dotted.key=value ...]

``--blocks`` runs fewer of the config's 24 blocks (memory or time); the table says which.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from train_throughput import run_child

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/dense-1p3b.yaml"


def shape_line(blocks: int) -> str:
    from maxfp4.config import load_config

    cfg = load_config(os.path.join(REPO, CONFIG), [f"model.n_layers={blocks}"])
    m, d = cfg.model, cfg.data
    return (f"{CONFIG}: {m.n_layers} blocks, d_model {m.d_model}, {m.n_heads}/{m.n_kv_heads} heads of "
            f"{m.resolved_head_dim}, d_ff {m.d_ff}, vocabulary {m.vocab_size}, {d.global_batch} x {d.seq_len} "
            f"tokens a step, blocks {'scanned' if cfg.train.scan_layers else 'unrolled'}")


def format_table(rows: list[dict]) -> str:
    head = (f"{'precision':<10}{'off ms':>9}{'on ms':>9}{'on/off':>8}{'MFU off':>9}{'MFU on':>8}"
            f"{'GiB off':>9}{'GiB on':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        off, on = r["off"], r["on"]
        if "error" in off or "error" in on:
            lines.append(f"{r['precision']:<10} error: {off.get('error') or on.get('error')}")
            continue
        pct = lambda v: f"{100 * v:.1f}%" if v is not None else "-"  # noqa: E731
        lines.append(f"{r['precision']:<10}{1e3 * off['step_time_s']:>9.1f}{1e3 * on['step_time_s']:>9.1f}"
                     f"{on['step_time_s'] / off['step_time_s']:>8.3f}{pct(off['mfu']):>9}{pct(on['mfu']):>8}"
                     f"{(off['peak_memory_gib'] or 0):>9.1f}{(on['peak_memory_gib'] or 0):>8.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precision", nargs="+", default=["bf16", "fp8"],
                        help="presets of configs/precision/ (bf16, fp8, fp8-pow2, nvfp4)")
    parser.add_argument("--blocks", type=int, default=24, help="blocks of the model (the config has 24)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps (the first compiles)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--json", default="determinism.json", help="write the results here")
    parser.add_argument("overrides", nargs="*", help="more dotted.key=value overrides for both runs "
                        "(train.scan_layers=true: cuDNN attention in unrolled blocks refuses the mode)")
    ns = parser.parse_args(argv)
    print(shape_line(ns.blocks) + "".join(f"; {o}" for o in ns.overrides), flush=True)
    rows = []
    for preset in ns.precision:
        args = [CONFIG, f"configs/precision/{preset}.yaml", f"model.n_layers={ns.blocks}", *ns.overrides]
        row = {"precision": preset, "blocks": ns.blocks}
        for mode in ("off", "on"):
            label = f"{preset} deterministic {mode}"
            row[mode] = run_child(label, args + [f"run.deterministic={'true' if mode == 'on' else 'false'}"],
                                  ns.steps, ns.warmup, ns.timeout)
            result = row[mode]
            print(f"{label}: " + (result["error"] if "error" in result else f"{1e3 * result['step_time_s']:.1f} ms"),
                  flush=True)
        rows.append(row)
    print()
    print(format_table(rows))
    with open(ns.json, "w", encoding="utf-8") as fh:
        json.dump({"shape": shape_line(ns.blocks), "overrides": ns.overrides, "rows": rows}, fh, indent=2)
    return 0 if all("error" not in r[m] for r in rows for m in ("off", "on")) else 1


if __name__ == "__main__":
    sys.exit(main())
