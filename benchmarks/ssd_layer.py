"""The Mamba-2 SSD core alone: forward + backward time at a model's shapes, against the SSD
matmul FLOPs that maxfp4.metrics charges (training FLOPs per token x tokens).

    python benchmarks/ssd_layer.py [--config configs/mamba2-1p3b.yaml] [--json ssd_layer.json]

One row per variant (``--variants``): implementation (model.mamba.kernels: XLA's chunked form,
or the Pallas kernel), operand precision of the token-length matmuls (model.mamba.ssd_matmul),
chunk size and Triton warps; each row also gives its largest difference from the first row,
output and gradients, relative to that row's largest magnitude.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxfp4.config import load_config
from maxfp4.metrics import ssd_flops_per_token
from maxfp4.model.mamba import dims
from maxfp4.model.ssd import ssd_chunked
from maxfp4.model.ssd_kernel import ssd_fused


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/mamba2-1p3b.yaml")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default="ssd_layer.json")
    ap.add_argument("--variants", default="xla:fp32:128,xla:bf16:128,pallas:bf16:64:4,pallas:bf16:128:8",
                    help="comma-separated IMPL:OPERANDS:CHUNK[:WARPS], IMPL xla or pallas, OPERANDS "
                         "fp32 or bf16; the first is the reference of the diff column")
    a = ap.parse_args()
    cfg = load_config(a.config)
    m = cfg.model
    b, t = cfg.data.global_batch, cfg.data.seq_len
    d = dims(m)
    h, p, g, n = d["H"], d["P"], d["G"], d["N"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, t, h, p)), jnp.bfloat16)
    dt = jnp.asarray(rng.uniform(1e-3, 1e-1, (b, t, h)), jnp.float32)
    A = jnp.asarray(-rng.uniform(1, 16, h), jnp.float32)
    B = jnp.asarray(rng.standard_normal((b, t, g, n)), jnp.bfloat16)
    C = jnp.asarray(rng.standard_normal((b, t, g, n)), jnp.bfloat16)
    ids = jnp.ones((b, t), jnp.int32)
    weight = jnp.asarray(rng.standard_normal((b, t, h, p)), jnp.float32)
    flops = ssd_flops_per_token(m) / m.pattern.count("M") * b * t  # one layer, forward + backward
    print(f"SSD, {a.config}: B={b} T={t} H={h} P={p} G={g} N={n}, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{'variant':<28}{'fwd ms':>9}{'fwd+bwd ms':>12}{'TFLOP/s':>10}{'max rel diff':>14}", flush=True)
    rows, baseline = [], None
    for spec in a.variants.split(","):
        impl, operands, q, warps = (spec.split(":") + ["4"])[:4]
        mdt, q, warps = (None if operands == "fp32" else jnp.bfloat16), int(q), int(warps)

        def forward(x, dt, B, C, impl=impl, mdt=mdt, q=q, warps=warps):
            if impl == "xla":
                return ssd_chunked(x, dt, A, B, C, ids, q, matmul_dtype=mdt)
            return ssd_fused(x, dt, A, B, C, ids, q, matmul_dtype=mdt, num_warps=warps)

        def loss(x, dt, B, C, forward=forward):
            y = forward(x, dt, B, C)
            return jnp.sum(y.astype(jnp.float32) * weight), y

        fwd = jax.jit(forward)
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
        label = spec
        try:
            (_, y), grads = jax.block_until_ready(fn(x, dt, B, C))
            jax.block_until_ready(fwd(x, dt, B, C))
        except Exception as exc:  # a variant that does not compile is reported, not fatal
            rows.append({"variant": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            print(f"{label:<28} failed: {rows[-1]['error']}", flush=True)
            continue
        outs = [np.asarray(v, np.float32) for v in (y, *grads)]
        if baseline is None:
            baseline = outs
        err = max(float(np.max(np.abs(o - r)) / np.max(np.abs(r))) for o, r in zip(outs, baseline))
        ms = {}
        for name, f in (("fwd", fwd), ("fwd_bwd", fn)):
            times = []
            for _ in range(a.iters):
                start = time.perf_counter()
                jax.block_until_ready(f(x, dt, B, C))
                times.append(time.perf_counter() - start)
            ms[name] = 1e3 * float(np.median(times))
        rows.append({"variant": label, "fwd_ms": ms["fwd"], "ms": ms["fwd_bwd"],
                     "tflops": flops / ms["fwd_bwd"] / 1e9, "max_rel_diff": err})
        print(f"{label:<28}{ms['fwd']:>9.2f}{ms['fwd_bwd']:>12.2f}{rows[-1]['tflops']:>10.1f}{err:>14.1e}",
              flush=True)
    with open(a.json, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
