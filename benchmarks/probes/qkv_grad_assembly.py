"""The qkv GEMM's output gradient assembled from dq, dk, dv (RoPE's backward, interleaving into
[B, T, K, G+2, H]), alone: XLA (``attention._split_heads_bwd``) against the Pallas kernel
(``qkv_grad_kernel``) by rows per program and warps; in BF16 and stored in E5M2 with its amax
(the FP8 recipe's cast of dY; XLA's form is the recipe's ``quantize_fp8`` of the BF16 result).
Prints ms, the bandwidth of one read of the inputs and one write of the output, and whether the
kernel's output is the same bit for bit as XLA's.

    python benchmarks/probes/qkv_grad_assembly.py
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.model import qkv_grad_kernel  # noqa: E402
from maxfp4.model.attention import _split_heads_bwd  # noqa: E402
from maxfp4.model.fp8_epilogue import Quantize  # noqa: E402
from maxfp4.model.layers import rope_tables  # noqa: E402
from maxfp4.precision.formats import FP8_E5M2, quantize_fp8  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
SHAPES = {  # name: (B, T, K, G, H, rope theta); one GPU's share of a step
    "llama3-8b": (2, 8192, 8, 4, 128, 5e5) if ON_GPU else (1, 64, 2, 4, 128, 5e5),
    "dense-1p3b": (8, 2048, 8, 4, 64, 5e5) if ON_GPU else (1, 64, 2, 4, 64, 5e5),
    "hybrid-1b": (8, 2048, 8, 4, 64, None) if ON_GPU else (1, 64, 2, 4, 64, None),
}
CONFIGS = [(8, 4), (16, 4), (16, 8), (32, 4), (32, 8)] if ON_GPU else [(16, 4)]


def main():
    scale = jnp.float32(64.0)
    for name, (b, t, kv, g, h, theta) in SHAPES.items():
        ks = jax.random.split(jax.random.key(0), 3)
        dq = jax.random.normal(ks[0], (b, t, kv * g, h), jnp.float32).astype(jnp.bfloat16)
        dk = jax.random.normal(ks[1], (b, t, kv, h), jnp.float32).astype(jnp.bfloat16)
        dv = jax.random.normal(ks[2], (b, t, kv, h), jnp.float32).astype(jnp.bfloat16)
        tables = None if theta is None else rope_tables(jnp.tile(jnp.arange(t)[None], (b, 1)), theta, h)
        elements = b * t * kv * (g + 2) * h

        def xla_bf16(dq, dk, dv, tables):
            return _split_heads_bwd(theta, tables, (dq, dk, dv))[0]

        def xla_fp8(dq, dk, dv, tables):
            d = xla_bf16(dq, dk, dv, tables)
            return quantize_fp8(d, scale, FP8_E5M2), jnp.max(jnp.abs(d)).astype(jnp.float32)

        forms = {"xla bf16": (jax.jit(xla_bf16), 4), "xla fp8": (jax.jit(xla_fp8), 3)}
        for rows, warps in CONFIGS:
            if not qkv_grad_kernel.supported(t, g, h, rows):
                continue
            kw = dict(interpret=not ON_GPU, rows=rows, num_warps=warps)
            forms[f"kernel bf16 r{rows} w{warps}"] = (jax.jit(
                lambda dq, dk, dv, tb, kw=kw: qkv_grad_kernel.assemble(dq, dk, dv, tb, **kw)), 4)
            forms[f"kernel fp8 r{rows} w{warps}"] = (jax.jit(
                lambda dq, dk, dv, tb, kw=kw: qkv_grad_kernel.assemble(dq, dk, dv, tb, quantize=Quantize(
                    scale, FP8_E5M2), **kw)), 3)
        results = {}
        for form, (fn, bytes_moved) in forms.items():  # bytes an element: 2 read, 2 or 1 written
            ms = median_ms(fn, dq, dk, dv, tables, iters=20)
            out = jax.tree_util.tree_leaves(fn(dq, dk, dv, tables))
            results[form] = [np.asarray(a.view(jnp.uint8) if a.dtype == FP8_E5M2 else a.astype(jnp.float32)) for a in out]
            ref = results["xla fp8" if "fp8" in form else "xla bf16"]
            same = all(np.array_equal(a, r) for a, r in zip(results[form], ref))
            gbs = elements * bytes_moved / 1e6 / ms
            print(f"{name:<11} {form:<22} {ms:8.3f} ms {gbs:7.0f} GB/s  same bits as XLA: {same}", flush=True)


if __name__ == "__main__":
    main()
