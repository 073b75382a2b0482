"""benchmarks/convergence.py comparing two models: a mixture of experts against the dense model of
equal active parameters (configs/conv-*.yaml), with BF16 and FP8 experts. The CPU smoke runs the
real configs shrunk (one seed, four steps on the embedded corpus); the interval arithmetic is
checked on hand-made results against scipy's t quantile; the configs' equal active parameters
against a hand count."""

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys

import pytest
from scipy import stats

from maxfp4.config import load_config
from maxfp4.model_spec import model_spec
from tests.conftest import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE, MOE = (os.path.join(REPO, "configs", f) for f in ("conv-dense-38m.yaml", "conv-moe-8x2-38m.yaml"))
VARIANTS = ["dense.bf16", "moe.bf16", "moe.fp8_experts"]


def _load_benchmark():
    spec = importlib.util.spec_from_file_location("convergence", os.path.join(REPO, "benchmarks", "convergence.py"))
    conv = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conv)
    return conv


def test_the_moe_and_dense_configs_have_equal_active_parameters():
    """Counted by hand from the configs' sizes (d 512, 8 attention blocks of 8 x 64 heads, SwiGLU
    2048 against 8 experts of 1024 top-2, vocabulary 8192): equal but for the routers (0.09%)."""
    dense, moe = (load_config([p], []).model for p in (DENSE, MOE))
    d, blocks, vocab = 512, 8, 8192
    attention, head = 4 * d * d, d * vocab
    dense_hand = blocks * (attention + 3 * d * 2048) + head
    moe_hand = blocks * (attention + d * 8 + 2 * 3 * d * 1024) + head
    moe_stored = blocks * (attention + d * 8 + 8 * 3 * d * 1024) + head
    assert model_spec(dense).matmul_params == dense_hand
    assert (model_spec(moe).matmul_params, model_spec(moe).matmul_params_total) == (moe_hand, moe_stored)
    assert 0 < moe_hand / dense_hand - 1 < 1e-3
    # Equal FLOPs a token too (6 x active matmul parameters + attention's products).
    ratio = model_spec(moe).flops_per_token(1024) / model_spec(dense).flops_per_token(1024)
    assert 1 < ratio < 1 + 1e-3
    # The same model otherwise: the MoE config includes the dense one and replaces the MLP blocks.
    assert moe.pattern == dense.pattern.replace("-", "E") and moe.d_model == dense.d_model
    assert (moe.moe.experts, moe.moe.top_k, moe.moe.score) == (8, 2, "sigmoid") and moe.moe.bias_update_rate > 0


def test_paired_comparisons_carry_a_student_t_interval_over_seeds():
    """Hand-made losses for three seeds: each pair's per-seed ratios, their mean, standard error
    and 95% interval (scipy's t quantile at 2 degrees of freedom); a cut-off run leaves its seed
    out; MoE-with-FP8 is compared with the dense baseline and with the MoE in BF16."""
    conv = _load_benchmark()
    losses = {"dense.bf16": [2.00, 1.90, 2.10], "moe.bf16": [1.90, 1.83, 1.99], "moe.fp8_experts": [1.905, 1.834, 1.99]}
    results = [{"variant": v, "seed": s, "complete": True, "eval": [[100, 9.0], [200, loss]]}
               for v, per_seed in losses.items() for s, loss in enumerate(per_seed)]
    results.append({"variant": "moe.bf16", "seed": 3, "complete": False, "eval": [[100, 9.0]]})
    pairs = conv.comparison_pairs(VARIANTS, "dense.bf16")
    assert pairs == [("moe.bf16", "dense.bf16"), ("moe.fp8_experts", "dense.bf16"), ("moe.fp8_experts", "moe.bf16")]
    t975 = stats.t.ppf(0.975, df=2)
    for variant, against in pairs:
        c = conv.paired_comparison(results, variant, against)
        gaps = [a / b - 1 for a, b in zip(losses[variant], losses[against])]
        sem = statistics.stdev(gaps) / math.sqrt(3)
        assert (c["tokens"], c["seeds"], c["n"]) == (200, [0, 1, 2], 3)
        assert all(math.isclose(x, y, rel_tol=1e-12) for x, y in zip(c["gaps"], gaps))
        assert math.isclose(c["mean"], statistics.fmean(gaps), rel_tol=1e-12)
        assert math.isclose(c["sem"], sem, rel_tol=1e-12)
        # The table's t is rounded to 4 digits: the interval's ends agree to 1e-4 of its half-width.
        assert math.isclose(c["high"] - c["mean"], t975 * sem, rel_tol=1e-4)
        assert math.isclose(c["mean"] - c["low"], t975 * sem, rel_tol=1e-4)
    assert conv.paired_comparison(results, "moe.bf16", "nothing.bf16") is None
    table = conv.format_comparisons([conv.paired_comparison(results, "moe.bf16", "dense.bf16")])
    assert "moe.bf16 vs dense.bf16" in table and "-4.64%" in table  # mean of -5.00%, -3.68%, -5.24%


