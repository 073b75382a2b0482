"""The convergence benchmark's figures from its per-run results (benchmarks/convergence.py):
held-out loss per variant over seeds with the gap to the baseline, each compared pair's same-seed
differences with a 95% interval, the ablations against the full recipe, the tables and the
picture. Reads results as dicts; imports no JAX."""

from __future__ import annotations

import math
import statistics

from benchmarks.convergence_intervals import interval

BASELINE = "bf16"
# The variants that take the full recipe apart (or swap its format): each run is also compared
# with the full recipe's run of the same seed (--reference).
ABLATIONS = ("nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_1d_weights", "nvfp4_all_blocks", "mxfp4", "mxfp8")
REFERENCE = "nvfp4"
# A variant of one of several named models (--model NAME=CONFIG) is NAME.PRECISION.
MODEL_SEP = "."


def run_name(variant: str, seed: int) -> str:
    return f"{variant}-s{seed}"


def split_variant(variant: str) -> tuple[str, str]:
    """``NAME.PRECISION`` -> (NAME, PRECISION); a plain precision variant -> ("", PRECISION), the
    model of ``--config``."""
    model, _, precision = variant.rpartition(MODEL_SEP)
    return model, precision


def comparison_pairs(variants: list[str], baseline: str) -> list[tuple[str, str]]:
    """(variant, compared with) for the summary's comparisons: every variant against the
    baseline, and a named model's low-precision variant also against the same model in BF16
    where that ran and is not the baseline (the precision's own cost, apart from the model's)."""
    pairs = []
    for variant in variants:
        if variant == baseline:
            continue
        pairs.append((variant, baseline))
        model, precision = split_variant(variant)
        same_model_bf16 = f"{model}{MODEL_SEP}{BASELINE}"
        if model and precision != BASELINE and same_model_bf16 in variants and same_model_bf16 != baseline:
            pairs.append((variant, same_model_bf16))
    return pairs


def paired_comparison(results: list[dict], variant: str, against: str) -> dict | None:
    """The complete runs of ``variant`` against those of ``against`` with the same seed, at the
    last token count all of them evaluated: each seed's relative difference ``loss / loss_against
    - 1``, their mean with its standard error (ddof=1 over seeds) and a Student-t 95% interval
    of the mean (none with one seed). None while no seed has both runs complete."""
    runs = {(r["variant"], r["seed"]): dict(map(tuple, r["eval"])) for r in results if r["complete"]}
    seeds = sorted(s for v, s in runs if v == variant and (against, s) in runs)
    if not seeds:
        return None
    common = set.intersection(*(set(runs[variant, s]) & set(runs[against, s]) for s in seeds))
    if not common:
        return None
    tokens = max(common)
    gaps = [runs[variant, s][tokens] / runs[against, s][tokens] - 1 for s in seeds]
    sem = statistics.stdev(gaps) / math.sqrt(len(gaps)) if len(gaps) > 1 else None
    return {"variant": variant, "against": against, "tokens": tokens, "seeds": seeds, "gaps": gaps,
            "sem": sem, **interval(gaps)}


def format_comparisons(rows: list[dict]) -> str:
    lines = [f"{'comparison (same seeds)':<34} {'seeds':>5} {'tokens':>10} {'paired gap':>18} {'95% interval':>20}  per seed"]
    for c in rows:
        gap = f"{100 * c['mean']:+.2f}%" + (f" +- {100 * c['sem']:.2f}" if c["sem"] is not None else "")
        span = f"{100 * c['low']:+.2f}% to {100 * c['high']:+.2f}%" if c["low"] is not None else "one seed"
        per_seed = ", ".join(f"{100 * g:+.2f}%" for g in c["gaps"])
        lines.append(f"{c['variant'] + ' vs ' + c['against']:<34} {c['n']:>5} {c['tokens']:>10.3g} {gap:>18} "
                     f"{span:>20}  {per_seed}")
    return "\n".join(lines)


