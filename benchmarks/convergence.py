"""Convergence: does a precision recipe train as well as BF16? Held-out loss over seeds.

Trains one model config under several precision variants x seeds on the same prepared data and
scores each on the same held-out files, then writes one results JSON per run, a summary (held-out
loss at fixed token counts: mean and standard deviation over seeds, the relative gap to BF16 with
its standard error, tokens/s) and one PNG (loss curves and gap against tokens):

    python benchmarks/gather_corpus.py --out corpus
    python -m maxfp4.data.prepare --source jsonl --paths corpus/train.jsonl --out corpus/train --vocab-size 8192
    python -m maxfp4.data.prepare --source jsonl --paths corpus/heldout.jsonl --out corpus/heldout \\
        --tokenizer corpus/train/tokenizer.model
    python benchmarks/convergence.py --config configs/dense-125m.yaml --data corpus \\
        --variants bf16 fp8_delayed fp8_current nvfp4 --seeds 0 1 2 --tokens 200e6 --out conv/dense \\
        --ablations mxfp4 nvfp4_no_rht nvfp4_no_sr nvfp4_1d_weights nvfp4_all_blocks mxfp8

Each run is ``python -m maxfp4.train`` in its own process with its own run directory under
``<out>/runs``, so an interrupted benchmark resumes every unfinished run from the trainer's own
checkpoints when it is started again with the same arguments (finished runs are not repeated,
nor are runs whose complete results were copied into ``<out>/results`` from another machine).
Runs start seed by seed (every main variant's first seed, then the second, ...), the ablations
(first seed only) last.
``--deadline-s`` ends a call in time: at the deadline the running trainers get SIGTERM (they
checkpoint and exit) and no new run starts. With several GPUs, runs go one per GPU in parallel.
``--data builtin`` uses the embedded corpus with every tenth document held out (the CPU smoke).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

# Precision variants: the arguments each adds to the trainer's command line.
LM_HEAD_BF16 = "precision.rules=[{classes: [lm_head], recipe: bf16}]"
VARIANTS: dict[str, list[str]] = {
    "bf16": ["precision.default=bf16", "precision.rules=[]"],
    "fp8_delayed": ["configs/precision/fp8.yaml"],
    "fp8_current": ["precision.default=fp8_current", LM_HEAD_BF16],
    "nvfp4": ["configs/precision/nvfp4.yaml"],
    # The NVFP4 paper's ablations: each drops one part of the recipe.
    "nvfp4_no_rht": ["configs/precision/nvfp4.yaml", "precision.recipes.nvfp4.rht=false"],
    "nvfp4_no_sr": ["configs/precision/nvfp4.yaml", "precision.recipes.nvfp4.stochastic_rounding=false"],
    "nvfp4_1d_weights": ["configs/precision/nvfp4.yaml", "precision.recipes.nvfp4.weight_2d=false"],
    "nvfp4_all_blocks": ["precision.default=nvfp4", LM_HEAD_BF16],
    "mxfp4": ["precision.default=mxfp4", LM_HEAD_BF16],
    "mxfp8": ["precision.default=mxfp8", LM_HEAD_BF16],
}
BASELINE = "bf16"
# The variants that take the full recipe apart (or swap its format): each run is also compared
# with the full recipe's run of the same seed (--reference).
ABLATIONS = ("nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_1d_weights", "nvfp4_all_blocks", "mxfp4", "mxfp8")
REFERENCE = "nvfp4"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run as a script from benchmarks/: maxfp4 is the repository's

from maxfp4.files import atomic_file  # noqa: E402 - after the path; imports no JAX


def write_json(path: str, obj) -> None:
    """Results and the summary replaced whole: a kept result counts as a finished run."""
    with atomic_file(path) as fh:
        json.dump(obj, fh, indent=1)


def builtin_split(out_dir: str, vocab_size: int) -> str:
    """The embedded corpus as the prepared path has it: JSONL train and held-out files split by
    document (every tenth held out, whatever the seed) and one tokenizer trained on the training
    part, so every run of the smoke scores the same held-out tokens."""
    from maxfp4.data.sources import builtin_documents
    from maxfp4.data.tokenizer import train_tokenizer_bytes

    corpus = os.path.join(out_dir, "corpus")
    if not os.path.isfile(os.path.join(corpus, "tokenizer.model")):
        os.makedirs(corpus, exist_ok=True)
        docs = builtin_documents()
        splits = {"train": [d for i, d in enumerate(docs) if i % 10], "heldout": docs[::10]}
        for split, split_docs in splits.items():
            with open(os.path.join(corpus, f"{split}.jsonl"), "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps({"text": d}) + "\n" for d in split_docs)
        with atomic_file(os.path.join(corpus, "tokenizer.model"), "wb") as fh:  # its presence marks the split done
            fh.write(train_tokenizer_bytes(splits["train"], vocab_size))
    return corpus


def data_args(data: str, out_dir: str, vocab_size: int) -> list[str]:
    """Trainer overrides that select the training data, the held-out set and the tokenizer."""
    if data == "builtin":
        corpus = builtin_split(out_dir, vocab_size)
        return ["data.source=jsonl", f"data.paths=[{corpus}/train.jsonl]", f"data.eval_paths=[{corpus}/heldout.jsonl]",
                "data.eval_fraction=0", f"data.tokenizer={corpus}/tokenizer.model"]
    train, heldout = os.path.join(data, "train"), os.path.join(data, "heldout")
    for d in (train, heldout):
        if not os.path.isfile(os.path.join(d, "manifest.json")):
            sys.exit(f"--data {data}: {d} is not a prepared directory (python -m maxfp4.data.prepare); "
                     f"expected {data}/train and {data}/heldout")
    # The held-out set is a separate directory: no fraction of the training data is held out too.
    return ["data.source=array_record", f"data.paths=[{train}]", f"data.eval_paths=[{heldout}]", "data.eval_fraction=0",
            f"data.tokenizer={os.path.join(train, 'tokenizer.model')}"]


def data_fingerprint(data: str, out_dir: str) -> dict:
    """What makes two runs' held-out losses comparable, kept in every result: a prepared corpus's
    document and token counts, train and held-out (a changed file set or tokenizer changes them),
    or the builtin split's tokenizer."""
    if data == "builtin":
        with open(os.path.join(out_dir, "corpus", "tokenizer.model"), "rb") as fh:
            return {"builtin_tokenizer_sha256": hashlib.sha256(fh.read()).hexdigest()}
    fingerprint = {}
    for split in ("train", "heldout"):
        with open(os.path.join(data, split, "manifest.json"), encoding="utf-8") as fh:
            manifest = json.load(fh)
        fingerprint.update({f"{split}_documents": manifest["num_documents"], f"{split}_tokens": manifest["num_tokens"]})
    return fingerprint