def test_a_variant_of_an_unknown_model_is_refused_in_one_line(capsys):
    conv = _load_benchmark()
    with pytest.raises(SystemExit) as exit_info:
        conv.main(["--model", f"dense={DENSE}", "--variants", "dense.bf16", "moe.bf16", "--baseline", "dense.bf16",
                   "--data", "builtin", "--tokens", "100", "--out", "unused"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--variants moe.bf16" in error and "NAME.PRECISION" in error and "dense.bf16" in error, error


def test_moe_against_dense_smoke_on_cpu(tmp_path):
    """The real configs shrunk to two blocks (attention + MLP, attention + MoE), one seed, four
    steps: every run trains its own model and precision, and the summary holds the MoE's gap to
    the dense model and FP8 experts' gap to BF16 experts, each the ratio of the runs' losses."""
    shrink = ("model: {{pattern: '{pattern}', d_model: 32, n_heads: 2, n_kv_heads: 2, d_ff: 64, vocab_size: 384{moe}}}\n"
              "data: {{seq_len: 32, global_batch: 4, eval_batches: 1}}\n")
    for name, config, pattern, moe in (("dense", DENSE, "*-", ""), ("moe", MOE, "*E", ", moe: {d_ff: 32}")):
        (tmp_path / f"{name}.yaml").write_text(f"include: [{config}]\n" + shrink.format(pattern=pattern, moe=moe))
    out = tmp_path / "out"
    command = [sys.executable, os.path.join(REPO, "benchmarks", "convergence.py"), "--model", f"dense={tmp_path}/dense.yaml",
               "--model", f"moe={tmp_path}/moe.yaml", "--variants", *VARIANTS, "--baseline", "dense.bf16",
               "--seeds", "0", "--data", "builtin", "--tokens", str(4 * 128), "--evals", "1", "--parallel", "1",
               "--out", str(out), "train.log_every=1", "optim.warmup_steps=1", "resilience.preflight=false"]
    run = subprocess.run(command, env=cpu_env(1, PYTHONPATH=REPO), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 to run: 4 steps of 128 tokens" in run.stdout, run.stdout
    final = {}
    for variant in VARIANTS:
        r = json.loads((out / "results" / f"{variant}-s0.json").read_text())
        assert r["complete"] and r["steps"] == 4 and math.isfinite(r["final_eval_loss"]), r
        final[variant] = r["final_eval_loss"]
    # Each run trained its own model in its own precision.
    assert "pattern: '*-'" in (out / "runs" / "dense.bf16-s0" / "config.yaml").read_text()
    table = (out / "runs" / "moe.fp8_experts-s0" / "precision_table.txt").read_text().splitlines()
    header, row = table[0].split(), table[1].split()
    assert dict(zip(header[1:], row[1:])) == {"attn_qkv": "bf16", "attn_out": "bf16", "router": "fp32",
                                              "expert_up": "fp8_delayed", "expert_down": "fp8_delayed"}, table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["baseline"] == "dense.bf16" and summary["incomplete"] == []
    compared = {(c["variant"], c["against"]): c for c in summary["comparisons"]}
    assert set(compared) == {("moe.bf16", "dense.bf16"), ("moe.fp8_experts", "dense.bf16"), ("moe.fp8_experts", "moe.bf16")}
    for (variant, against), c in compared.items():
        assert c["n"] == 1 and c["low"] is None and c["tokens"] == 4 * 128
        assert math.isclose(c["mean"], final[variant] / final[against] - 1, rel_tol=1e-9, abs_tol=1e-15)
    assert "moe.fp8_experts vs moe.bf16" in run.stdout
    models = summary["models"]
    assert models["moe"]["matmul_params"] > 1.5 * models["moe"]["active_matmul_params"]
    assert math.isclose(models["moe"]["flops_per_token"], models["dense"]["flops_per_token"], rel_tol=0.02)
    # --report rebuilds the comparisons from the results alone.
    (out / "summary.json").unlink()
    assert _load_benchmark().main(["--report", str(out), "--baseline", "dense.bf16"]) == 0
    assert json.loads((out / "summary.json").read_text())["comparisons"] == summary["comparisons"]