def summarize(results: list[dict], baseline: str = BASELINE) -> dict:
    """Per variant and token count held by every seed: mean, standard deviation (ddof=1) and
    the relative gap to the baseline's mean, ``(mean - base) / base``, with its standard error
    from both means' standard errors (first-order propagation, seeds independent).

    The paired gap compares runs of the same seed: a seed fixes the initial weights and the data
    order for every variant, and those move all variants' losses together (the seed spread is
    mostly shared), so the mean of the per-seed relative differences ``(l_v,s - l_base,s) /
    l_base,s`` has a smaller standard error (ddof=1 over seeds) than the difference of means. It
    is given where every seed of the variant has a baseline run; with one seed, no error."""
    by_variant: dict[str, list[dict]] = {}
    for r in results:
        by_variant.setdefault(r["variant"], []).append(r)
    table: dict[str, dict] = {}
    for variant, runs in by_variant.items():
        common = set.intersection(*(set(t for t, _ in r["eval"]) for r in runs)) if runs else set()
        points = []
        for tokens in sorted(common):
            losses = [dict((t, l) for t, l in r["eval"])[tokens] for r in runs]
            std = statistics.stdev(losses) if len(losses) > 1 else 0.0
            points.append({"tokens": tokens, "n": len(losses), "mean": statistics.fmean(losses), "std": std,
                           "sem": std / math.sqrt(len(losses)),
                           "losses": [[r["seed"], loss] for r, loss in zip(runs, losses)]})
        rates = [r["tokens_per_s"] for r in runs if r["tokens_per_s"]]
        table[variant] = {"seeds": sorted(r["seed"] for r in runs), "points": points,
                          "tokens_per_s": statistics.fmean(rates) if rates else None}
    base = {p["tokens"]: p for p in table.get(baseline, {}).get("points", [])}
    for variant, entry in table.items():
        for p in entry["points"]:
            b = base.get(p["tokens"])
            if b is None or variant == baseline:
                continue
            p["gap"] = (p["mean"] - b["mean"]) / b["mean"]
            p["gap_sem"] = math.hypot(p["sem"], p["mean"] / b["mean"] * b["sem"]) / b["mean"]
            base_by_seed = dict((seed, loss) for seed, loss in b["losses"])
            if all(seed in base_by_seed for seed, _ in p["losses"]):
                diffs = [(loss - base_by_seed[seed]) / base_by_seed[seed] for seed, loss in p["losses"]]
                p["paired_gap"] = statistics.fmean(diffs)
                p["paired_gap_sem"] = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else None
    return {"baseline": baseline, "variants": table}


def against_reference(results: list[dict], reference: str = REFERENCE, baseline: str = BASELINE) -> list[dict]:
    """Each run of an ablation, finished or cut off, at the last token count it shares with the
    reference's run of the same seed: both losses and the relative difference (and the same
    against the baseline's run of that seed). All runs of a benchmark share one schedule, so a
    cut-off run compares at equal learning rates. A seed moves every variant's loss alike, so
    what the difference holds is the recipe's change plus one seed's noise."""
    by_run = {(r["variant"], r["seed"]): dict((t, loss) for t, loss in r["eval"]) for r in results}
    rows = []
    for r in results:
        ref = by_run.get((reference, r["seed"]), {})
        own = by_run[(r["variant"], r["seed"])]
        common = sorted(set(own) & set(ref))
        if split_variant(r["variant"])[1] not in ABLATIONS or r["variant"] == reference or not common:
            continue
        tokens = common[-1]
        row = {"run": run_name(r["variant"], r["seed"]), "variant": r["variant"], "tokens": tokens, "complete": bool(r.get("complete")),
               "loss": own[tokens], "reference_loss": ref[tokens], "vs_reference": own[tokens] / ref[tokens] - 1}
        base = by_run.get((baseline, r["seed"]), {})
        if tokens in base:
            row["vs_baseline"] = own[tokens] / base[tokens] - 1
        rows.append(row)
    return rows


def reference_means(rows: list[dict]) -> dict[str, dict]:
    """Per ablation run on several seeds: the mean of its complete runs' same-seed differences
    from the reference at the final token count, with the standard error (ddof=1 over seeds).
    Only complete runs count, so every difference is taken at the same point of the schedule."""
    by_variant: dict[str, list[float]] = {}
    for r in rows:
        if r["complete"]:
            by_variant.setdefault(r["variant"], []).append(r["vs_reference"])
    return {variant: {"n": len(diffs), "mean": statistics.fmean(diffs),
                      "sem": statistics.stdev(diffs) / math.sqrt(len(diffs))}
            for variant, diffs in by_variant.items() if len(diffs) > 1}


