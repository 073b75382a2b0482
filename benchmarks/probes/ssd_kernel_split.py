"""Where the Pallas SSD's time goes: the XLA part (kernel_inputs) against the kernel itself
(chunk_outputs), forward and forward+backward, at a model's shapes.

    python benchmarks/probes/ssd_kernel_split.py [--config configs/mamba2-1p3b.yaml]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxfp4.config import load_config
from maxfp4.model.mamba import dims
from maxfp4.model.ssd_kernel import chunk_outputs, kernel_inputs


def median_ms(fn, *args, iters=10):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/mamba2-1p3b.yaml")
    ap.add_argument("--warps", type=int, default=8)
    a = ap.parse_args()
    cfg = load_config(a.config)
    b, t, q = cfg.data.global_batch, cfg.data.seq_len, cfg.model.mamba.chunk_size
    d = dims(cfg.model)
    h, p, g, n = d["H"], d["P"], d["G"], d["N"]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, t, h, p)), jnp.bfloat16)
    dt = jnp.asarray(rng.uniform(1e-3, 1e-1, (b, t, h)), jnp.float32)
    A = jnp.asarray(-rng.uniform(1, 16, h), jnp.float32)
    B = jnp.asarray(rng.standard_normal((b, t, g, n)), jnp.bfloat16)
    C = jnp.asarray(rng.standard_normal((b, t, g, n)), jnp.bfloat16)
    ids = jnp.ones((b, t), jnp.int32)
    mdt = jnp.bfloat16

    def prep(x, dt, B, C):
        return kernel_inputs(x, dt, A, B, C, ids, q, mdt)

    inputs = jax.jit(prep)(x, dt, B, C)
    cot = jax.tree.map(lambda v: jnp.ones(v.shape, v.dtype) if jnp.issubdtype(v.dtype, jnp.floating)
                       else np.zeros(v.shape, jax.dtypes.float0), inputs)

    def prep_vjp(x, dt, B, C):
        out, pull = jax.vjp(prep, x, dt, B, C)
        return pull(cot)

    def kern(cb, xx, dtt, cs, seg, ye):
        return chunk_outputs(cb, xx, dtt, cs, seg, ye, mdt, jax.default_backend() != "gpu", a.warps)

    dy = jnp.ones(x.shape, jnp.float32)

    def kern_vjp(cb, xx, dtt, cs, ye, seg=inputs[4]):
        out, pull = jax.vjp(lambda cb, xx, dtt, cs, ye: kern(cb, xx, dtt, cs, seg, ye), cb, xx, dtt, cs, ye)
        return pull(dy)

    rows = [("XLA part forward", median_ms(jax.jit(prep), x, dt, B, C)),
            ("XLA part forward+backward", median_ms(jax.jit(prep_vjp), x, dt, B, C)),
            ("kernel forward", median_ms(jax.jit(kern), *inputs)),
            ("kernel forward+backward", median_ms(jax.jit(kern_vjp), *[inputs[i] for i in (0, 1, 2, 3, 5)]))]
    print(f"SSD split, {a.config}: B={b} T={t} H={h} P={p} G={g} N={n} Q={q} warps={a.warps}, "
          f"{jax.devices()[0].device_kind}")
    for label, ms in rows:
        print(f"{label:<30}{ms:>9.2f} ms")


if __name__ == "__main__":
    main()