def run_name(variant: str, seed: int) -> str:
    return f"{variant}-s{seed}"


def read_records(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def run_result(run_dir: str, variant: str, seed: int, tokens_per_step: int) -> dict:
    """The figures of one run from its metrics.jsonl. A step logged twice (a resumed run repeats
    the steps after its checkpoint) counts once, with its newest record."""
    by_step = {r["step"]: r for r in read_records(run_dir)}
    evals = [[s * tokens_per_step, r["eval_loss"]] for s, r in sorted(by_step.items()) if "eval_loss" in r]
    rates = [r["tokens_per_s"] for r in by_step.values() if r.get("step_time_s")]
    return {"variant": variant, "seed": seed, "steps": max(by_step, default=0), "tokens_per_step": tokens_per_step,
            "eval": evals, "final_eval_loss": evals[-1][1] if evals else None,
            "tokens_per_s": statistics.median(rates) if rates else None}


def current_result(runs_dir: str, results_dir: str, variant: str, seed: int, tokens_per_step: int, steps: int,
                   data: dict) -> dict:
    """The run's figures from its run directory or, where there is none (the run finished on
    another machine and only its results were kept: copy them into ``<out>/results``), from a
    complete ``results/<name>.json`` of the same steps, tokens a step and data. A kept result of
    a run cut off does not count: without its checkpoints the run starts again."""
    name = run_name(variant, seed)
    run_dir = os.path.join(runs_dir, name)
    kept = os.path.join(results_dir, f"{name}.json")
    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")) and os.path.isfile(kept):
        with open(kept, encoding="utf-8") as fh:
            result = json.load(fh)
        same = (result.get("tokens_per_step"), result.get("steps"), result.get("data")) == (tokens_per_step, steps, data)
        if result.get("complete") and same:
            return result
        if result.get("complete"):
            print(f"{name}: the kept result is of other data or another length "
                  f"({result.get('data')}, {result.get('steps')} steps); running it again", flush=True)
    return dict(run_result(run_dir, variant, seed, tokens_per_step), data=data)


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
        if r["variant"] not in ABLATIONS or r["variant"] == reference or not common:
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


def gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


class Runner:
    """Runs the trainer processes, at most ``slots`` at once (when there are GPUs, slot i on GPU
    ``gpu_ids[i]``), and stops them all with SIGTERM at the deadline or when this process gets
    SIGTERM/SIGINT."""

    def __init__(self, slots: int, gpu_ids: list[int], deadline: float, log_dir: str):
        self.slots, self.gpu_ids, self.deadline, self.log_dir = slots, gpu_ids, deadline, log_dir
        self.running: dict[int, tuple[subprocess.Popen, str, object]] = {}  # slot -> (process, name, log)
        self.stopping = False
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)

    def _stop(self, signum, frame) -> None:
        del frame
        self.stopping = True
        print(f"signal {signum}: stopping the running trainers (they checkpoint), starting no more", flush=True)
        for proc, _, _ in self.running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    def run_all(self, jobs: list[tuple[str, list[str]]]) -> dict[str, int]:
        """``jobs``: (name, trainer arguments). Returns each started job's exit code."""
        codes: dict[str, int] = {}
        queue = list(jobs)
        while queue or self.running:
            if time.time() >= self.deadline and not self.stopping:
                self._stop(signal.SIGTERM, None)
            for slot in [s for s, (p, _, _) in self.running.items() if p.poll() is not None]:
                proc, name, log = self.running.pop(slot)
                log.close()
                codes[name] = proc.returncode
                print(f"{name}: exit {proc.returncode}", flush=True)
            while queue and not self.stopping and len(self.running) < self.slots:
                slot = min(set(range(self.slots)) - set(self.running))
                name, args = queue.pop(0)
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                if self.gpu_ids:
                    env["CUDA_VISIBLE_DEVICES"] = str(self.gpu_ids[slot % len(self.gpu_ids)])
                log = open(os.path.join(self.log_dir, f"{name}.log"), "a", encoding="utf-8")
                proc = subprocess.Popen([sys.executable, "-m", "maxfp4.train", *args], cwd=REPO, env=env,
                                        stdout=log, stderr=subprocess.STDOUT)
                self.running[slot] = (proc, name, log)
                print(f"{name}: started" + (f" on GPU {env['CUDA_VISIBLE_DEVICES']}" if self.gpu_ids else ""), flush=True)
            if self.stopping:
                queue.clear()
            time.sleep(0.2)
        return codes


