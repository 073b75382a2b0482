"""Is XLA's BF16 -> FP8 cast bound by memory or by the conversion itself? One element-wise pass
over [16384, 8192] BF16 (hybrid-1b's MLP width at 16,384 tokens), scaled and clipped as the
recipes do, written as BF16, E4M3 or E5M2; with and without a squared ReLU in front (the
mlp_down operand's producer). Prints us per [16384, 8192] pass and the bytes moved per second.
Each timing runs the pass over REPEAT such arrays in one program, so that the host's dispatch
and synchronisation (~0.2 ms a call) do not hide the pass.

    python benchmarks/probes/fp8_convert_rate.py
"""
import sys

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.compiler import compiler_options  # noqa: E402
from maxfp4.pallas_params import triton_params  # noqa: E402
from maxfp4.precision import formats as F  # noqa: E402

SHAPE = (16384, 8192) if jax.default_backend() == "gpu" else (256, 128)
REPEAT = 8


def _pass(x, s, dtype, relu2):
    """The measured pass on one array (or one tile): [squared ReLU,] scale, clip to the FP8
    format's range, cast. The XLA program and the Pallas kernel both run this."""
    v = x.astype(jnp.float32)
    if relu2:
        v = jnp.square(jnp.maximum(v, 0.0))
    if dtype == jnp.bfloat16:
        return (v * s).astype(dtype)
    return F.cast_fp8(v, s, dtype)  # the recipes' cast, as the kernels' FP8 stores use it


def scaled(dtype, relu2):
    return functools.partial(_pass, dtype=dtype, relu2=relu2)


def scaled_with_amax(dtype):
    """The cast as the delayed-scaling recipes make it: the input's amax from the same read."""
    def fn(x, s):
        return _pass(x, s, dtype, False), jnp.max(jnp.abs(x), axis=(1, 2)).astype(jnp.float32)
    return fn


def pallas_scaled(dtype, relu2, rows, cols, warps):
    """The same pass as one Triton program per [rows, cols] tile (GPU only)."""
    def kernel(s_ref, x_ref, o_ref):
        o_ref[...] = _pass(x_ref[...], s_ref[0], dtype, relu2)

    def fn(x, s):
        r, m, n = x.shape
        return pl.pallas_call(
            kernel, grid=(r, m // rows, n // cols),
            in_specs=[pl.no_block_spec, pl.BlockSpec((pl.squeezed, rows, cols), lambda a, i, j: (a, i, j))],
            out_specs=pl.BlockSpec((pl.squeezed, rows, cols), lambda a, i, j: (a, i, j)),
            out_shape=jax.ShapeDtypeStruct(x.shape, dtype), **triton_params(False, warps))(s.reshape(1), x)
    return fn


def main():
    x = jax.random.normal(jax.random.PRNGKey(0), (REPEAT, *SHAPE), jnp.bfloat16)
    s = jnp.float32(16.0)
    n = x.size // REPEAT
    option_sets = {"default": {}}
    if jax.default_backend() == "gpu":
        option_sets["tuned unroll"] = {"xla_gpu_native_emitter_tune_unroll_factor_for_loops": True}
        # XLA's own Triton emitters for non-GEMM fusions: element-wise ("block level") and all.
        option_sets["block level"] = {"xla_gpu_experimental_enable_fusion_block_level_rewriter": True}
        option_sets["all triton"] = {"xla_gpu_experimental_all_fusions_with_triton": True}
    print(f"{'options':<14} {'producer':<10} {'output':<10} {'us':>8} {'GB/s':>8}")
    for opt_name, extra in option_sets.items():
        opts = compiler_options(jax.default_backend(), extra)
        for producer in ("none", "relu2", "amax"):
            for name, dtype in (("bf16", jnp.bfloat16), ("e4m3", F.FP8_E4M3), ("e5m2", F.FP8_E5M2)):
                if producer == "amax" and dtype == jnp.bfloat16:
                    continue
                form = scaled_with_amax(dtype) if producer == "amax" else scaled(dtype, producer == "relu2")
                try:
                    fn = jax.jit(form).lower(x, s).compile(compiler_options=opts)
                except Exception as error:  # an option this XLA lacks
                    print(f"{opt_name:<14} fails: {str(error).splitlines()[0][:90]}")
                    break
                us = 1e3 * median_ms(fn, x, s, iters=20) / REPEAT
                moved = n * (2 + jnp.dtype(dtype).itemsize)
                print(f"{opt_name:<14} {producer:<10} {name:<10} {us:8.1f} "
                      f"{moved / us / 1e3:8.0f}", flush=True)
    if jax.default_backend() != "gpu":
        return
    for rows, cols, warps in ((32, 1024, 4), (64, 512, 4), (16, 2048, 8), (64, 1024, 8)):
        for relu2 in (False, True):
            for name, dtype in (("bf16", jnp.bfloat16), ("e4m3", F.FP8_E4M3)):
                fn = jax.jit(pallas_scaled(dtype, relu2, rows, cols, warps))
                want = jax.jit(scaled(dtype, relu2))(x, s)
                same = bool(jnp.array_equal(fn(x, s).astype(jnp.float32), want.astype(jnp.float32)))
                us = 1e3 * median_ms(fn, x, s, iters=20) / REPEAT
                moved = n * (2 + jnp.dtype(dtype).itemsize)
                label = f"pallas {rows}x{cols}/{warps}"
                print(f"{label:<14} {'relu2' if relu2 else 'none':<10} {name:<10} {us:8.1f} "
                      f"{moved / us / 1e3:8.0f}{'' if same else '  DIFFERS'}", flush=True)


if __name__ == "__main__":
    main()