def format_against_reference(rows: list[dict], reference: str, baseline: str = BASELINE) -> str:
    lines = [f"{'ablation':<22} {'tokens':>10} {'held-out loss':>14} {reference + ' (same seed)':>20} "
             f"{'vs ' + reference:>10} {'vs ' + baseline:>10}"]
    for r in rows:
        vs_base = f"{100 * r['vs_baseline']:+.2f}%" if "vs_baseline" in r else ""
        lines.append(f"{r['run'] + ('' if r['complete'] else ' (cut)'):<22} {r['tokens']:>10.3g} {r['loss']:>14.4f} "
                     f"{r['reference_loss']:>20.4f} {100 * r['vs_reference']:>+9.2f}% {vs_base:>10}")
    for variant, m in reference_means(rows).items():
        label = f"{variant} ({m['n']} seeds)"
        lines.append(f"{label:<22} {'mean':>10} {'':>14} {'':>20} {100 * m['mean']:>+9.2f}% +- {100 * m['sem']:.2f}")
    return "\n".join(lines)


def format_summary(summary: dict) -> str:
    lines = [f"{'variant':<18} {'seeds':>5} {'tokens':>10} {'held-out loss':>18} {'gap to ' + summary['baseline']:>18} "
             f"{'paired gap':>18} {'tokens/s':>10}"]
    for variant, entry in summary["variants"].items():
        if not entry["points"]:
            lines.append(f"{variant:<18} {len(entry['seeds']):>5} {'(no held-out loss yet)':>30}")
            continue
        p = entry["points"][-1]
        gap = f"{100 * p['gap']:+.2f}% +- {100 * p['gap_sem']:.2f}" if "gap" in p else ""
        paired = ""
        if "paired_gap" in p:
            paired = f"{100 * p['paired_gap']:+.2f}%" + (f" +- {100 * p['paired_gap_sem']:.2f}"
                                                          if p["paired_gap_sem"] is not None else "")
        rate = f"{entry['tokens_per_s']:,.0f}" if entry["tokens_per_s"] else ""
        lines.append(f"{variant:<18} {p['n']:>5} {p['tokens']:>10.3g} {p['mean']:>10.4f} +- {p['std']:.4f} "
                     f"{gap:>18} {paired:>18} {rate:>10}")
    return "\n".join(lines)


def plot_summary(summary: dict, path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab10")
    for i, (variant, entry) in enumerate(summary["variants"].items()):
        pts = entry["points"]
        if not pts:
            continue
        color = colors(i % 10)  # the same variant in the same colour in both panels
        x = [p["tokens"] for p in pts]
        mean = [p["mean"] for p in pts]
        ax_loss.plot(x, mean, marker=".", color=color, label=f"{variant} (n={pts[-1]['n']})")
        ax_loss.fill_between(x, [m - p["std"] for m, p in zip(mean, pts)], [m + p["std"] for m, p in zip(mean, pts)],
                             color=color, alpha=0.2)
        # The paired gap where there is one (same-seed differences: the shared seed spread cancels).
        gapped = [p for p in pts if "gap" in p]
        if gapped:
            ax_gap.errorbar([p["tokens"] for p in gapped], [100 * p.get("paired_gap", p["gap"]) for p in gapped],
                            yerr=[100 * (p.get("paired_gap_sem", p["gap_sem"]) or 0.0) for p in gapped],
                            marker=".", capsize=3, color=color, label=f"{variant} (n={gapped[-1]['n']})")
    ax_loss.set(xlabel="tokens", ylabel="held-out loss (nats/token)", title="Held-out loss (mean, +-1 std over seeds)")
    ax_gap.axhline(0.0, color="black", linewidth=0.8)
    ax_gap.set(xlabel="tokens", ylabel=f"gap to {summary['baseline']} (%)", title="Relative gap, paired by seed (+-1 standard error)")
    for ax in (ax_loss, ax_gap):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
