"""The Mamba-2 SSD core alone: forward + backward time of ``ssd_chunked`` at a model's shapes,
against the SSD matmul FLOPs that maxfp4.metrics charges (training FLOPs per token x tokens).

    python benchmarks/ssd_layer.py [--config configs/mamba2-1p3b.yaml] [--json ssd_layer.json]

One row per operand precision of the token-length matmuls (model.mamba.ssd_matmul).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/mamba2-1p3b.yaml")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default="ssd_layer.json")
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
    flops = ssd_flops_per_token(m) / m.pattern.count("M") * b * t  # one layer, forward + backward
    rows = []
    for label, mdt in (("fp32 (HIGHEST)", None), ("bf16 operands", jnp.bfloat16)):
        def loss(x, dt, B, C, mdt=mdt):
            y = ssd_chunked(x, dt, A, B, C, ids, m.mamba.chunk_size, matmul_dtype=mdt)
            return jnp.sum(y.astype(jnp.float32))
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        jax.block_until_ready(fn(x, dt, B, C))
        times = []
        for _ in range(a.iters):
            start = time.perf_counter()
            jax.block_until_ready(fn(x, dt, B, C))
            times.append(time.perf_counter() - start)
        ms = 1e3 * float(np.median(times))
        rows.append({"matmul": label, "ms": ms, "tflops": flops / ms / 1e9})
    print(f"SSD fwd+bwd, {a.config}: B={b} T={t} H={h} P={p} G={g} N={n} chunk={m.mamba.chunk_size}, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{'matmul operands':<18}{'ms':>9}{'TFLOP/s (metrics SSD FLOPs)':>30}")
    for r in rows:
        print(f"{r['matmul']:<18}{r['ms']:>9.2f}{r['tflops']:>30.1f}")
    with open(a.json, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
