"""``python -m maxfp4.plan CONFIG [more.yaml ...] [key=value ...] --gpus N --gpu h100|h200|b200
--tokens T [--batch-tokens B] [--gpus-per-node G] [--goodput F] [--mfu-from RESULTS.json] [--json]``
and ``--what-if [N,N,...] [--plot FILE]``: project a run's memory, step time and days before it
starts, for BF16, FP8 and NVFP4 side by side. Where the config's batch does not split over the
GPUs (or fit them), the batch and mesh are chosen (maxfp4.plan.layout) and the choice is printed.

Every formula and constant is stated in docs/PLANNING.md; the constants below carry the same names.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Sequence

from maxfp4.config import Config, add_config_arguments, config_from_arguments
from maxfp4.errors import UserError, exit_code_of
from maxfp4.plan.context import plan_rows
from maxfp4.plan.layout import DEFAULT_WHAT_IF_GPUS, describe, format_what_if, layout_for, plot_what_if, what_if
from maxfp4.plan.stages import PlanMesh
from maxfp4.plan.cost import GOODPUT, GPUS, GPUS_PER_NODE, OVERLAP, USABLE_MEMORY, rows_for
from maxfp4.plan.utilisation import read_utilisation


def _check_inputs(gpus: int, gpu: str, tokens: float, batch_tokens: float | None = None,
                  gpus_per_node: int = GPUS_PER_NODE, goodput: float = GOODPUT) -> None:
    if gpu not in GPUS:
        raise UserError(f"--gpu {gpu}: expected one of {', '.join(GPUS)}")
    if gpus <= 0:
        raise UserError(f"--gpus {gpus}: expected a positive number of GPUs")
    if not tokens > 0 or not math.isfinite(tokens):
        raise UserError(f"--tokens {tokens:g}: expected a positive number of tokens")
    if batch_tokens is not None and not (batch_tokens > 0 and math.isfinite(batch_tokens)):
        raise UserError(f"--batch-tokens {batch_tokens:g}: expected a positive number of tokens a step")
    if gpus_per_node <= 0:
        raise UserError(f"--gpus-per-node {gpus_per_node}: expected a positive number of GPUs")
    if not 0 < goodput <= 1:
        raise UserError(f"--goodput {goodput:g}: expected a fraction in (0, 1]")


def plan(cfg: Config, gpus: int, gpu: str, tokens: float, utilisation: float | None = None, *,
         batch_tokens: float | None = None, gpus_per_node: int = GPUS_PER_NODE,
         goodput: float = GOODPUT, stages_only: bool = False) -> list[dict]:
    """One row per precision. The config's batch and mesh are used if they suit ``gpus``;
    otherwise (or with ``batch_tokens``, or ``stages_only``: the best mesh with pipeline stages)
    a layout is chosen, and each row's notes say which."""
    _check_inputs(gpus, gpu, tokens, batch_tokens, gpus_per_node, goodput)
    if not stages_only:
        with_context = plan_rows(cfg, gpus, gpu, tokens, utilisation, batch_tokens, gpus_per_node, goodput)
        if with_context is not None:  # a sequence split over GPUs (maxfp4.plan.context)
            return with_context
    layout = layout_for(cfg, gpus, gpu, batch_tokens, gpus_per_node, stages_only)
    return rows_for(layout, gpus, gpu, tokens, utilisation, gpus_per_node, goodput)


