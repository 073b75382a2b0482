"""``python -m maxfp4.plot`` and TensorBoard on real short runs: every curve a user looks at is
drawn from the run's metrics, several runs overlaid, and TensorBoard's own reader reads the
same steps."""

import io
import json
import math

import jax
import pytest

from maxfp4.plot import PANELS, draw, main as plot_main, smoothed
from maxfp4.train import train

CURVES = ("loss", "loss_smoothed", "eval_loss", "lr", "grad_norm", "tokens_per_s", "skipped_steps")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two 8-step runs that differ in seed: held-out loss every 4 steps, the terminal line every
    4, and step 5's gradients made NaN so the guard skips it."""
    from maxfp4.config import load_config
    from tests.conftest import TINY

    out = tmp_path_factory.mktemp("runs")
    runs, printed = [], []
    for name, seed in (("a", 0), ("b", 1)):
        stream = io.StringIO()
        cfg = load_config(None, TINY + [
            f"run.output_dir={out}", f"run.name={name}", f"run.seed={seed}", "train.steps=8", "train.log_every=4",
            "train.eval_every=4", "resilience.fault.nonfinite_at_steps=[5]", "checkpoint.enabled=false"])
        train(cfg, devices=jax.devices()[:1], stream=stream)
        runs.append(str(out / name))
        printed.append(stream.getvalue())
    return runs, printed


def _records(run_dir):
    with open(f"{run_dir}/metrics.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_every_step_is_in_metrics_jsonl_while_the_terminal_prints_every_log_every(two_runs):
    runs, printed = two_runs
    records = _records(runs[0])
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["step"] for r in records if "eval_loss" in r] == [4, 8]
    assert [r["skipped_steps"] for r in records] == [0, 0, 0, 0, 1, 1, 1, 1]
    shown = [line.split("|")[0].split()[1] for line in printed[0].splitlines() if line.startswith("step ")]
    assert shown == ["1/8", "4/8", "8/8"]


def test_every_curve_is_drawn_from_the_runs_metrics(two_runs):
    runs, _ = two_runs
    fig = draw(runs)
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines()}
    for label, run_dir in zip(("a", "b"), runs):
        records = _records(run_dir)
        for curve in CURVES:
            assert f"{label}:{curve}" in lines, (label, curve)

        def drawn(curve):
            line = lines[f"{label}:{curve}"]
            return list(line.get_xdata()), [float(v) for v in line.get_ydata()]

        def logged(key, keep=lambda r: True):
            kept = [r for r in records if r.get(key) is not None and keep(r)]
            return [r["step"] for r in kept], [float(r[key]) for r in kept]

        for key in ("loss", "eval_loss", "lr", "grad_norm", "skipped_steps"):
            steps, values = logged(key)
            got_steps, got = drawn(key)
            assert got_steps == steps
            assert all(g == v or (math.isnan(g) and math.isnan(v)) for g, v in zip(got, values)), key
        # Throughput from the second step on (the first one compiled).
        assert drawn("tokens_per_s") == logged("tokens_per_s", lambda r: r["step_time_s"] is not None)
        assert drawn("tokens_per_s")[0][0] == 2
        # Eight points are too few to smooth: the smoothed curve is the loss without the skipped step.
        assert drawn("loss_smoothed") == logged("loss", lambda r: r["step"] != 5)

    # Each panel names both runs.
    titles = [title for _, title, _ in PANELS]
    for ax in fig.axes:
        assert ax.get_title() in titles
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b"], ax.get_title()


def test_plot_command_writes_an_image_and_refuses_a_missing_run_in_one_line(two_runs, tmp_path, capsys):
    runs, _ = two_runs
    png = tmp_path / "cmp.png"
    assert plot_main(runs + ["--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    capsys.readouterr()
    assert plot_main([str(tmp_path / "nope"), "--out", str(png)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "metrics.jsonl: not found" in err[0]


def test_smoothing_keeps_a_constant_and_steps_over_missing_losses():
    # The start-up correction makes a constant curve constant from its first point.
    assert smoothed([2.5] * 50, 0.9) == pytest.approx([2.5] * 50, rel=1e-12)
    out = smoothed([1.0, math.nan, 3.0], 0.5)
    # Float64 by hand: n=1: 0.5*1/(1-0.5) = 1; NaN holds it; n=2: (0.25 + 1.5)/(1-0.25) = 7/3.
    assert out == pytest.approx([1.0, 1.0, 7 / 3], rel=1e-12)


def test_tensorboard_reads_the_runs_scalars(two_runs):
    """The README's `tensorboard --logdir runs/` reads these files with this accumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs, _ = two_runs
    events = EventAccumulator(f"{runs[0]}/tensorboard").Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "skipped_steps"} <= tags
    records = _records(runs[0])
    assert [e.step for e in events.Scalars("loss")] == [r["step"] for r in records]
    assert [e.step for e in events.Scalars("eval_loss")] == [4, 8]
    for event, record in zip(events.Scalars("lr"), records):
        assert event.value == pytest.approx(record["lr"], rel=1e-6)  # stored as float32
