"""BF16 GEMMs through XLA's default cuBLAS call against cuBLASLt (``xla_gpu_enable_cublaslt``,
whose algorithms XLA autotunes), at the linear-layer shapes of llama3-8b and hybrid-1b: forward
(x @ w), input gradient (dy @ w^T) and weight gradient (x^T @ dy, FP32 out as the trainer's
master weights take it). Prints TFLOP/s per shape and option set.

    python benchmarks/probes/bf16_gemm_library.py
"""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.compiler import compiler_options  # noqa: E402

bf16, f32 = jnp.bfloat16, jnp.float32

# (name, M tokens, K in, N out)
SHAPES = [
    ("llama qkv", 16384, 4096, 6144),
    ("llama o", 16384, 4096, 4096),
    ("llama gate_up", 16384, 4096, 28672),
    ("llama down", 16384, 14336, 4096),
    ("hybrid in_proj", 16384, 2048, 8512),
    ("hybrid out_proj", 16384, 4096, 2048),
    ("hybrid mlp_up", 16384, 2048, 8192),
    ("hybrid mlp_down", 16384, 8192, 2048),
    ("hybrid lm_head", 16384, 2048, 128256),
]

OPTION_SETS = {
    "cublas": {},
    "cublaslt": {"xla_gpu_enable_cublaslt": True},
}


def forward(x_MK, w_KN):
    return jnp.dot(x_MK, w_KN, preferred_element_type=bf16)


def input_grad(dy_MN, w_KN):
    return jax.lax.dot_general(dy_MN, w_KN, (((1,), (1,)), ((), ())), preferred_element_type=bf16)


def weight_grad(x_MK, dy_MN):
    return jax.lax.dot_general(x_MK, dy_MN, (((0,), (0,)), ((), ())), preferred_element_type=f32)


def main():
    key = jax.random.PRNGKey(0)
    print(f"{'shape':<16} {'gemm':<6} " + " ".join(f"{n:>14}" for n in OPTION_SETS))
    totals = {n: 0.0 for n in OPTION_SETS}
    for name, m, k, n in SHAPES:
        x = jax.random.normal(key, (m, k), bf16)
        w = jax.random.normal(key, (k, n), bf16) * 0.02
        dy = jax.random.normal(key, (m, n), bf16)
        flops = 2.0 * m * k * n
        for gemm, fn, args in (("fwd", forward, (x, w)), ("dgrad", input_grad, (dy, w)),
                               ("wgrad", weight_grad, (x, dy))):
            row = []
            for opt_name, extra in OPTION_SETS.items():
                opts = compiler_options("gpu", extra)
                compiled = jax.jit(fn).lower(*args).compile(compiler_options=opts)
                ms = median_ms(compiled, *args, iters=20)
                totals[opt_name] += ms
                row.append(f"{flops / ms / 1e9:8.0f} TF/s")
            print(f"{name:<16} {gemm:<6} " + " ".join(f"{r:>14}" for r in row), flush=True)
    print("sum of ms: " + ", ".join(f"{n} {t:.2f}" for n, t in totals.items()))


if __name__ == "__main__":
    main()
