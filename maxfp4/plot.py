"""``python -m maxfp4.plot RUN_DIR... [-o out.png]``: loss and tokens/s of several runs in one PNG,
to compare precisions at a glance."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

from maxfp4.errors import UserError, exit_code_of


def read_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UserError(f"{path}: not found; expected a run directory written by maxfp4.train")
    records = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise UserError(f"{path} line {n}: not valid JSON") from None
    return records


def plot_runs(run_dirs: Sequence[str], out_path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run_dir in run_dirs:
        recs = read_metrics(run_dir)
        label = os.path.basename(os.path.normpath(run_dir))
        ax_loss.plot([r["step"] for r in recs], [r["loss"] for r in recs], label=label)
        timed = [r for r in recs if r.get("step_time_s")]
        ax_tps.plot([r["step"] for r in timed], [r["tokens_per_s"] for r in timed], label=label)
    ax_loss.set(xlabel="step", ylabel="training loss (nats/token)", title="Loss")
    ax_tps.set(xlabel="step", ylabel="tokens/s (all devices)", title="Throughput")
    for ax in (ax_loss, ax_tps):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxfp4.plot", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", help="run directories (each holds metrics.jsonl)")
    parser.add_argument("-o", "--output", default="runs.png", help="PNG to write (default runs.png)")
    args = parser.parse_args(argv)
    return exit_code_of(lambda: print(plot_runs(args.run_dirs, args.output)))


if __name__ == "__main__":
    sys.exit(main())
