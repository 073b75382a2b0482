"""What FP8 accumulation costs: each FP8 GEMM of a linear layer (fprop, dgrad, wgrad) at the layer
shapes of dense-1p3b and Llama-3-8B, with cuBLASLt's fast accumulation and with the precise
(split) one, then one whole FP8 train step of dense-1p3b with the backward GEMMs fast (all fast)
and precise (the default, as Transformer Engine). Each GEMM is the recipes' own
(``recipes.fp8_gemm_tn`` on quantized operands with per-tensor scales), jitted with the
trainer's XLA options, timed as the median of ``--iters`` calls after a warm-up; the line of
each also shows the fast-accumulation field XLA put in the compiled cuBLASLt call, so the run is
the evidence of what the option does. Prints tables, writes JSON:

    PYTHONPATH=$PWD python benchmarks/fp8_accumulation.py [--iters 20] [--step-blocks 24]
        [--no-step] [--json fp8_accumulation.json]

Tokens (M): dense-1p3b's step (8 x 2048 = 16384, one GPU); Llama-3-8B's 8192 (one sequence,
what each GPU of its default 8-GPU FSDP mesh computes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# The whole-step runs are child processes on the same GPU: this process must not hold the GPU's
# memory (JAX's default preallocates 75% of it) while they run.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp

from timing import median_ms

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {"dense-1p3b": ("configs/dense-1p3b.yaml", 16384), "llama3-8b": ("configs/llama3-8b.yaml", 8192)}
CLASSES = ("attn_qkv", "attn_out", "mlp_up", "mlp_down")
ALL_FAST = "precision.recipes.fp8_delayed.fast_accumulation={forward: true, backward: true}"


def gemm_operands(gemm: str, m: int, k: int, n: int):
    """(a, sa, b, sb, out dtype) of one GEMM of a [M, K] x [K, N] layer, in the layouts the
    recipes hand to ``fp8_gemm_tn`` (both operands contracting on their last axis)."""
    from maxfp4.precision import formats as F

    keys = jax.random.split(jax.random.key(0), 2)
    e4m3, e5m2 = F.FP8_E4M3, F.FP8_E5M2
    s = jnp.float32(100.0)  # not a power of two: the recipes' BF16-output form with FP32 scales

    def q(key, shape, dtype):
        return jax.jit(lambda k: F.quantize_fp8(jax.random.normal(k, shape, jnp.float32), s, dtype))(key)

    if gemm == "fprop":  # X[M,K] . W^T[N,K]
        return q(keys[0], (m, k), e4m3), s, q(keys[1], (n, k), e4m3), s, jnp.bfloat16
    if gemm == "dgrad":  # dY[M,N] . W[K,N]
        return q(keys[0], (m, n), e5m2), s, q(keys[1], (k, n), e4m3), s, jnp.bfloat16
    return q(keys[0], (k, m), e4m3), s, q(keys[1], (n, m), e5m2), s, jnp.float32  # wgrad: X^T[K,M] . dY^T[N,M]


def time_gemm(gemm: str, m: int, k: int, n: int, fast: bool, iters: int) -> dict:
    from maxfp4.compiler import compiler_options, fp8_gemms
    from maxfp4.precision.recipes.fp8 import fp8_gemm_tn

    a, sa, b, sb, out = gemm_operands(gemm, m, k, n)
    fn = jax.jit(lambda a, b, sa, sb: fp8_gemm_tn(a, sa, b, sb, out, fast_accumulation=fast),
                 compiler_options=compiler_options(jax.devices()[0].platform))
    found = fp8_gemms(fn.lower(a, b, sa, sb).compile().as_text())
    ms = median_ms(fn, a, b, sa, sb, iters=iters)
    return {"ms": ms, "tflops": 2 * m * k * n / ms / 1e9,
            "cublaslt_fp8": len(found) == 1,
            "precision_config": found[0]["precision_config"] if found else None,
            "fast_accumulation_in_hlo": found[0]["fast_accumulation"] if found else None}


def gemm_rows(iters: int) -> list[dict]:
    from maxfp4.config import load_config
    from maxfp4.model_spec import model_spec

    rows = []
    for model, (config, tokens) in MODELS.items():
        shapes = model_spec(load_config(os.path.join(REPO, config)).model).linear_shapes()
        for cls in CLASSES:
            k, n = shapes[cls]
            for gemm in ("fprop", "dgrad", "wgrad"):
                row = {"model": model, "class": cls, "gemm": gemm, "m": tokens, "k": k, "n": n}
                for mode, fast in (("fast", True), ("precise", False)):
                    row[mode] = time_gemm(gemm, tokens, k, n, fast, iters)
                rows.append(row)
                print(format_gemm_row(row), flush=True)
    return rows


def _field(r: dict) -> str:
    if not r["cublaslt_fp8"]:
        return "NOT a cuBLASLt FP8 GEMM"
    p = r["precision_config"]
    precisions = "/".join(p.get("operand_precision", []))
    return f"{precisions} {p.get('algorithm', '')} -> fast={r['fast_accumulation_in_hlo']}"


GEMM_HEAD = (f"{'model':<11}{'class':<9}{'gemm':<6}{'M x K x N':>20}{'fast ms':>9}{'TFLOP/s':>8}{'prec ms':>9}"
             f"{'TFLOP/s':>8}{'prec/fast':>10}  HLO field: fast | precise")


def format_gemm_row(r: dict) -> str:
    f, p = r["fast"], r["precise"]
    dims = f"{r['m']}x{r['k']}x{r['n']}"
    return (f"{r['model']:<11}{r['class']:<9}{r['gemm']:<6}{dims:>20}{f['ms']:>9.3f}"
            f"{f['tflops']:>8.0f}{p['ms']:>9.3f}{p['tflops']:>8.0f}{p['ms'] / f['ms']:>10.3f}  "
            f"{_field(f)} | {_field(p)}")


def layer_summary(rows: list[dict]) -> list[str]:
    """Per model: the three GEMMs of all four layer classes, backward fast against precise."""
    lines = []
    for model in MODELS:
        mine = [r for r in rows if r["model"] == model]
        if not mine:
            continue
        fwd = sum(r["fast"]["ms"] for r in mine if r["gemm"] == "fprop")
        bwd_fast = sum(r["fast"]["ms"] for r in mine if r["gemm"] != "fprop")
        bwd_precise = sum(r["precise"]["ms"] for r in mine if r["gemm"] != "fprop")
        fast, precise = fwd + bwd_fast, fwd + bwd_precise
        lines.append(f"{model}: one block's FP8 GEMMs {fast:.3f} ms with fast backward, "
                     f"{precise:.3f} ms with precise backward (x{precise / fast:.3f})")
    return lines


def step_rows(blocks: int, steps: int, warmup: int, timeout: float) -> list[dict]:
    from train_throughput import run_child

    args = ["configs/dense-1p3b.yaml", "configs/precision/fp8.yaml", f"model.n_layers={blocks}"]
    out = []
    for label, extra in (("backward precise (default)", []), ("backward fast", [ALL_FAST])):
        r = run_child(f"dense-1p3b fp8 {blocks} blocks, {label}", args + extra, steps, warmup, timeout)
        out.append(r)
        print(f"{r['label']}: " + (r["error"] if "error" in r else f"{1e3 * r['step_time_s']:.1f} ms, "
                                   f"MFU {100 * (r['mfu'] or 0):.1f}%"), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="timed calls per GEMM (median)")
    parser.add_argument("--step-blocks", type=int, default=24, help="blocks of the dense-1p3b train step")
    parser.add_argument("--steps", type=int, default=10, help="timed train steps after the warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="untimed train steps (the first compiles)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per train-step run")
    parser.add_argument("--no-step", action="store_true", help="GEMMs only")
    parser.add_argument("--json", default="fp8_accumulation.json", help="write the results here")
    ns = parser.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}", flush=True)
    print(GEMM_HEAD, flush=True)
    rows = gemm_rows(ns.iters)
    summary = layer_summary(rows)
    print("\n" + "\n".join(summary), flush=True)
    steps = [] if ns.no_step else step_rows(ns.step_blocks, ns.steps, ns.warmup, ns.timeout)
    if steps and all("error" not in s for s in steps):
        precise, fast = steps
        print(f"dense-1p3b FP8 step ({ns.step_blocks} blocks): precise backward {1e3 * precise['step_time_s']:.1f} ms, "
              f"fast backward {1e3 * fast['step_time_s']:.1f} ms "
              f"(x{precise['step_time_s'] / fast['step_time_s']:.3f})")
    with open(ns.json, "w", encoding="utf-8") as fh:
        json.dump({"device": jax.devices()[0].device_kind, "gemms": rows, "summary": summary, "steps": steps},
                  fh, indent=2)
    ok = all(r[m]["cublaslt_fp8"] for r in rows for m in ("fast", "precise"))
    ok = ok and all(r["fast"]["fast_accumulation_in_hlo"] and not r["precise"]["fast_accumulation_in_hlo"]
                    for r in rows)
    if not ok:
        print("error: some GEMM was not a cuBLASLt FP8 GEMM, or its fast-accumulation field is not what was asked")
    return 0 if ok and all("error" not in s for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
