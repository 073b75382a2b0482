"""A linear layer's forward + backward (fprop, dgrad, wgrad) under each precision recipe.

Prints a table (TFLOP/s counting the three GEMMs, speed against the BF16 recipe, FP8 GEMMs
found in the compiled program) and writes JSON. Run on a GPU:

    python benchmarks/precision_matmul.py [--m 8192 --k 8192 --n 8192] [--json out.json]

``--kernels N`` adds each variant's N longest GPU kernels from a profiler trace (names as in
the compiled HLO, with their result shapes), to see where a recipe's time goes.
"""

from __future__ import annotations

import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxfp4.compiler import compiler_options
from maxfp4.precision.registry import RECIPES
from profile_summary import traced_kernel_times

VARIANTS = [
    ("bf16", "bf16", ()),
    ("fp8_delayed", "fp8_delayed", ()),
    ("fp8_current", "fp8_current", ()),
    ("nvfp4", "nvfp4", (("rht", True), ("stochastic_rounding", True), ("weight_2d", True))),
    ("nvfp4 (no RHT, no SR)", "nvfp4", (("rht", False), ("stochastic_rounding", False), ("weight_2d", True))),
    ("nvfp4 (RHT, no SR)", "nvfp4", (("rht", True), ("stochastic_rounding", False), ("weight_2d", True))),
    ("nvfp4 (SR, no RHT)", "nvfp4", (("rht", False), ("stochastic_rounding", True), ("weight_2d", True))),
    ("mxfp8", "mxfp8", ()),
    ("mxfp4", "mxfp4", ()),
    ("fp8_block", "fp8_block", ()),
]


def bench(fn, args, iters: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def top_kernels(fn, args, hlo: str, n: int, reps: int = 5) -> list[tuple[str, float, float, str]]:
    """The n GPU kernels of ``fn`` with the most device time: (name, microseconds a call,
    launches a call, the result shape of the HLO instruction of that name)."""
    totals, counts = traced_kernel_times([lambda: fn(*args)], reps)
    shapes = dict(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+)", hlo, re.M))
    return [(name, us / reps, counts[name] / reps, shapes.get(name, "?")) for name, us in totals.most_common(n)]


def _parse_option(text: str) -> tuple[str, object]:
    key, _, value = text.partition("=")
    return key, {"true": True, "false": False}.get(value.lower(), value)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=8192, help="tokens")
    ap.add_argument("--k", type=int, default=8192, help="input features")
    ap.add_argument("--n", type=int, default=8192, help="output features")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="precision_matmul.json")
    ap.add_argument("--only", default="", help="comma-separated recipe names (bf16 is always run)")
    ap.add_argument("--prng-impl", default=None,
                    help="the PRNG behind stochastic rounding's key (threefry2x32, rbg, unsafe_rbg; default JAX's)")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also print each variant's N longest GPU kernels (device time from a profiler trace)")
    ap.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an XLA option on top of maxfp4.compiler's defaults, e.g. xla_gpu_enable_triton_gemm=true")
    a = ap.parse_args()
    kx, kw, kd = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (a.m, a.k), jnp.bfloat16)
    w = 0.02 * jax.random.normal(kw, (a.k, a.n), jnp.float32)
    dy = 1e-3 * jax.random.normal(kd, (a.m, a.n), jnp.bfloat16)
    scales = jnp.asarray([100.0, 20000.0, 1e7], jnp.float32)
    key = jax.random.key(1, impl=a.prng_impl)
    only = set(filter(None, a.only.split(","))) | {"bf16"} if a.only else None
    flops = 3 * 2.0 * a.m * a.k * a.n
    options = compiler_options(jax.devices()[0].platform, dict(_parse_option(o) for o in a.compiler_option))
    rows, kernels = [], {}
    for label, name, opts in VARIANTS:
        if name not in RECIPES or (only and name not in only):
            continue
        fn = RECIPES[name].dot

        def layer(x, w, dy, scales, key, fn=fn, opts=opts):
            y, vjp = jax.vjp(lambda x, w, s: fn(x, w, opts, s, key), x, w, scales)
            return (y,) + vjp(dy)

        jitted = jax.jit(layer, compiler_options=options)
        hlo = jitted.lower(x, w, dy, scales, key).compile().as_text()
        seconds = bench(jitted, (x, w, dy, scales, key), a.iters)
        rows.append({"recipe": label, "ms": 1e3 * seconds, "tflops": flops / seconds / 1e12,
                     "fp8_gemms": hlo.count("__cublas$lt$matmul$f8")})
        if a.kernels:
            kernels[label] = top_kernels(jitted, (x, w, dy, scales, key), hlo, a.kernels)
    base = next(r for r in rows if r["recipe"] == "bf16")["tflops"]
    device = jax.devices()[0].device_kind
    print(f"linear layer fwd+bwd, M={a.m} K={a.k} N={a.n}, {device}, jax {jax.__version__}, "
          f"PRNG {jax.random.key_impl(key)}")
    print(f"{'recipe':24s} {'ms':>8s} {'TFLOP/s':>9s} {'vs bf16':>8s} {'FP8 GEMMs':>10s}")
    for r in rows:
        r["vs_bf16"] = r["tflops"] / base
        print(f"{r['recipe']:24s} {r['ms']:8.2f} {r['tflops']:9.0f} {r['vs_bf16']:7.2f}x {r['fp8_gemms']:10d}")
    for label, top in kernels.items():
        print(f"\n{label}: longest GPU kernels, us a call (launches a call), result shape")
        for name, us, launches, shape in top:
            print(f"  {us:8.1f} ({launches:g})  {name:40s} {shape}")
    with open(a.json, "w") as fh:
        json.dump({"device": device, "jax": jax.__version__, "shape": [a.m, a.k, a.n], "rows": rows,
                   "kernels": kernels}, fh, indent=1)


if __name__ == "__main__":
    main()
