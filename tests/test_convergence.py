"""benchmarks/convergence.py end to end on the embedded corpus: a tiny model, two variants, two
seeds and one single-seed ablation, one run cut off by SIGTERM and resumed by running the same command again, and the
summary's arithmetic checked against the per-run results it was made from."""

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import pytest

from tests.conftest import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
              "model.vocab_size=384", "data.seq_len=64", "data.global_batch=8", "train.log_every=2",
              "optim.warmup_steps=2", "checkpoint.every=4", "resilience.preflight=false"]


def _command(out, *extra):
    return [sys.executable, os.path.join(REPO, "benchmarks", "convergence.py"), "--config",
            os.path.join(REPO, "configs", "quickstart.yaml"), "--data", "builtin", "--variants", "bf16", "fp8_current",
            "--seeds", "0", "1", "--ablations", "mxfp8", "--reference", "fp8_current", "--tokens", str(16 * 512), "--evals", "2", "--parallel", "1", "--out", str(out),
            *TINY_MODEL, *extra]


# Six training processes (69 s on two cores): runs with -m slow, and on every convergence study.
@pytest.mark.slow
def test_convergence_benchmark_resumes_a_cut_off_run_and_summarizes_over_seeds(tmp_path):
    env = cpu_env(1, PYTHONPATH=REPO)
    # First call: the first run is slowed down (0.5 s a step) and the benchmark gets SIGTERM once
    # its first records are written; the trainer checkpoints and exits, the benchmark says what
    # is unfinished and exits 3.
    first = subprocess.Popen(_command(tmp_path, "resilience.fault.slow_process=0", "resilience.fault.slow_seconds=0.5"),
                             env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "runs" / "bf16-s0" / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3) and time.time() < deadline:
        assert first.poll() is None, first.stdout.read()
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    out1, _ = first.communicate(timeout=240)
    assert first.returncode == 3, out1
    assert "bf16-s0: exit 143" in out1 and "run the same command again" in out1, out1
    cut_at = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    assert cut_at < 16, out1

    # --gpus names the devices the runs go to (here only as CUDA_VISIBLE_DEVICES: the CPU ignores it).
    second = subprocess.run(_command(tmp_path, "--gpus", "7"), env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "5 to run" in second.stdout  # the cut-off run is among them, resumed below
    # Seed-major order, the ablation last (with the first seed only).
    started = [line.split(":")[0] for line in second.stdout.splitlines() if line.endswith(": started on GPU 7")]
    assert started == ["bf16-s0", "fp8_current-s0", "bf16-s1", "fp8_current-s1", "mxfp8-s0"], second.stdout
    log = (tmp_path / "runs" / "bf16-s0.log").read_text()
    assert "resumed from" in log, log

    results = {}
    for name in ("bf16-s0", "bf16-s1", "fp8_current-s0", "fp8_current-s1", "mxfp8-s0"):
        r = json.loads((tmp_path / "results" / f"{name}.json").read_text())
        assert r["complete"] and r["steps"] == 16 and r["tokens_per_step"] == 512, r
        assert [t for t, _ in r["eval"]] == [8 * 512, 16 * 512], r  # every 8 steps and at the end
        assert all(math.isfinite(loss) for _, loss in r["eval"]), r
        results[name] = r
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["incomplete"] == [] and summary["steps"] == 16
    for variant in ("bf16", "fp8_current"):
        points = summary["variants"][variant]["points"]
        assert [p["tokens"] for p in points] == [8 * 512, 16 * 512]
        for i, p in enumerate(points):
            losses = [results[f"{variant}-s{s}"]["eval"][i][1] for s in (0, 1)]
            assert p["n"] == 2
            assert math.isclose(p["mean"], statistics.fmean(losses), rel_tol=1e-12)
            assert math.isclose(p["std"], statistics.stdev(losses), rel_tol=1e-12)
            assert math.isclose(p["sem"], p["std"] / math.sqrt(2), rel_tol=1e-12)
    base, fp8 = summary["variants"]["bf16"]["points"][-1], summary["variants"]["fp8_current"]["points"][-1]
    assert "gap" not in base
    assert math.isclose(fp8["gap"], fp8["mean"] / base["mean"] - 1, rel_tol=1e-9)
    expected_sem = math.hypot(fp8["sem"], fp8["mean"] / base["mean"] * base["sem"]) / base["mean"]
    assert math.isclose(fp8["gap_sem"], expected_sem, rel_tol=1e-9)
    # The paired gap: the mean of the per-seed relative differences and their standard error.
    diffs = [(results[f"fp8_current-s{s}"]["eval"][-1][1] - results[f"bf16-s{s}"]["eval"][-1][1])
             / results[f"bf16-s{s}"]["eval"][-1][1] for s in (0, 1)]
    assert math.isclose(fp8["paired_gap"], statistics.fmean(diffs), rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(fp8["paired_gap_sem"], statistics.stdev(diffs) / math.sqrt(2), rel_tol=1e-9, abs_tol=1e-15)
    assert "paired gap" in second.stdout
    # The ablation: one seed, no spread of its own; its gap's error is the baseline's alone.
    ablation = summary["variants"]["mxfp8"]["points"][-1]
    assert summary["variants"]["mxfp8"]["seeds"] == [0] and ablation["n"] == 1 and ablation["std"] == 0.0
    assert math.isclose(ablation["mean"], results["mxfp8-s0"]["eval"][-1][1], rel_tol=1e-12)
    assert math.isclose(ablation["gap_sem"], ablation["mean"] / base["mean"] * base["sem"] / base["mean"], rel_tol=1e-9)
    base_s0 = results["bf16-s0"]["eval"][-1][1]
    assert math.isclose(ablation["paired_gap"], (ablation["mean"] - base_s0) / base_s0, rel_tol=1e-9, abs_tol=1e-15)
    assert ablation["paired_gap_sem"] is None
    # The ablation against the reference run of the same seed, at their last shared token count.
    (row,) = summary["against_reference"]
    ref_s0, abl_s0 = results["fp8_current-s0"]["eval"][-1], results["mxfp8-s0"]["eval"][-1]
    assert row["run"] == "mxfp8-s0" and row["tokens"] == ref_s0[0] == abl_s0[0] and row["complete"]
    assert math.isclose(row["vs_reference"], abl_s0[1] / ref_s0[1] - 1, rel_tol=1e-9, abs_tol=1e-15)
    assert math.isclose(row["vs_baseline"], abl_s0[1] / base_s0 - 1, rel_tol=1e-9, abs_tol=1e-15)
    # On another machine (no run directories), kept complete results count as finished runs;
    # one kept result of a cut-off run does not, and that run starts again.
    shutil.rmtree(tmp_path / "runs")
    # So does one of other data (its corpus fingerprint differs).
    cut = json.loads((tmp_path / "results" / "mxfp8-s0.json").read_text())
    (tmp_path / "results" / "mxfp8-s0.json").write_text(json.dumps(dict(cut, complete=False)))
    assert set(cut["data"]) == {"builtin_tokenizer_sha256"}
    other = json.loads((tmp_path / "results" / "fp8_current-s1.json").read_text())
    (tmp_path / "results" / "fp8_current-s1.json").write_text(json.dumps(dict(other, data={"train_tokens": 1})))
    third = subprocess.run(_command(tmp_path), env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "3 run(s) finished earlier, 2 to run" in third.stdout, third.stdout
    assert "fp8_current-s1: the kept result is of other data" in third.stdout, third.stdout
    started = [line.split(":")[0] for line in third.stdout.splitlines() if line.endswith(": started")]
    assert started == ["fp8_current-s1", "mxfp8-s0"], third.stdout
    rebuilt = json.loads((tmp_path / "summary.json").read_text())
    assert rebuilt["incomplete"] == []
    assert rebuilt["variants"]["bf16"] == summary["variants"]["bf16"]  # kept as they were
    # The run made again on CPU gives the same losses (only its speed differs).
    assert rebuilt["variants"]["fp8_current"]["points"] == summary["variants"]["fp8_current"]["points"]
    # --report rebuilds the same summary from the results alone.
    (tmp_path / "summary.json").unlink()
    again = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "convergence.py"), "--report", str(tmp_path)],
                           env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["variants"] == rebuilt["variants"]
    # Every run scored the same held-out tokens: the split does not follow the seed.
    assert (tmp_path / "corpus" / "heldout.jsonl").stat().st_size > 0
    assert (tmp_path / "convergence.png").stat().st_size > 10_000


def test_a_cut_off_ablation_is_compared_with_the_reference_at_their_last_shared_token_count():
    """against_reference on hand-made results: a cut-off run meets the reference's run of the same
    seed where both were evaluated last; a main variant and a run without its reference seed are
    left out."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("convergence", os.path.join(REPO, "benchmarks", "convergence.py"))
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)

    def run(variant, seed, losses, complete=True):
        return {"variant": variant, "seed": seed, "complete": complete,
                "eval": [[100 * (i + 1), loss] for i, loss in enumerate(losses)]}

    results = [run("bf16", 0, [3.0, 2.0, 1.5]), run("nvfp4", 0, [3.1, 2.2, 1.6]), run("fp8_delayed", 0, [3.0, 2.1, 1.5]),
               run("mxfp4", 0, [3.3, 2.4], complete=False), run("nvfp4_no_sr", 1, [3.0, 2.0, 1.5])]
    (row,) = conv.against_reference(results, reference="nvfp4", baseline="bf16")
    assert row["run"] == "mxfp4-s0" and row["tokens"] == 200 and not row["complete"]
    assert (row["loss"], row["reference_loss"]) == (2.4, 2.2)
    assert math.isclose(row["vs_reference"], 2.4 / 2.2 - 1) and math.isclose(row["vs_baseline"], 2.4 / 2.0 - 1)
    # An ablation on several seeds: the mean of its complete same-seed differences (cut-off runs
    # left out), exact arithmetic on made-up losses.
    results += [run("nvfp4", 1, [3.0, 2.0, 1.5]), run("mxfp4", 1, [3.2, 2.3, 1.8])]
    assert conv.reference_means(conv.against_reference(results, "nvfp4")) == {}  # one complete run: no mean
    results += [run("nvfp4", 2, [3.2, 2.4, 1.7]), run("mxfp4", 2, [3.3, 2.5, 1.9])]
    rows = conv.against_reference(results, reference="nvfp4", baseline="bf16")
    means = conv.reference_means(rows)
    diffs = [1.8 / 1.5 - 1, 1.9 / 1.7 - 1]
    assert means["mxfp4"]["n"] == 2 and math.isclose(means["mxfp4"]["mean"], statistics.fmean(diffs))
    assert math.isclose(means["mxfp4"]["sem"], statistics.stdev(diffs) / math.sqrt(2))
    last = conv.format_against_reference(rows, "nvfp4").splitlines()[-1]
    assert last.startswith("mxfp4 (2 seeds)") and f"{100 * statistics.fmean(diffs):+.2f}%" in last
