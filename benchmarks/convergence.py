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

Two models (a mixture of experts against the dense model of equal active parameters): name each
with ``--model NAME=CONFIG`` and write a variant as ``NAME.PRECISION``; ``--baseline`` is the
variant every other is compared with, and a named model's low-precision variants are compared
with the same model in BF16 as well (docs/MOE.md, Convergence)::

    python benchmarks/convergence.py --data corpus --model dense=configs/conv-dense-38m.yaml \\
        --model moe=configs/conv-moe-8x2-38m.yaml --variants dense.bf16 moe.bf16 moe.fp8_experts \\
        --baseline dense.bf16 --seeds 0 1 2 --tokens 25e6 --out conv/moe

The summary's ``comparisons`` hold each such pair's same-seed relative differences with a
Student-t 95% interval of their mean (as benchmarks/convergence_intervals.py computes them).
The figures, tables and picture come from benchmarks/convergence_summary.py.
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
    # FP8 with delayed scaling on a mixture of experts' expert GEMMs only; the rest stays BF16.
    "fp8_experts": ["precision.default=bf16", "precision.rules=[{classes: [expert], recipe: fp8_delayed}]"],
}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run as a script from benchmarks/: maxfp4 is the repository's

from benchmarks.convergence_summary import (BASELINE, MODEL_SEP, REFERENCE, against_reference,  # noqa: E402
                                            comparison_pairs, format_against_reference, format_comparisons,
                                            format_summary, paired_comparison, plot_summary, reference_means,
                                            run_name, split_variant, summarize)
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


def write_report(out_dir: str, results: list[dict], reference: str = REFERENCE, baseline: str = BASELINE,
                 **about) -> dict:
    """summary.json (over the complete runs; the ablations against ``reference`` over every run)
    and convergence.png in ``out_dir``; prints the tables."""
    summary = summarize([r for r in results if r["complete"]], baseline)
    summary.update(about, incomplete=[run_name(r["variant"], r["seed"]) for r in results if not r["complete"]])
    rows = against_reference(results, reference, baseline)
    summary.update(reference=reference, against_reference=rows, against_reference_means=reference_means(rows))
    variants = list(dict.fromkeys(r["variant"] for r in results))
    compared = [paired_comparison(results, v, against) for v, against in comparison_pairs(variants, baseline)]
    summary["comparisons"] = [c for c in compared if c is not None]
    write_json(os.path.join(out_dir, "summary.json"), summary)
    print(format_summary(summary))
    if summary["comparisons"]:
        print(format_comparisons(summary["comparisons"]))
    if summary["against_reference"]:
        print(format_against_reference(summary["against_reference"], reference, baseline))
    if any(r["eval"] for r in results if r["complete"]):
        print("plot:", plot_summary(summary, os.path.join(out_dir, "convergence.png")))
    return summary


def report(out_dir: str, reference: str = REFERENCE, baseline: str = BASELINE) -> int:
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

    def place(r):  # a model's variants together, each model's in VARIANTS order
        model, precision = split_variant(r["variant"])
        return model, order.index(precision) if precision in order else len(order), r["variant"], r["seed"]

    results.sort(key=place)
    write_report(out_dir, results, reference, baseline, steps=max(r["steps"] for r in results if r["complete"]),
                 tokens_per_step=results[0]["tokens_per_step"])
    return 0


def model_configs(p: argparse.ArgumentParser, args) -> dict[str, str]:
    """The model of each name a variant may carry (``""``: --config's, for plain variants), as
    absolute paths; every variant named in the arguments checked against them."""
    models = {"": os.path.abspath(args.config)} if args.config else {}
    for entry in args.model:
        name, eq, path = entry.partition("=")
        if not (eq and name and path) or MODEL_SEP in name or name in models:
            p.error(f"--model {entry}: expected NAME=CONFIG with a new NAME without '{MODEL_SEP}', "
                    f"e.g. --model dense=configs/conv-dense-38m.yaml")
        models[name] = os.path.abspath(path)
    named = [("--variants", v) for v in args.variants] + [("--ablations", v) for v in args.ablations]
    named += [("--baseline", args.baseline)] + ([("--reference", args.reference)] if args.ablations else [])
    for option, variant in named:
        model, precision = split_variant(variant)
        if precision not in VARIANTS or model not in models:
            example = f"{next(iter(models)) or 'MODEL'}{MODEL_SEP}bf16" if any(models) else "bf16"
            p.error(f"{option} {variant}: expected a precision variant ({', '.join(VARIANTS)}) of --config's "
                    f"model or NAME{MODEL_SEP}PRECISION for a --model NAME=CONFIG, e.g. {example}")
    return models


