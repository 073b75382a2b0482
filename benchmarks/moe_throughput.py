"""The grouped expert GEMM on its own: TFLOP/s of the experts' grouped GEMMs for a config's
expert shapes (fprop, dgrad and wgrad of w_up and w_down, through each recipe's grouped form) on
each kernel (``--gemm``: XLA's ``jax.lax.ragged_dot`` and the Mosaic GPU kernels,
maxfp4.kernels.grouped_gemm) against the device's peak, beside one dense GEMM of the same FLOPs.
Tokens are routed uniformly at random (top_k of experts), as a balanced router sends them.

    python benchmarks/moe_throughput.py configs/moe-1b-active.yaml --recipes bf16 fp8_current fp8_delayed \\
        --gemm xla mosaic [--tokens 16384 --iters 20 --json moe_gemm.json]

Whole-model rows (tokens/s and MFU on active FLOPs, mesh.expert=1 against mesh.expert=N) come
from benchmarks/train_throughput.py with the MoE configs (docs/MOE.md lists the commands).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxfp4.config import load_config
from maxfp4.metrics import device_peaks
from maxfp4.model.moe import expert_ffn
from maxfp4.precision import LayerPrecision, resolve_policy


def _time(fn, *args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def measure(cfg, recipe: str, gemm: str, tokens: int, iters: int) -> dict:
    moe, d = cfg.model.moe, cfg.model.d_model
    gates = 2 if cfg.model.mlp == "swiglu" else 1
    policy = resolve_policy(load_config(None, [f"precision.default={recipe}"]).precision, 1)
    scales = {c: jnp.ones((3,), jnp.float32) for c in ("expert_up", "expert_down")}
    lp = LayerPrecision(policy, 0, scales, jax.random.key(0))
    k = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(k[0], (tokens * moe.top_k, d), jnp.bfloat16)
    # Rows already sorted by expert (the exchange sorts them, maxfp4.parallel.expert): group sizes
    # of a uniform random routing.
    experts = jnp.sort(jax.random.randint(k[1], (tokens * moe.top_k,), 0, moe.experts))
    sizes = jnp.bincount(experts, length=moe.experts).astype(jnp.int32)
    w_up = 0.02 * jax.random.normal(k[2], (moe.experts, d, moe.d_ff, gates))
    w_down = 0.02 * jax.random.normal(k[3], (moe.experts, moe.d_ff, d))

    def loss(x, w_up, w_down):
        return jnp.sum(expert_ffn(x, sizes, w_up, w_down, lp, cfg.model.mlp, gemm).astype(jnp.float32))

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    seconds = _time(step, x, w_up, w_down, iters=iters)
    flops = 6.0 * tokens * moe.top_k * d * moe.d_ff * (gates + 1)  # fprop + dgrad + wgrad, both GEMMs
    m = tokens * moe.top_k
    a = jax.random.normal(k[0], (m, d), jnp.bfloat16)
    b = jax.random.normal(k[2], (d, moe.d_ff * (gates + 1)), jnp.bfloat16)
    dense = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
    dense_s = _time(dense, a, b, iters=iters)
    peaks = device_peaks(jax.devices()[0]) or {}
    tflops = flops / seconds / 1e12
    return {"recipe": recipe, "gemm": gemm, "tokens": tokens, "experts": moe.experts, "top_k": moe.top_k, "d_model": d,
            "d_ff": moe.d_ff, "grouped_ms": 1e3 * seconds, "grouped_tflops": tflops,
            "dense_fprop_tflops": 2.0 * m * d * moe.d_ff * (gates + 1) / dense_s / 1e12,
            "share_of_bf16_peak": tflops / peaks["bf16"] if "bf16" in peaks else None,
            "device": jax.devices()[0].device_kind}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--recipes", nargs="+", default=["bf16", "fp8_current", "fp8_delayed"])
    parser.add_argument("--gemm", nargs="+", default=["xla", "mosaic"], choices=["xla", "mosaic"])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    cfg = load_config(args.config)
    rows = [measure(cfg, r, g, args.tokens, args.iters) for g in args.gemm for r in args.recipes]
    print(f"{'recipe':14s} {'gemm':7s} {'ms':>9s} {'TFLOP/s':>9s} {'dense fprop':>12s} {'of BF16 peak':>13s}")
    for r in rows:
        share = "-" if r["share_of_bf16_peak"] is None else f"{100 * r['share_of_bf16_peak']:.1f}%"
        print(f"{r['recipe']:14s} {r['gemm']:7s} {r['grouped_ms']:9.2f} {r['grouped_tflops']:9.1f} {r['dense_fprop_tflops']:12.1f} "
              f"{share:>13s}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