def format_table(rows: list[dict]) -> str:
    r0 = rows[0]
    f = r0["flops_per_token_by_block"]
    mesh = PlanMesh(**r0["mesh"])
    bubble = f" (bubble {r0['pipeline_bubble']:.1%})" if mesh.pipeline > 1 else ""
    lines = list(r0["notes"]) + [
        "",
        f"{r0['gpus']:,} x {r0['gpu'].upper()}, mesh {describe(mesh)}, remat {r0['remat']}, "
        f"{r0['microbatches']} microbatch(es){bubble}, "
        f"{r0['tokens_per_step']:,} tokens/step, {r0['steps']:,} steps",
        f"params {r0['params'] / 1e9:.3f} B (matmul {r0['matmul_params'] / 1e9:.3f} B); "
        f"FLOPs/token {r0['flops_per_token'] / 1e9:.2f} G = "
        + ", ".join(f"{k} {v / 1e9:.2f} G" for k, v in f.items()),
        f"usable memory {USABLE_MEMORY:.0%} of {GPUS[r0['gpu']]['memory_gb']:.0f} GB; FSDP and data comm "
        f"{OVERLAP:.0%} hidden, tensor comm exposed; days and GPU-hours at goodput {r0['goodput']:.0%} (failures, restarts, "
        f"checkpoints: --goodput)",
        "",
        f"{'precision':<17}{'mem GB':>9}{'other remat':>12}{'fits':>6}{'compute s':>11}{'comm s':>9}"
        f"{'step s':>9}{'MFU':>6}{'days':>10}{'GPU-hours':>13}",
    ]
    for r in rows:
        label = r["precision"] + (" (emulated)" if _emulated(r["precision"], r["gpu"]) else "")
        lines.append(f"{label:<17}{r['memory_per_device_gb']:>9.1f}{r['memory_other_remat_gb']:>12.1f}"
                     f"{'yes' if r['fits'] else 'NO':>6}{r['compute_s']:>11.3f}{r['comm_s']:>9.3f}"
                     f"{r['step_time_s']:>9.3f}{r['mfu']:>6.0%}{r['days']:>10.2f}{r['gpu_hours']:>13,.0f}")
    other = "full" if r0["remat"] == "none" else "none"
    lines += ["", f"mem GB: memory per device with train.remat={r0['remat']}; other remat: the same with "
                  f"train.remat={other}; fits: within the usable memory;",
              "compute s, comm s (exposed), step s: one step; MFU: model FLOPs over the BF16 peak;",
              "(emulated): the GPU has no tensor cores of that format: BF16 GEMMs plus the quantization passes"]
    return "\n".join(lines)


def _emulated(precision: str, gpu: str) -> bool:
    """A precision whose peak class the GPU lacks (NVFP4 on Hopper) runs emulated."""
    from maxfp4.metrics import DEVICE_PEAKS_TFLOPS
    from maxfp4.plan.cost import PLAN_RECIPES
    from maxfp4.precision.catalog import SPECS

    return SPECS[PLAN_RECIPES[precision]].peak not in DEVICE_PEAKS_TFLOPS[gpu.upper()]


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage block would make a bad flag several lines
        raise UserError(message)


def _number(text: str, flag: str) -> float:
    try:
        return float(text.replace("_", ""))
    except ValueError:
        raise UserError(f"{flag} {text}: expected a number") from None


def _goodput(text: str) -> float:
    """``--goodput``: a fraction, or a run directory (or its goodput.json) whose measured one is used."""
    import os

    if not os.path.exists(text):
        return _number(text, "--goodput")
    from maxfp4.goodput import read_goodput

    measured = read_goodput(text).get("goodput")
    if not measured:
        raise UserError(f"--goodput {text}: no measured goodput there (goodput.json is written by a training run)")
    return measured


def _count(text: str, flag: str) -> int:
    value = _number(text, flag)
    if value != int(value):
        raise UserError(f"{flag} {text}: expected a whole number")
    return int(value)


