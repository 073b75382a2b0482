"""``python -m maxfp4.plot RUN_DIR... [--out FILE]``: every curve of one or several runs in one
picture, the runs overlaid with a legend: training loss (each step faint, smoothed solid),
held-out loss (with the lm-eval scores of ``train.eval_tasks`` on a second axis), learning rate,
gradient norm, tokens/s and skipped steps (docs/METRICS.md).

Reads each run's ``metrics.jsonl`` (one record per step); a curve a run did not log (held-out
loss without ``train.eval_every``, say) is left out for that run and its panel says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Sequence

from maxfp4.errors import UserError, exit_code_of

# (curve, panel title, y label): the panels in reading order.
PANELS = (
    ("loss", "Training loss", "nats/token"),
    ("eval_loss", "Held-out loss", "nats/token"),
    ("lr", "Learning rate", "lr"),
    ("grad_norm", "Gradient norm", "global L2 norm (before clipping)"),
    ("tokens_per_s", "Throughput", "tokens/s (all devices)"),
    ("skipped_steps", "Skipped steps (guard)", "steps skipped so far"),
)
TASK_PREFIX = "lm_eval/"
NOT_LOGGED = {"eval_loss": "no held-out loss logged (train.eval_every=0)",
              "skipped_steps": "no skipped steps logged"}


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
    if not records:
        raise UserError(f"{path}: no records yet; expected at least one finished step")
    return records


def smoothed(values: Sequence[float], weight: float) -> list[float]:
    """Exponential moving average with TensorBoard's start-up correction (dividing by
    ``1 - weight**n``, so the first points are not pulled toward 0); non-finite values are
    skipped and keep the previous average."""
    out, average, n = [], 0.0, 0
    for v in values:
        if math.isfinite(v):
            average, n = weight * average + (1 - weight) * v, n + 1
        out.append(average / (1 - weight ** n) if n else math.nan)
    return out


def smoothing_weight(points: int) -> float:
    """About a 20th of the curve per time constant: 200 steps average over ~10, a handful of
    points (old runs logged every log_every steps) are not smoothed."""
    return max(0.0, 1.0 - 20.0 / points) if points > 20 else 0.0


def curves(records: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """``{curve: (steps, values)}`` of one run. ``loss_smoothed`` leaves out the steps the guard
    skipped (their loss may be a spike or NaN); tokens/s starts after the first step, which
    compiled."""
    def series(key, keep=lambda r: True):
        kept = [r for r in records if r.get(key) is not None and keep(r)]
        return [r["step"] for r in kept], [float(r[key]) for r in kept]

    out = {key: series(key) for key in ("loss", "eval_loss", "lr", "grad_norm", "skipped_steps")}
    out["tokens_per_s"] = series("tokens_per_s", lambda r: r.get("step_time_s") is not None)
    # Downstream task scores (train.eval_tasks: "lm_eval/<task>/<metric>"), drawn beside the held-out loss.
    for key in sorted({k for r in records for k in r if k.startswith(TASK_PREFIX)}):
        out[key] = series(key)
    skipped_at, previous = set(), 0
    for r in records:
        if r.get("skipped_steps", previous) > previous:
            skipped_at.add(r["step"])
        previous = r.get("skipped_steps", previous)
    steps, losses = series("loss", lambda r: r["step"] not in skipped_at)
    out["loss_smoothed"] = (steps, smoothed(losses, smoothing_weight(len(losses))))
    return {k: v for k, v in out.items() if v[0]}


def run_labels(run_dirs: Sequence[str]) -> list[str]:
    """Each run's directory name, or its whole path where two names are the same."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return [name if names.count(name) == 1 else os.path.normpath(d) for name, d in zip(names, run_dirs)]


def draw(run_dirs: Sequence[str]):
    """The figure; every line's gid is ``"<label>:<curve>"``."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    runs = [(label, curves(read_metrics(d))) for label, d in zip(run_labels(run_dirs), run_dirs)]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, title, ylabel) in zip(axes.flat, PANELS):
        drawn = False
        for i, (label, run) in enumerate(runs):
            color = colors[i % len(colors)]
            if key == "loss" and "loss" in run:
                ax.plot(*run["loss"], color=color, alpha=0.3, linewidth=0.8, gid=f"{label}:loss")
                ax.plot(*run["loss_smoothed"], color=color, linewidth=1.8, label=label, gid=f"{label}:loss_smoothed")
                drawn = True
            elif key in run:
                style = {"marker": "o", "markersize": 3} if key == "eval_loss" else {}
                draw_fn = ax.step if key == "skipped_steps" else ax.plot
                kwargs = {"where": "post"} if key == "skipped_steps" else {}
                draw_fn(*run[key], color=color, label=label, gid=f"{label}:{key}", **style, **kwargs)
                drawn = True
        if key == "eval_loss":
            _draw_task_scores(ax, runs, colors)
        if key == "grad_norm" and drawn:
            ax.set_yscale("log")
        if key == "skipped_steps":  # a count: whole numbers from 0, also when nothing was skipped
            ax.set_ylim(bottom=0, top=max(1, ax.get_ylim()[1]))
            ax.yaxis.get_major_locator().set_params(integer=True)
        if not drawn:
            ax.text(0.5, 0.5, NOT_LOGGED.get(key, "not logged"), ha="center", va="center",
                    transform=ax.transAxes, color="gray")
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize="small")
    fig.suptitle("training loss: each step faint, smoothed solid", fontsize="small", color="gray")
    fig.tight_layout()
    return fig


def _draw_task_scores(ax, runs, colors) -> None:
    """lm-eval scores on a second y axis of the held-out loss panel, dashed, one line a metric."""
    scores = [(i, label, key, run[key]) for i, (label, run) in enumerate(runs) for key in run
              if key.startswith(TASK_PREFIX)]
    if not scores:
        return
    twin = ax.twinx()
    for i, label, key, points in scores:
        twin.plot(*points, color=colors[i % len(colors)], linestyle="--", marker="s", markersize=3,
                  label=f"{label}: {key.removeprefix(TASK_PREFIX)}", gid=f"{label}:{key}")
    twin.set_ylabel("lm-eval score (dashed)")
    twin.legend(fontsize="x-small", loc="upper right")


def save_figure(fig, path: str, flag: str, dpi: int = 100) -> str:
    """Write ``fig`` to ``path`` and close it; a path that cannot be written is one line naming
    ``flag``, the option that gave it."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise UserError(f"{flag} {path}: cannot be written ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return path


def plot_runs(run_dirs: Sequence[str], out_path: str) -> str:
    return save_figure(draw(run_dirs), out_path, "--out")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxfp4.plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="run directories (each holds metrics.jsonl)")
    parser.add_argument("-o", "--out", "--output", dest="out", default="runs.png",
                        help="image to write, PNG or any format matplotlib knows by the suffix (default runs.png)")
    args = parser.parse_args(argv)
    return exit_code_of(lambda: print(plot_runs(args.run_dirs, args.out)))


if __name__ == "__main__":
    sys.exit(main())
