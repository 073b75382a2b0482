"""``python -m maxfp4.evaluate RUN_OR_EXPORT --tasks NAME_OR_YAML[,...] [--limit N] [--bf16]``:
downstream tasks through lm-evaluation-harness, scored by maxfp4's own forward pass.

RUN_OR_EXPORT is a run directory (its newest complete checkpoint) or a directory written by
``python -m maxfp4.export`` (either format). A run is scored with the precision policy it trained
with (its FP8 scaling state read from the checkpoint), or with BF16 GEMMs under ``--bf16``; an
export holds no policy and is scored in BF16. Prints lm-eval's table and writes lm-eval's results
dict to ``<RUN_OR_EXPORT>/evals/step_<N>.json`` (N: the checkpoint's step). Bad input (an unknown
task, a task file that does not parse, a run without checkpoints) is one line on stderr and exit
code 2, before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Sequence

from maxfp4.errors import UserError, exit_code_of


@dataclasses.dataclass(frozen=True)
class EvalModel:
    """What scoring needs: parameters, model config, tokenizer, policy and scales, context."""

    params: Any
    model_cfg: Any
    tokenizer: Any
    policy: Any
    scales: dict
    max_length: int
    step: int
    precision: str  # said in the header line: "bf16" or the run's precision.default with rules


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m maxfp4.evaluate",
                                     description="Score a run's newest checkpoint (or an export) on lm-eval tasks.")
    parser.add_argument("run", help="run directory (<output_dir>/<run name>) or an export directory")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated lm-eval task names and/or task YAML files "
                             "(e.g. hellaswag or tests/data/lm_eval/tiny_cloze.yaml)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many documents per task")
    parser.add_argument("--bf16", action="store_true",
                        help="every GEMM in BF16 instead of the run's precision policy")
    parser.add_argument("--rows", type=int, default=8, help="sequences per forward pass (default 8)")
    return parser.parse_args(argv)


def check_source(path: str) -> None:
    """A run with a complete checkpoint, or an export: refused in one line otherwise."""
    from maxfp4.checkpoint import checkpoint_dir, finalized_steps
    from maxfp4.interop.sample import EXPORT_WEIGHTS, HF_CONFIG

    if not os.path.isdir(path):
        raise UserError(f"{path}: not found; expected a run directory (<output_dir>/<run name>) or an export")
    if any(os.path.isfile(os.path.join(path, f)) for f in (HF_CONFIG, EXPORT_WEIGHTS)):
        return
    if not finalized_steps(path):
        raise UserError(f"run directory {path}: no complete checkpoint in {checkpoint_dir(path)}; expected a run "
                        f"that has saved one (at its end, or every checkpoint.every steps), or an export")


def _export_step(path: str) -> int:
    """The checkpoint step an export was written from (config.json's maxfp4 section; 0 if unknown)."""
    from maxfp4.interop.sample import HF_CONFIG

    try:
        with open(os.path.join(path, HF_CONFIG), encoding="utf-8") as fh:
            return int((json.load(fh).get("maxfp4") or {}).get("step") or 0)
    except (OSError, ValueError):
        return 0


def _read_run_precision(run_dir: str, step: int, model_cfg):
    """(policy, scales, label) of the run's saved precision section, the scaling state read from
    checkpoint ``step`` when a recipe keeps one (FP8 delayed scaling)."""
    import jax

    from maxfp4.checkpoint import read_state_part, saved_config
    from maxfp4.config import config_from_dict
    from maxfp4.model import get_model
    from maxfp4.precision import resolve_policy
    from maxfp4.precision.state import init_precision_state, scales_of

    raw, where = saved_config(run_dir, step=step)
    try:
        precision_cfg = config_from_dict({"model": raw.get("model", {}), "precision": raw.get("precision", {})}).precision
    except UserError as error:
        raise UserError(f"{where}: the saved precision section is not usable ({error}); try --bf16") from None
    policy = resolve_policy(precision_cfg, model_cfg.n_layers)
    abstract = jax.eval_shape(lambda: init_precision_state(policy, get_model(model_cfg).block_layer_classes))
    state = {}
    if jax.tree.leaves(abstract):
        device = jax.devices()[0]
        item = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device)),
                            abstract)
        state = read_state_part(run_dir, step, {"precision": item})["precision"]
    return policy, scales_of(state), precision_label(precision_cfg)


def precision_label(precision_cfg) -> str:
    """``fp8_delayed``, or ``nvfp4 with 3 rule(s)``: the policy as the header line and results name it."""
    rules = len(precision_cfg.rules)
    return precision_cfg.default + (f" with {rules} rule(s)" if rules else "")


def load_eval_model(path: str, bf16: bool) -> EvalModel:
    from maxfp4.checkpoint import finalized_steps
    from maxfp4.interop.decode import bf16_policy
    from maxfp4.interop.sample import load_model

    loaded = load_model(path)  # parameters on one device, the tokenizer, data.seq_len
    steps = finalized_steps(path) if os.path.isdir(os.path.join(path, "checkpoints")) else []
    policy, scales, label = bf16_policy(loaded.cfg), {}, "bf16"
    if steps and not bf16:
        policy, scales, label = _read_run_precision(path, steps[-1], loaded.cfg)
    step = steps[-1] if steps else _export_step(path)
    max_length = loaded.context or 2048
    return EvalModel(loaded.params, loaded.cfg, loaded.tokenizer, policy, scales, max_length, step, label)


def evaluate_cli(args: argparse.Namespace, out=None, err=None) -> dict:
    """Check, load, evaluate, print the table, write the results; returns lm-eval's results dict."""
    from maxfp4.files import write_text_atomic
    from maxfp4.lm_eval_adapter import MaxFP4LM
    from maxfp4.lm_eval_tasks import evaluate, load_tasks, results_json, results_table

    out, err = out or sys.stdout, err or sys.stderr
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit {args.limit}: expected an integer >= 1 (documents per task)")
    if args.rows < 1:
        raise UserError(f"--rows {args.rows}: expected an integer >= 1, e.g. 8")
    check_source(args.run)
    tasks = load_tasks(args.tasks)
    model = load_eval_model(args.run, args.bf16)
    err.write(f"evaluating {args.run} step {model.step} with {model.precision} GEMMs on {', '.join(tasks.labels)}"
              f"{f' (at most {args.limit} documents each)' if args.limit else ''}\n")
    err.flush()
    lm = MaxFP4LM(model.params, model.model_cfg, model.tokenizer, policy=model.policy, scales=model.scales,
                  max_length=model.max_length, rows=args.rows)
    results = evaluate(lm, tasks, limit=args.limit)
    results["maxfp4"] = {"source": os.path.abspath(args.run), "step": model.step, "precision": model.precision}
    out.write(results_table(results) + "\n")
    out.flush()
    target = os.path.join(args.run, "evals", f"step_{model.step}.json")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    write_text_atomic(target, results_json(results) + "\n")
    err.write(f"wrote {target}\n")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_code_of(evaluate_cli, args)

