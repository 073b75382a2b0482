"""95% intervals of the convergence gaps from the stored per-seed results, and the commit of each.

    python benchmarks/convergence_intervals.py docs/convergence/dense-125m docs/convergence/hybrid-150m \
        --json docs/convergence/intervals.json

For each variant against BF16: the paired gap of each seed (variant loss / BF16 loss of the same
seed - 1, at the last held-out evaluation), their mean, and a Student-t 95% interval of the mean
(n - 1 degrees of freedom; one seed: no interval); the mean paired gap at every evaluated token
count; and the commit that stored each result file (git log), since the results do not carry one.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import subprocess

# Two-sided 95% Student-t quantiles t_{0.975, df}.
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def stored_commit(path: str) -> str | None:
    out = subprocess.run(["git", "log", "--diff-filter=A", "--format=%h", "--", path], capture_output=True, text=True)
    lines = out.stdout.split()
    return lines[-1] if out.returncode == 0 and lines else None


def interval(gaps: list[float]) -> dict:
    n = len(gaps)
    mean = statistics.fmean(gaps)
    if n < 2:
        return {"n": n, "mean": mean, "low": None, "high": None}
    half = T975[n - 1] * statistics.stdev(gaps) / math.sqrt(n)
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half}


def gaps_of(directory: str, baseline: str = "bf16") -> dict:
    results = {}
    for path in sorted(glob.glob(os.path.join(directory, "results", "*.json"))):
        with open(path) as fh:
            r = json.load(fh)
        results[(r["variant"], r["seed"])] = dict(r, path=path)
    base = {seed: r for (variant, seed), r in results.items() if variant == baseline}
    out = {}
    for variant in sorted({v for v, _ in results} - {baseline}):
        seeds = sorted(s for v, s in results if v == variant and s in base)
        final = [100 * (results[variant, s]["final_eval_loss"] / base[s]["final_eval_loss"] - 1) for s in seeds]
        by_tokens: dict[int, list[float]] = {}
        for s in seeds:
            base_at = dict(map(tuple, base[s]["eval"]))
            for tokens, loss in results[variant, s]["eval"]:
                if tokens in base_at:
                    by_tokens.setdefault(int(tokens), []).append(100 * (loss / base_at[tokens] - 1))
        out[variant] = {
            "seeds": seeds, "paired_gap_pct": final, "interval_95": interval(final),
            "mean_gap_pct_by_tokens": {t: statistics.fmean(g) for t, g in sorted(by_tokens.items())},
            "commits": {s: stored_commit(results[variant, s]["path"]) for s in seeds},
            "baseline_commits": {s: stored_commit(base[s]["path"]) for s in seeds},
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directories", nargs="+")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    everything = {}
    for directory in args.directories:
        everything[directory] = gaps_of(directory)
        print(f"\n{directory}")
        print(f"{'variant':<18} {'seeds':>5} {'paired gap % per seed':<28} {'mean':>7} {'95% interval':>18}  commits")
        for variant, g in everything[directory].items():
            ci = g["interval_95"]
            span = f"{ci['low']:+.2f} to {ci['high']:+.2f}" if ci["low"] is not None else "one seed"
            per_seed = ", ".join(f"{x:+.2f}" for x in g["paired_gap_pct"])
            print(f"{variant:<18} {len(g['seeds']):>5} {per_seed:<28} {ci['mean']:>+7.2f} {span:>18}  "
                  f"{','.join(sorted({c for c in g['commits'].values() if c}))}")
            points = ", ".join(f"{t / 1e6:.0f}M {x:+.2f}" for t, x in g["mean_gap_pct_by_tokens"].items())
            print(f"{'':<18} by tokens: {points}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(everything, fh, indent=1)


if __name__ == "__main__":
    main()
