"""The planner's step time and memory against every whole-model step measured in
docs/PERFORMANCE.md, and its days against published runs.

    python benchmarks/plan_calibration.py [--json OUT.json]

Prints two tables (no device needed: the planner is a model) and exits 0; the goal is every
current measured step within 15% (memory: every current peak within 10%, or a stated
reason in MEMORY_UNEXPLAINED). Rows marked stale ran code that has since changed and are
shown for the record, not counted against the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxfp4.plan import command as plan, context as plan_context, cost as plan_model  # noqa: E402
from maxfp4.config import load_config  # noqa: E402
from maxfp4.parallel.mesh import resolve_mesh_shape  # noqa: E402
from maxfp4.plan.stages import PlanMesh  # noqa: E402

GOAL = 0.15
LLAMA = "configs/llama3-8b.yaml"
NO_PREFLIGHT = ["resilience.preflight=false"]
# docs/PERFORMANCE.md, "Pipeline stages": dense-1p3b at pipeline=2 and at fsdp=2 on two H200s
STAGES = ["train.remat=full", "mesh.data=1", "data.global_batch=16"]
XLA_PAIR = ["model.attention=xla", "data.seq_len=1024", *STAGES]
NEMOTRON = "configs/nemotron-h-8b.yaml"
PIPE_P2F2 = ["mesh.data=1", "data.global_batch=8", "mesh.pipeline=2", "mesh.fsdp=2", "train.microbatches=4"]
PIPE_P4 = ["mesh.data=1", "data.global_batch=8", "mesh.pipeline=4", "mesh.fsdp=1", "train.microbatches=8"]
# (label, config, overrides, GPUs, GPU, precision recipe, measured step ms, measured peak GiB or None, stale)
MEASURED = [
    # One H200, configs as committed (unrolled, no remat, 8 x 2048)
    ("dense-1p3b bf16", "configs/dense-1p3b.yaml", [], 1, "h200", "bf16", 275.0, 50.8, False),
    ("dense-1p3b fp8", "configs/dense-1p3b.yaml", [], 1, "h200", "fp8", 209.4, 46.9, False),
    ("dense-1p3b fp8-pow2", "configs/dense-1p3b.yaml", [], 1, "h200", "fp8", 221.8, 55.1, False),
    ("dense-1p3b nvfp4 (before the RHT kernels)", "configs/dense-1p3b.yaml", [], 1, "h200", "nvfp4", 455.6, None, True),
    ("hybrid-1b bf16", "configs/hybrid-1b.yaml", [], 1, "h200", "bf16", 208.7, 48.1, False),
    ("hybrid-1b fp8", "configs/hybrid-1b.yaml", [], 1, "h200", "fp8", 164.0, 43.1, False),
    ("hybrid-1b fp8-pow2", "configs/hybrid-1b.yaml", [], 1, "h200", "fp8", 162.7, None, False),
    ("hybrid-1b fp8 save_gemm", "configs/hybrid-1b.yaml", ["train.remat=save_gemm"], 1, "h200", "fp8", 178.3, 31.9, False),
    ("mamba2-1p3b bf16", "configs/mamba2-1p3b.yaml", [], 1, "h200", "bf16", 394.4, 93.6, False),
    ("mamba2-1p3b fp8", "configs/mamba2-1p3b.yaml", [], 1, "h200", "fp8", 325.9, 87.9, False),
    ("mamba2-1p3b fp8-pow2", "configs/mamba2-1p3b.yaml", [], 1, "h200", "fp8", 329.4, 87.9, False),
    ("mamba2-1p3b fp8 scanned save_gemm", "configs/mamba2-1p3b.yaml",
     ["train.scan_layers=true", "train.remat=save_gemm"], 1, "h200", "fp8", 400.3, 45.7, False),
    # One H100
    ("dense-1p3b bf16", "configs/dense-1p3b.yaml", [], 1, "h100", "bf16", 300.7, None, False),
    ("dense-1p3b fp8 (FP32 GEMM outputs then)", "configs/dense-1p3b.yaml", [], 1, "h100", "fp8", 263.2, 50.1, True),
    ("dense-1p3b fp8-pow2", "configs/dense-1p3b.yaml", [], 1, "h100", "fp8", 243.5, 50.2, False),
    ("dense-1p3b nvfp4", "configs/dense-1p3b.yaml", [], 1, "h100", "nvfp4", 400.0, None, False),
    ("hybrid-1b bf16", "configs/hybrid-1b.yaml", [], 1, "h100", "bf16", 221.9, 48.76, False),
    ("hybrid-1b fp8-pow2", "configs/hybrid-1b.yaml", [], 1, "h100", "fp8", 180.2, 44.88, False),
    ("hybrid-1b fp8 scanned save_gemm (before the Mamba-2 kernels)", "configs/hybrid-1b.yaml",
     ["train.scan_layers=true", "train.remat=save_gemm"], 1, "h100", "fp8", 355.2, 50.4, True),
    ("mamba2-1p3b bf16 scanned save_gemm (before the Mamba-2 kernels)", "configs/mamba2-1p3b.yaml",
     ["train.scan_layers=true", "train.remat=save_gemm"], 1, "h100", "bf16", 749.0, None, True),
    # Several GPUs, one process, FSDP
    ("llama3-8b B=4 save_gemm bf16", LLAMA, ["data.global_batch=4", "train.remat=save_gemm"], 2, "h200", "bf16", 1528.4, 106.6, False),
    ("llama3-8b B=4 save_gemm fp8", LLAMA, ["data.global_batch=4", "train.remat=save_gemm"], 2, "h200", "fp8", 1048.8, 107.3, False),
    ("llama3-8b B=4 save_gemm_io fp8", LLAMA, ["data.global_batch=4", "train.remat=save_gemm_io"], 2, "h200", "fp8", 1057.3, 113.4, False),
    ("llama3-8b B=2 no remat bf16", LLAMA, ["data.global_batch=2"], 2, "h200", "bf16", 812.4, 111.0, False),
    ("llama3-8b B=2 no remat fp8", LLAMA, ["data.global_batch=2"], 2, "h200", "fp8", 589.1, 100.1, False),
    ("llama3-8b B=2 full remat bf16", LLAMA, ["data.global_batch=2", "train.remat=full"], 2, "h100", "bf16", 1111.8, 71.8, False),
    ("llama3-8b 8 blocks B=8 full bf16", LLAMA, ["model.n_layers=8", "data.global_batch=8", "train.remat=full"], 2, "h100", "bf16", 1092.4, 52.5, False),
    ("llama3-8b 8 blocks B=8 full fp8", LLAMA, ["model.n_layers=8", "data.global_batch=8", "train.remat=full"], 2, "h100", "fp8", 923.0, 51.5, False),
    ("llama3-8b 8 blocks B=8 save_gemm x4 fp8", LLAMA,
     ["model.n_layers=8", "data.global_batch=8", "train.remat=save_gemm", "train.microbatches=4"], 2, "h100", "fp8", 873.1, 38.7, False),
    ("dense-1p3b fsdp=2 B=16 bf16", "configs/dense-1p3b.yaml", ["mesh.data=1", "mesh.fsdp=2", "data.global_batch=16"], 2, "h200", "bf16", 308.7, 56.3, True),
    ("dense-1p3b 6 blocks data=2 B=16 bf16", "configs/dense-1p3b.yaml",
     ["model.n_layers=6", "mesh.data=2", "data.global_batch=16"], 2, "h100", "bf16", 120.1, 24.6, False),
    ("dense-1p3b 6 blocks data=2 B=16 nvfp4", "configs/dense-1p3b.yaml",
     ["model.n_layers=6", "mesh.data=2", "data.global_batch=16"], 2, "h100", "nvfp4", 147.8, 25.1, False),
    ("hybrid-1b fsdp=2 B=16 save_gemm bf16 (before the Mamba-2 kernels)", "configs/hybrid-1b.yaml",
     ["mesh.data=1", "mesh.fsdp=2", "data.global_batch=16", "train.remat=save_gemm", "train.scan_layers=true"],
     2, "h200", "bf16", 411.1, 42.9, True),
    # One process per GPU (benchmarks/per_gpu_processes.sh), 2026-11-27: two and four H200s
    ("llama3-8b fsdp=2 B=4 save_gemm bf16", LLAMA, ["data.global_batch=4", "train.remat=save_gemm"], 2, "h200", "bf16", 1565.1, None, False),
    ("llama3-8b fsdp=2 B=4 save_gemm fp8", LLAMA, ["data.global_batch=4", "train.remat=save_gemm"], 2, "h200", "fp8", 1101.5, None, False),
    ("llama3-8b fsdp=4 B=8 save_gemm bf16", LLAMA, ["data.global_batch=8", "train.remat=save_gemm"], 4, "h200", "bf16", 1571.1, None, False),
    ("llama3-8b fsdp=4 B=8 save_gemm fp8", LLAMA, ["data.global_batch=8", "train.remat=save_gemm"], 4, "h200", "fp8", 1087.3, None, False),
    ("llama3-8b data=2 fsdp=2 B=8 save_gemm bf16", LLAMA,
     ["data.global_batch=8", "train.remat=save_gemm", "mesh.data=2", "mesh.fsdp=2"], 4, "h200", "bf16", 1603.2, None, False),
    ("llama3-8b data=2 fsdp=2 B=8 save_gemm fp8", LLAMA,
     ["data.global_batch=8", "train.remat=save_gemm", "mesh.data=2", "mesh.fsdp=2"], 4, "h200", "fp8", 1150.5, None, False),
    ("llama3-8b fsdp=2 tensor=2 B=8 save_gemm bf16", LLAMA,
     ["data.global_batch=8", "train.remat=save_gemm", "mesh.fsdp=2", "mesh.tensor=2"], 4, "h200", "bf16", 1619.5, None, False),
    ("llama3-8b fsdp=2 tensor=2 B=8 save_gemm fp8", LLAMA,
     ["data.global_batch=8", "train.remat=save_gemm", "mesh.fsdp=2", "mesh.tensor=2"], 4, "h200", "fp8", 1203.2, None, False),
    ("nemotron-h-8b fsdp=2 B=2 full bf16", "configs/nemotron-h-8b.yaml", ["data.global_batch=2"], 2, "h200", "bf16", 967.5, None, False),
    ("nemotron-h-8b fsdp=2 B=2 full fp8", "configs/nemotron-h-8b.yaml", ["data.global_batch=2"], 2, "h200", "fp8", 679.7, None, False),
    ("nemotron-h-8b fsdp=4 B=4 full bf16", "configs/nemotron-h-8b.yaml", ["data.global_batch=4"], 4, "h200", "bf16", 941.6, None, False),
    ("nemotron-h-8b fsdp=4 B=4 full fp8", "configs/nemotron-h-8b.yaml", ["data.global_batch=4"], 4, "h200", "fp8", 664.8, None, False),
    # Scale models on one H200 (one sequence of 8192, no remat)
    ("llama widths 6 blocks V=24064 bf16", LLAMA, ["model.n_layers=6", "model.vocab_size=24064", "data.global_batch=1"], 1, "h200", "bf16", 141.3, None, False),
    ("llama widths 6 blocks V=24064 nvfp4", LLAMA, ["model.n_layers=6", "model.vocab_size=24064", "data.global_batch=1"], 1, "h200", "nvfp4", 167.7, None, False),
    ("llama widths 12 blocks V=48128 bf16", LLAMA, ["model.n_layers=12", "model.vocab_size=48128", "data.global_batch=1"], 1, "h200", "bf16", 285.1, None, False),
    ("llama widths 12 blocks V=48128 nvfp4", LLAMA, ["model.n_layers=12", "model.vocab_size=48128", "data.global_batch=1"], 1, "h200", "nvfp4", 350.5, None, False),
    ("nemotron-h-8b 7 blocks 2 x 8192 full bf16", "configs/nemotron-h-8b.yaml",
     ["model.pattern=M-M-M*-", "data.global_batch=2"], 1, "h200", "bf16", 338.3, 50.1, False),
    # XLA's attention (model.attention=xla), one process a GPU, 2026-11-28: 16 x 1024, full remat;
    # the one step that fits XLA_ATTENTION_H200_TFLOPS
    ("dense-1p3b fsdp=2 B=16 T=1024 full xla-attention bf16", "configs/dense-1p3b.yaml",
     XLA_PAIR + ["mesh.fsdp=2"], 2, "h200", "bf16", 303.1, None, False),
    # Pipeline stages and context ranks on cuDNN's attention (model.attention=auto), one process a
    # GPU, 2026-11-28: 16 sequences, full remat (docs/PERFORMANCE.md, "Pipeline stages")
    ("dense-1p3b fsdp=2 B=16 T=2048 full bf16", "configs/dense-1p3b.yaml",
     STAGES + ["data.seq_len=2048", "mesh.fsdp=2"], 2, "h200", "bf16", 332.3, None, False),
    ("dense-1p3b pipeline=2 x8 B=16 T=1024 full bf16", "configs/dense-1p3b.yaml",
     STAGES + ["data.seq_len=1024", "mesh.pipeline=2", "train.microbatches=8"], 2, "h200", "bf16", 278.0, None, False),
    ("dense-1p3b pipeline=2 x8 B=16 T=2048 full bf16", "configs/dense-1p3b.yaml",
     STAGES + ["data.seq_len=2048", "mesh.pipeline=2", "train.microbatches=8"], 2, "h200", "bf16", 503.5, None, False),
    ("dense-1p3b pipeline=2 repeats=2 x8 B=16 T=2048 full bf16", "configs/dense-1p3b.yaml",
     STAGES + ["data.seq_len=2048", "mesh.pipeline=2", "mesh.pipeline_repeats=2", "train.microbatches=8"],
     2, "h200", "bf16", 551.7, None, False),
    # Pipeline stages of the 8B models on four H200s, one process a GPU, 2026-11-29: 8 x 8,192
    # tokens; the save_gemm rows ran at the memory limit with the head inside the ticks (since
    # moved after them; docs/PERFORMANCE.md), so they are stale
    ("llama3-8b pipeline=2 fsdp=2 x4 B=8 save_gemm bf16 (head in the ticks)", LLAMA, PIPE_P2F2 + ["train.remat=save_gemm"],
     4, "h200", "bf16", 2979.5, None, True),
    ("llama3-8b pipeline=2 fsdp=2 x4 B=8 save_gemm fp8 (head in the ticks)", LLAMA, PIPE_P2F2 + ["train.remat=save_gemm"],
     4, "h200", "fp8", 2080.2, None, True),
    ("llama3-8b pipeline=4 x8 B=8 full bf16", LLAMA, PIPE_P4 + ["train.remat=full"], 4, "h200", "bf16", 2936.0, None, False),
    ("llama3-8b pipeline=4 x8 B=8 full fp8", LLAMA, PIPE_P4 + ["train.remat=full"], 4, "h200", "fp8", 2179.2, None, False),
    ("nemotron-h-8b pipeline=2 fsdp=2 x4 B=8 full bf16", NEMOTRON, PIPE_P2F2 + ["train.remat=full"], 4, "h200", "bf16",
     2488.0, None, False),
    ("nemotron-h-8b pipeline=2 fsdp=2 x4 B=8 full fp8", NEMOTRON, PIPE_P2F2 + ["train.remat=full"], 4, "h200", "fp8",
     1774.2, None, False),
    ("nemotron-h-8b pipeline=4 x8 B=8 full bf16", NEMOTRON, PIPE_P4 + ["train.remat=full"], 4, "h200", "bf16", 2619.9, None, False),
    ("nemotron-h-8b pipeline=4 x8 B=8 full fp8", NEMOTRON, PIPE_P4 + ["train.remat=full"], 4, "h200", "fp8", 1995.8, None, False),
]
# (label, config, overrides, GPUs, GPU, precision, measured step ms): context parallelism, priced
# by maxfp4.plan.context (the proxy of T/C tokens on gpus/C GPUs, plus the split's attention and
# collectives); cuDNN's kernels per chunk merged by log-sum-exp, 2026-11-28. The last field says
# whether the row counts towards the goal.
MEASURED_CONTEXT = [
    ("dense-1p3b context=2 B=2 T=16384 full bf16", "configs/dense-1p3b.yaml",
     STAGES[:-1] + ["data.seq_len=16384", "data.global_batch=2", "mesh.context=2"], 2, "h200", "bf16", 700.3, True),
    ("dense-1p3b context=2 B=1 T=32768 full bf16", "configs/dense-1p3b.yaml",
     STAGES[:-1] + ["data.seq_len=32768", "data.global_batch=1", "mesh.context=2"], 2, "h200", "bf16", 1076.2, True),
    # The 8B models' long-sequence configs, one process a GPU, 2026-11-29 (one sequence, full remat)
    ("llama3-8b context=2 T=32768 full bf16", "configs/llama3-8b-64k.yaml", ["data.seq_len=32768", "mesh.context=2"],
     2, "h200", "bf16", 3241.6, True),
    ("llama3-8b context=4 T=65536 full bf16", "configs/llama3-8b-64k.yaml", [], 4, "h200", "bf16", 4555.7, True),
    ("llama3-8b context=4 T=65536 full fp8", "configs/llama3-8b-64k.yaml", [], 4, "h200", "fp8", 3990.1, True),
    ("nemotron-h-8b context=2 T=32768 full bf16", "configs/nemotron-h-8b-64k.yaml", ["data.seq_len=32768", "mesh.context=2"],
     2, "h200", "bf16", 2309.6, True),
    ("nemotron-h-8b context=4 T=65536 full bf16", "configs/nemotron-h-8b-64k.yaml", [], 4, "h200", "bf16", 2478.3, True),
    ("nemotron-h-8b context=4 T=65536 full fp8", "configs/nemotron-h-8b-64k.yaml", [], 4, "h200", "fp8", 1938.6, True),
]
GIB = 2**30
# The goal for the planner's memory (= the preflight's estimate) against every measured peak.
MEMORY_GOAL = 0.10
# (label, GPU) of the current rows whose peak the memory model misses by more than MEMORY_GOAL,
# and why (docs/PLANNING.md, "Memory"); tests/test_plan.py keeps them within MEMORY_BOUND_UNEXPLAINED.
SAVE_GEMM_OVER = ("save_gemm: every kept GEMM output and the recomputed block are counted at once; "
                  "XLA reuses part of them in the backward pass (not yet split by a profile)")
FULL_REMAT_UNDER = ("full remat at d_model 4,096: ~9 GB held that the model does not name (not yet "
                    "split by a profile)")
MEMORY_UNEXPLAINED = {
    ("dense-1p3b bf16", "h200"): "the same step's peak varies 50-59 GB over runs (its FP8 rows); the model sits in the middle",
    ("hybrid-1b fp8 save_gemm", "h200"): SAVE_GEMM_OVER,
    ("mamba2-1p3b fp8 scanned save_gemm", "h200"): SAVE_GEMM_OVER,
    ("llama3-8b B=4 save_gemm bf16", "h200"): SAVE_GEMM_OVER,
    ("llama3-8b B=4 save_gemm_io fp8", "h200"): SAVE_GEMM_OVER,
    ("llama3-8b 8 blocks B=8 full bf16", "h100"): FULL_REMAT_UNDER,
    ("llama3-8b 8 blocks B=8 full fp8", "h100"): FULL_REMAT_UNDER,
    ("nemotron-h-8b 7 blocks 2 x 8192 full bf16", "h200"): FULL_REMAT_UNDER,
}
MEMORY_BOUND_UNEXPLAINED = 0.20
# Current step rows the model misses by more than GOAL, and why; tests/test_plan_pipeline.py keeps
# them within STEP_BOUND_UNEXPLAINED.
HYBRID_LONG_UNDER = ("the hybrid at 16,384-32,768 tokens a rank: ~300 ms a step more than its 8,192-token "
                     "proxy and the split's collectives are charged (not yet split by a profile)")
STEP_UNEXPLAINED = {
    "nemotron-h-8b context=2 T=32768 full bf16": HYBRID_LONG_UNDER,
    "nemotron-h-8b context=4 T=65536 full fp8": HYBRID_LONG_UNDER,
}
STEP_BOUND_UNEXPLAINED = 0.20

LLAMA70 = "configs/llama3-70b.yaml"
# Llama 3 405B: the 70B config with the 405B's widths (Meta 2024, table 3).
B405 = ["model.d_model=16384", "model.n_layers=126", "model.n_heads=128", "model.n_kv_heads=8", "model.d_ff=53248"]
# 3.4e24 model FLOPs of the 70B shape at 449.2 GFLOP a token (seq 8192): 7.57e12 tokens.
TALK_TOKENS = 7.57e12
# (run, config, overrides, GPUs, precision, tokens, published days or None, published GPU-hours or None, source)
PUBLISHED = [
    ("Llama 3 8B", LLAMA, [], 1024, "bf16", 15e12, None, 1.46e6, "Meta 2024: 1.46M H100-hours"),
    ("Llama 3 70B", LLAMA70, [], 4096, "bf16", 15e12, None, 7.0e6, "Meta 2024: 7.0M H100-hours"),
    ("Llama 3 405B", LLAMA70, B405, 16384, "bf16", 15.6e12, None, 30.84e6,
     "Meta 2024: 30.84M H100-hours on up to 16,384 H100s, 38-43% MFU"),
    ("Nemotron-H 56B, FP8", "configs/nemotron-h-56b.yaml", [], 6144, "fp8", 20e12, None, None,
     "NVIDIA 2025: 20T tokens in FP8 on 6,144 H100s; duration not published"),
    ("70B shape, 3.4e24 FLOPs, FP8", LLAMA70, [], 1024, "fp8", TALK_TOKENS, 97, None, "FP8 at 10k GPUs talk: 97 days"),
    ("70B shape, 3.4e24 FLOPs, FP8", LLAMA70, [], 5120, "fp8", TALK_TOKENS, 22, None, "the talk: 22 days"),
    ("70B shape, 3.4e24 FLOPs, FP8", LLAMA70, [], 10240, "fp8", TALK_TOKENS, 13, None, "the talk: 13 days"),
]


def calibration_rows() -> list[dict]:
    rows = []
    for label, path, overrides, gpus, gpu, precision, step_ms, peak_gib, stale in MEASURED:
        cfg = load_config(path, overrides)
        mesh = PlanMesh.of(resolve_mesh_shape(cfg.mesh, gpus), cfg.mesh)
        row = plan_model.project(cfg, mesh, gpu, precision)
        predicted = row["step_time_s"] * 1e3
        rows.append({"run": label, "gpus": f"{gpus} x {gpu.upper()}", "precision": precision,
                     "measured_ms": step_ms, "predicted_ms": predicted, "error": predicted / step_ms - 1,
                     "measured_peak_gb": peak_gib * GIB / 1e9 if peak_gib else None,
                     "predicted_memory_gb": row["memory_per_device_gb"], "stale": stale,
                     "memory_unexplained": MEMORY_UNEXPLAINED.get((label, gpu))})
    for label, path, overrides, gpus, gpu, precision, step_ms, counted in MEASURED_CONTEXT:
        cfg = load_config(path, overrides)
        row = next(r for r in plan_context.plan_rows(cfg, gpus, gpu, 1e9, None, None, plan_model.GPUS_PER_NODE,
                                                     plan_model.GOODPUT) if r["precision"] == precision)
        predicted = row["step_time_s"] * 1e3
        rows.append({"run": label, "gpus": f"{gpus} x {gpu.upper()}", "precision": precision,
                     "measured_ms": step_ms, "predicted_ms": predicted, "error": predicted / step_ms - 1,
                     "measured_peak_gb": None, "predicted_memory_gb": row["memory_per_device_gb"], "stale": False,
                     "unmodelled": not counted})
    return rows


def format_calibration(rows: list[dict]) -> str:
    lines = [f"| run | GPUs | measured ms | planner ms | error | measured peak GB | planner GB |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        peak = f"{r['measured_peak_gb']:.1f}" if r["measured_peak_gb"] else ""
        mark = " (stale)" if r["stale"] else " (not modelled, not counted)" if r.get("unmodelled") else ""
        lines.append(f"| {r['run']}{mark} | {r['gpus']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
                     f"{r['error']:+.0%} | {peak} | {r['predicted_memory_gb']:.1f} |")
    current = [r for r in rows if not r["stale"] and not r.get("unmodelled")]
    within = sum(abs(r["error"]) <= GOAL for r in current)
    worst = max(current, key=lambda r: abs(r["error"]))
    lines.append("")
    lines.append(f"{within} of {len(current)} current rows within {GOAL:.0%}; mean |error| "
                 f"{sum(abs(r['error']) for r in current) / len(current):.1%}; worst {worst['run']} "
                 f"({worst['gpus']}) {worst['error']:+.0%}")
    peaks = [r for r in current if r["measured_peak_gb"]]
    memory_error = [r["predicted_memory_gb"] / r["measured_peak_gb"] - 1 for r in peaks]
    lines.append(f"memory: {sum(abs(e) <= MEMORY_GOAL for e in memory_error)} of {len(peaks)} current peaks within "
                 f"{MEMORY_GOAL:.0%}; {min(memory_error):+.0%} to {max(memory_error):+.0%}")
    return "\n".join(lines)


def published_rows() -> list[dict]:
    rows = []
    for label, path, overrides, gpus, precision, tokens, days, gpu_hours, source in PUBLISHED:
        cfg = load_config(path, overrides)
        r = next(r for r in plan.plan(cfg, gpus, "h100", tokens) if r["precision"] == precision)
        published_hours = gpu_hours or (days * 24 * gpus if days else None)
        flops = r["flops_per_token"] * tokens
        rows.append({"run": label, "gpus": gpus, "precision": precision, "tokens": tokens,
                     "mesh": r["mesh"], "global_batch": r["global_batch"], "mfu": r["mfu"],
                     "days": r["days"], "gpu_hours": r["gpu_hours"], "published_days": days,
                     "published_gpu_hours": published_hours, "source": source,
                     # model FLOPs over the published GPU-hours at the BF16 peak: the MFU the run averaged
                     "published_mfu": flops / (published_hours * 3600 * 989e12) if published_hours else None})
    return rows


def format_published(rows: list[dict]) -> str:
    lines = ["| run | H100s | mesh (d x f x t, x p stages), batch | planner MFU | planner days | planner GPU-hours | "
             "published | published / planner | published MFU |",
             "| --- | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        m = r["mesh"]
        ratio = f"{r['published_gpu_hours'] / r['gpu_hours']:.2f}x" if r["published_gpu_hours"] else ""
        mfu = f"{r['published_mfu']:.0%}" if r["published_mfu"] else ""
        stages = f" x p{m['pipeline']}" if m["pipeline"] > 1 else ""
        lines.append(f"| {r['run']} | {r['gpus']:,} | {m['data']} x {m['fsdp']} x {m['tensor']}{stages}, {r['global_batch']:,} "
                     f"| {r['mfu']:.0%} | {r['days']:.1f} | {r['gpu_hours'] / 1e6:.2f}M | {r['source']} | {ratio} | {mfu} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    rows = calibration_rows()
    print(format_calibration(rows))
    published = published_rows()
    print()
    print(f"Published runs (planner at its default goodput {plan_model.GOODPUT:.0%}, H100):")
    print(format_published(published))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"measured": rows, "published": published}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
