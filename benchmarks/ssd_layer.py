"""The Mamba-2 SSD core alone: forward + backward time at a model's shapes, against the SSD
matmul FLOPs that maxfp4.metrics charges (training FLOPs per token x tokens).

    python benchmarks/ssd_layer.py [--config configs/mamba2-1p3b.yaml] [--json ssd_layer.json]

One row per variant (``--variants``): implementation (model.mamba.kernels: XLA's chunked form,
or the Pallas kernel), operand precision of the token-length matmuls (model.mamba.ssd_matmul),
chunk size and kernel tiling (Triton warps, heads per program, stages, and which kernel runs the
forward and the backward's input gradients: ``triton``, the default, or ``mosaic``, e.g.
``pallas:bf16:128:8:16:1:mosaic:mosaic``); each
row also gives its largest difference from the first row, output and gradients, relative to that
row's largest magnitude.

``--split`` instead times the Pallas variant's two parts apart: the XLA part around the kernel
(``kernel_inputs``) and the kernel itself (``chunk_outputs``), forward and forward+backward.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from maxfp4.config import load_config
from maxfp4.model_spec import model_spec
from maxfp4.model_spec import mamba_dims as dims
from maxfp4.model.ssd import ssd_chunked
from maxfp4.kernels.ssd import Tiling, chunk_outputs, kernel_inputs, ssd_fused
from timing import median_ms


def parse_tiling(fields: list[str]) -> Tiling:
    """WARPS[:HEADS[:STAGES]][:FORWARD[:BACKWARD]] (each triton or mosaic) as a Tiling."""
    numbers = [int(f) for f in fields if f not in ("triton", "mosaic")]
    kernels = [f for f in fields if f in ("triton", "mosaic")] + ["triton", "triton"]
    return Tiling(*numbers, forward=kernels[0], backward=kernels[1])


def split(x, dt, A, B, C, ids, q: int, tiling: Tiling, iters: int) -> list[tuple[str, float]]:
    """Times of the XLA part and of the kernel, each alone, BF16 operands."""
    mdt = jnp.bfloat16

    def prep(x, dt, B, C):
        return kernel_inputs(x, dt, A, B, C, ids, q, mdt)

    inputs = jax.jit(prep)(x, dt, B, C)
    cotangents = jax.tree.map(lambda v: jnp.ones(v.shape, v.dtype) if jnp.issubdtype(v.dtype, jnp.floating)
                              else np.zeros(v.shape, jax.dtypes.float0), inputs)

    def prep_vjp(x, dt, B, C):
        return jax.vjp(prep, x, dt, B, C)[1](cotangents)

    seg = inputs[4]

    d = jnp.ones(x.shape[2:], jnp.float32)

    def kernel(cb, xx, dtt, cs, c_entry):
        return chunk_outputs(cb, xx, dtt, cs, seg, c_entry, d, x.dtype, mdt, jax.default_backend() != "gpu", tiling)

    def kernel_vjp(*args):
        return jax.vjp(kernel, *args)[1](jnp.ones(x.shape, x.dtype))

    kernel_args = [inputs[i] for i in (0, 1, 2, 3, 5)]
    return [("XLA part forward", median_ms(jax.jit(prep), x, dt, B, C, iters=iters)),
            ("XLA part forward+backward", median_ms(jax.jit(prep_vjp), x, dt, B, C, iters=iters)),
            ("kernel forward", median_ms(jax.jit(kernel), *kernel_args, iters=iters)),
            ("kernel forward+backward", median_ms(jax.jit(kernel_vjp), *kernel_args, iters=iters))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/mamba2-1p3b.yaml")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json", default="ssd_layer.json")
    ap.add_argument("--variants", default="xla:fp32:128,xla:bf16:128,pallas:bf16:64:4,pallas:bf16:128:8",
                    help="comma-separated IMPL:OPERANDS:CHUNK[:WARPS[:HEADS[:STAGES]]], IMPL xla or pallas, "
                         "OPERANDS fp32 or bf16, HEADS per kernel program, STAGES Triton pipelining "
                         "stages; the first is the reference of the diff column")
    ap.add_argument("--split", action="store_true", help="time the Pallas SSD's XLA part and kernel apart")
    ap.add_argument("--tiling", default="8:1:1", help="WARPS:HEADS:STAGES[:FORWARD[:BACKWARD]], with --split")
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
    flops = model_spec(m).ssd_flops_per_token() / m.pattern.count("M") * b * t  # one layer, forward + backward
    if a.split:
        print(f"SSD split, {a.config}: B={b} T={t} H={h} P={p} G={g} N={n} Q={m.mamba.chunk_size} "
              f"tiling={a.tiling}, {jax.devices()[0].device_kind}")
        tiling = parse_tiling(a.tiling.split(":"))
        for label, ms in split(x, dt, A, B, C, ids, m.mamba.chunk_size, tiling, a.iters):
            print(f"{label:<30}{ms:>9.2f} ms")
        return
    print(f"SSD, {a.config}: B={b} T={t} H={h} P={p} G={g} N={n}, "
          f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{'variant':<28}{'fwd ms':>9}{'fwd+bwd ms':>12}{'TFLOP/s':>10}{'max rel diff':>14}", flush=True)
    rows, baseline = [], None
    for spec in a.variants.split(","):
        impl, operands, q, *launch = spec.split(":")
        mdt, q = (None if operands == "fp32" else jnp.bfloat16), int(q)
        tiling = parse_tiling(launch) if launch else None

        def forward(x, dt, B, C, impl=impl, mdt=mdt, q=q, tiling=tiling):
            if impl == "xla":
                return ssd_chunked(x, dt, A, B, C, ids, q, matmul_dtype=mdt)
            return ssd_fused(x, dt, A, B, C, ids, q, matmul_dtype=mdt, tiling=tiling,
                             forward="auto" if tiling is None else tiling.forward,
                             backward="auto" if tiling is None else tiling.backward)

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
        ms = {name: median_ms(f, x, dt, B, C, iters=a.iters) for name, f in (("fwd", fwd), ("fwd_bwd", fn))}
        rows.append({"variant": label, "fwd_ms": ms["fwd"], "ms": ms["fwd_bwd"],
                     "tflops": flops / ms["fwd_bwd"] / 1e9, "max_rel_diff": err})
        print(f"{label:<28}{ms['fwd']:>9.2f}{ms['fwd_bwd']:>12.2f}{rows[-1]['tflops']:>10.1f}{err:>14.1e}",
              flush=True)
    with open(a.json, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=2)


if __name__ == "__main__":
    main()