def describe_models(models: dict[str, str], configs: dict) -> dict[str, dict]:
    """Each model's config, matmul parameters and FLOPs a token (active: what a token passes
    through), printed and kept in the summary: two models' losses at equal tokens compare them
    at equal active FLOPs where these are equal."""
    from maxfp4.model_spec import model_spec

    out = {}
    for name, cfg in configs.items():
        spec = model_spec(cfg.model)
        out[name or "config"] = {"config": models[name], "active_matmul_params": spec.matmul_params,
                                 "matmul_params": spec.matmul_params_total,
                                 "flops_per_token": spec.flops_per_token(cfg.data.seq_len)}
        print(f"model {name or 'config'}: {spec.matmul_params / 1e6:.2f}M active matmul parameters of "
              f"{spec.matmul_params_total / 1e6:.2f}M, {spec.flops_per_token(cfg.data.seq_len) / 1e6:.1f} MFLOP a token")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--report", metavar="OUT", help="only rewrite OUT's summary and picture from OUT/results")
    p.add_argument("--config", help="the model config (e.g. configs/dense-125m.yaml)")
    p.add_argument("--model", action="append", default=[], metavar="NAME=CONFIG",
                   help="one of several models, its variants written NAME.PRECISION (repeat for each model)")
    p.add_argument("--data", help="a directory holding prepared train/ and heldout/, or 'builtin'")
    p.add_argument("--variants", nargs="+", default=["bf16", "fp8_delayed", "fp8_current", "nvfp4"],
                   help=f"precision variants ({', '.join(VARIANTS)}), NAME.PRECISION for a --model")
    p.add_argument("--baseline", default=BASELINE, help="the variant every other is compared with")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--ablations", nargs="*", default=[],
                   help="variants run with the first seed only, after every seed of --variants (the paper's "
                        "ablations: compared against the seed spread of the main variants)")
    p.add_argument("--reference", default=REFERENCE,
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
        return report(os.path.abspath(args.report), args.reference, args.baseline)
    missing = [f"--{k}" for k in ("data", "tokens", "out") if getattr(args, k) is None]
    missing += [] if args.config or args.model else ["--config (or --model)"]
    if missing:
        p.error(f"{', '.join(missing)} required (unless --report)")
    # The trainers run in the repository (for the presets' paths): every path the user gave is
    # made absolute first.
    models = model_configs(p, args)
    args.out = os.path.abspath(args.out)
    if args.data != "builtin":
        args.data = os.path.abspath(args.data)

    configs = {name: load_run_config([path, *args.overrides]) for name, path in models.items()}
    # Every run takes the same tokens a step and tokenizer, so their held-out losses meet at the
    # same token counts on the same held-out tokens.
    shapes = {name: (c.data.seq_len * c.data.global_batch, c.model.vocab_size) for name, c in configs.items()}
    if len(set(shapes.values())) > 1:
        p.error(f"--model: the models differ in tokens a step or vocabulary ({shapes}); expected equal "
                f"data.seq_len x data.global_batch and model.vocab_size (override them, e.g. data.global_batch=32)")
    per_step, vocab_size = next(iter(shapes.values()))
    about_models = describe_models(models, configs)
    os.makedirs(args.out, exist_ok=True)
    data = [*data_args(args.data, args.out, vocab_size), *args.overrides]
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
        model, precision = split_variant(variant)
        preset = [os.path.join(REPO, a) if a.endswith(".yaml") else a for a in VARIANTS[precision]]
        jobs.append((name, [models[model], *preset, *data, f"run.name={name}",
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
    summary = write_report(args.out, results, args.reference, args.baseline, models=about_models, data=args.data,
                           steps=steps, tokens_per_step=per_step, wall_s=time.time() - started)
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