def load_run_config(config_args: list[str]):
    from maxfp4.config import load_config

    return load_config([a for a in config_args if "=" not in a], [a for a in config_args if "=" in a])


def write_report(out_dir: str, results: list[dict], reference: str = REFERENCE, **about) -> dict:
    """summary.json (over the complete runs; the ablations against ``reference`` over every run)
    and convergence.png in ``out_dir``; prints the tables."""
    summary = summarize([r for r in results if r["complete"]])
    summary.update(about, incomplete=[run_name(r["variant"], r["seed"]) for r in results if not r["complete"]])
    rows = against_reference(results, reference)
    summary.update(reference=reference, against_reference=rows, against_reference_means=reference_means(rows))
    write_json(os.path.join(out_dir, "summary.json"), summary)
    print(format_summary(summary))
    if summary["against_reference"]:
        print(format_against_reference(summary["against_reference"], reference))
    if any(r["eval"] for r in results if r["complete"]):
        print("plot:", plot_summary(summary, os.path.join(out_dir, "convergence.png")))
    return summary


def report(out_dir: str, reference: str = REFERENCE) -> int:
    """``--report``: the summary and the picture again from ``<out>/results/*.json`` alone (results
    copied off the machine that ran them)."""
    paths = sorted(f for f in os.listdir(os.path.join(out_dir, "results")) if f.endswith(".json"))
    if not paths:
        sys.exit(f"--report {out_dir}: no results/*.json there")
    results = []
    for f in paths:
        with open(os.path.join(out_dir, "results", f), encoding="utf-8") as fh:
            results.append(json.load(fh))
    order = list(VARIANTS)
    results.sort(key=lambda r: (order.index(r["variant"]) if r["variant"] in order else len(order), r["seed"]))
    write_report(out_dir, results, reference, steps=max(r["steps"] for r in results if r["complete"]),
                 tokens_per_step=results[0]["tokens_per_step"])
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", metavar="OUT", help="only rewrite OUT's summary and picture from OUT/results")
    p.add_argument("--config", help="the model config (e.g. configs/dense-125m.yaml)")
    p.add_argument("--data", help="a directory holding prepared train/ and heldout/, or 'builtin'")
    p.add_argument("--variants", nargs="+", default=["bf16", "fp8_delayed", "fp8_current", "nvfp4"],
                   choices=sorted(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--ablations", nargs="*", default=[], choices=sorted(VARIANTS),
                   help="variants run with the first seed only, after every seed of --variants (the paper's "
                        "ablations: compared against the seed spread of the main variants)")
    p.add_argument("--reference", default=REFERENCE, choices=sorted(VARIANTS),
                   help="the full recipe each ablation run is compared with at the same seed")
    p.add_argument("--tokens", type=float, help="training tokens per run")
    p.add_argument("--evals", type=int, default=10, help="held-out evaluations per run (evenly spaced)")
    p.add_argument("--out", help="output directory (runs/, results/, summary.json, convergence.png)")
    p.add_argument("--parallel", type=int, default=0, help="runs at once (0: one per GPU, 1 without GPUs)")
    p.add_argument("--gpus", type=int, nargs="+", help="the GPUs to use (default: all), e.g. 2 3 while another "
                   "set of runs holds 0 and 1")
    p.add_argument("--deadline-s", type=float, default=0, help="stop the runs after this many seconds (0: none)")
    p.add_argument("overrides", nargs="*", help="more trainer overrides for every run (dotted.key=value)")
    args = p.parse_args(argv)
    if args.report:
        return report(os.path.abspath(args.report), args.reference)
    missing = [f"--{k}" for k in ("config", "data", "tokens", "out") if getattr(args, k) is None]
    if missing:
        p.error(f"{', '.join(missing)} required (unless --report)")
    # The trainers run in the repository (for the presets' paths): every path the user gave is
    # made absolute first.
    args.config, args.out = os.path.abspath(args.config), os.path.abspath(args.out)
    if args.data != "builtin":
        args.data = os.path.abspath(args.data)

    os.makedirs(args.out, exist_ok=True)
    model_cfg = load_run_config([args.config, *args.overrides])
    base = [args.config, *data_args(args.data, args.out, model_cfg.model.vocab_size), *args.overrides]
    per_step = model_cfg.data.seq_len * model_cfg.data.global_batch
    steps = max(1, round(args.tokens / per_step))
    eval_every = max(1, steps // args.evals)
    runs_dir, results_dir = os.path.join(args.out, "runs"), os.path.join(args.out, "results")
    for d in (runs_dir, results_dir):
        os.makedirs(d, exist_ok=True)
    # Seed-major order: a budget that runs out leaves whole seeds of every main variant, then
    # the single-seed ablations.
    plan = [(variant, seed) for seed in args.seeds for variant in args.variants]
    plan += [(variant, args.seeds[0]) for variant in args.ablations if variant not in args.variants]
    fingerprint = data_fingerprint(args.data, args.out)
    jobs, done = [], []
    for variant, seed in plan:
        name = run_name(variant, seed)
        result = current_result(runs_dir, results_dir, variant, seed, per_step, steps, fingerprint)
        if result["steps"] >= steps and result["final_eval_loss"] is not None:
            done.append(name)
            continue
        preset = [os.path.join(REPO, a) if a.endswith(".yaml") else a for a in VARIANTS[variant]]
        jobs.append((name, [*base[:1], *preset, *base[1:], f"run.name={name}",
                            f"run.output_dir={runs_dir}", f"run.seed={seed}", f"train.steps={steps}",
                            f"optim.schedule_steps={steps}", f"train.eval_every={eval_every}"]))
    print(f"{len(done)} run(s) finished earlier, {len(jobs)} to run: {steps} steps of {per_step} tokens, "
          f"held-out loss every {eval_every} steps", flush=True)
    gpu_ids = args.gpus if args.gpus is not None else list(range(gpu_count()))
    slots = args.parallel or max(len(gpu_ids), 1)
    deadline = time.time() + args.deadline_s if args.deadline_s else math.inf
    started = time.time()
    codes = Runner(slots, gpu_ids, deadline, runs_dir).run_all(jobs)

    results = []
    for variant, seed in plan:
        name = run_name(variant, seed)
        result = current_result(runs_dir, results_dir, variant, seed, per_step, steps, fingerprint)
        result["complete"] = result["steps"] >= steps
        write_json(os.path.join(results_dir, f"{name}.json"), result)
        results.append(result)
    summary = write_report(args.out, results, args.reference, config=args.config, data=args.data, steps=steps,
                           tokens_per_step=per_step, wall_s=time.time() - started)
    failed = {n: c for n, c in codes.items() if c not in (0, 143, 130)}
    if failed:
        print(f"failed runs (exit codes): {failed}; their logs are in {runs_dir}", file=sys.stderr)
        return 1
    if summary["incomplete"]:
        print(f"unfinished: {' '.join(summary['incomplete'])}; run the same command again to resume them")
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