def _gpu_counts(text: str) -> list[int]:
    counts = [_count(t, "--what-if") for t in text.split(",") if t.strip()]
    if not counts or min(counts) <= 0:
        raise UserError(f"--what-if {text}: expected GPU counts > 0 separated by commas, e.g. 1024,4096")
    return counts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _OneLineParser(
        prog="python -m maxfp4.plan",
        description="Project parameters, memory, step time and days of a training run.")
    add_config_arguments(parser)
    parser.add_argument("--gpus", help="number of GPUs (not with --what-if)")
    parser.add_argument("--gpu", required=True, help=f"one of {', '.join(GPUS)}")
    parser.add_argument("--tokens", required=True, help="training tokens, e.g. 15e12")
    parser.add_argument("--batch-tokens", help="choose the global batch near this many tokens a step, "
                        "and the mesh for it (default: the config's, unless it does not suit the GPUs; "
                        "then ~4.2M)")
    parser.add_argument("--gpus-per-node", default=str(GPUS_PER_NODE), help="GPUs a node (default 8)")
    parser.add_argument("--goodput", default=str(GOODPUT),
                        help=f"share of wall-clock time that trains (default {GOODPUT}), or a run directory "
                             "whose measured goodput.json gives it")
    parser.add_argument("--what-if", nargs="?", const="default", metavar="N,N,...",
                        help="days and GPU-hours for these GPU counts x precisions (default grid "
                             "8..16384)")
    parser.add_argument("--plot", metavar="FILE", help="with --what-if: draw the grid to this image")
    parser.add_argument("--stages", action="store_true",
                        help="choose among meshes with pipeline stages only (to set the best of them beside "
                             "the mesh chosen without this flag)")
    parser.add_argument("--mfu-from", help="JSON results with 'mfu' or 'tflops_per_device'")
    parser.add_argument("--json", action="store_true", help="print JSON")
    return parser.parse_intermixed_args(argv)  # key=value overrides may follow the flags


def main(argv: Sequence[str] | None = None) -> int:
    def run() -> None:
        args = parse_args(argv)
        gpu = args.gpu.lower()
        tokens = _number(args.tokens, "--tokens")
        batch_tokens = _number(args.batch_tokens, "--batch-tokens") if args.batch_tokens is not None else None
        gpus_per_node = _count(args.gpus_per_node, "--gpus-per-node")
        goodput = _goodput(args.goodput)
        if args.what_if is None:
            if args.gpus is None:
                raise UserError("--gpus: expected a number of GPUs (or --what-if for a grid)")
            if args.plot:
                raise UserError(f"--plot {args.plot}: draws the --what-if grid; add --what-if")
            gpus = _count(args.gpus, "--gpus")
        else:
            if args.gpus is not None:
                raise UserError(f"--gpus {args.gpus}: --what-if takes its GPU counts as --what-if N,N,...")
            if args.mfu_from:
                raise UserError("--mfu-from: not with --what-if (one run's utilisation does not hold at every scale)")
            if args.stages:
                raise UserError("--stages: not with --what-if (it chooses one layout, for --gpus)")
            gpus = 1
        _check_inputs(gpus, gpu, tokens, batch_tokens, gpus_per_node, goodput)  # before reading any file
        cfg = config_from_arguments(args)
        if args.what_if is not None:
            counts = list(DEFAULT_WHAT_IF_GPUS) if args.what_if == "default" else _gpu_counts(args.what_if)
            grid = what_if(cfg, counts, gpu, tokens, batch_tokens=batch_tokens, gpus_per_node=gpus_per_node,
                           goodput=goodput)
            print(json.dumps(grid) if args.json else format_what_if(grid, gpu, tokens, goodput))
            if args.plot:
                plot_what_if(grid, args.plot, f"{args.config}: {tokens:.3g} tokens on {gpu.upper()}")
                if not args.json:
                    print(f"plot written to {args.plot}")
            return
        utilisation = read_utilisation(args.mfu_from, gpu) if args.mfu_from else None
        rows = plan(cfg, gpus, gpu, tokens, utilisation, batch_tokens=batch_tokens,
                    gpus_per_node=gpus_per_node, goodput=goodput, stages_only=args.stages)
        print(json.dumps(rows) if args.json else format_table(rows))

    return exit_code_of(run)


if __name__ == "__main__":
    sys.exit(main())
