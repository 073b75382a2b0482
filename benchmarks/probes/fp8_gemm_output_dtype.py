"""Which formulation of a scaled FP8 GEMM makes XLA write its output in BF16 (the cuBLASLt D
type) instead of FP32, and what the three GEMMs of one FP8 linear layer cost with each.

    python benchmarks/probes/fp8_gemm_output_dtype.py
"""
import re
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.compiler import compiler_options  # noqa: E402
from maxfp4.precision import formats as F  # noqa: E402

f32, bf16 = jnp.float32, jnp.bfloat16
TN = (((1,), (1,)), ((), ()))


def out_scale_f32(a_q, a_s, b_q, b_s, out):
    acc = jax.lax.dot_general(a_q.astype(bf16), b_q.astype(bf16), TN, preferred_element_type=f32)
    return (acc * (F.div_rn(1.0, a_s) * F.div_rn(1.0, b_s))).astype(out)


def operand_dequant_f32(a_q, a_s, b_q, b_s, out):
    a = a_q.astype(f32) * F.div_rn(1.0, a_s)
    b = b_q.astype(f32) * F.div_rn(1.0, b_s)
    return jax.lax.dot_general(a, b, TN, preferred_element_type=out)


def operand_dequant_bf16(a_q, a_s, b_q, b_s, out):
    a = a_q.astype(bf16) * F.div_rn(1.0, a_s).astype(bf16)
    b = b_q.astype(bf16) * F.div_rn(1.0, b_s).astype(bf16)
    return jax.lax.dot_general(a, b, TN, preferred_element_type=out)


def operand_divide_f32(a_q, a_s, b_q, b_s, out):
    return jax.lax.dot_general(a_q.astype(f32) / a_s, b_q.astype(f32) / b_s, TN, preferred_element_type=out)


def raw_fp8_out_dtype(a_q, a_s, b_q, b_s, out):
    acc = jax.lax.dot_general(a_q, b_q, TN, preferred_element_type=out)
    return (acc.astype(f32) * (F.div_rn(1.0, a_s) * F.div_rn(1.0, b_s))).astype(out)


def raw_fp8_f32_scaled(a_q, a_s, b_q, b_s, out):
    acc = jax.lax.dot_general(a_q, b_q, TN, preferred_element_type=f32)
    return (acc * (F.div_rn(1.0, a_s) * F.div_rn(1.0, b_s))).astype(out)


VARIANTS = [out_scale_f32, operand_dequant_f32, operand_divide_f32, operand_dequant_bf16,
            raw_fp8_out_dtype, raw_fp8_f32_scaled]


def gemm_lines(hlo):
    out = []
    for line in hlo.splitlines():
        if "custom-call(" in line and "cublas" in line:
            shape = line.split("=", 1)[1].strip().split(" custom-call")[0]
            target = re.search(r'custom_call_target="([^"]+)"', line).group(1)
            out.append(f"{target.split('$')[-1]}:{shape.split(', s8')[0].lstrip('(')}")
    return out


def main():
    M, K, N = 16384, 2048, 8192
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (M, K), bf16)
    w = 0.02 * jax.random.normal(k[1], (K, N), f32)
    dy = jax.random.normal(k[2], (M, N), bf16)
    # The scales are arguments of the program, as the trainer's delayed-scaling state is: scales
    # that are constants of the program let XLA fold the scale arithmetic away, which the
    # trainer never sees.
    scales = (jnp.float32(50.0), jnp.float32(5000.0), jnp.float32(1000.0))

    ref = None
    for gemm in VARIANTS:
        def layer(x, w, dy, scales):  # the three GEMMs of an FP8 linear layer, as the recipe runs them
            sx, sw, sdy = scales
            qx = F.quantize_fp8(x, sx, F.FP8_E4M3)
            qw = F.quantize_fp8(w, sw, F.FP8_E4M3)
            qdy = F.quantize_fp8(dy, sdy, F.FP8_E5M2)
            y = gemm(qx, sx, qw.T, sw, bf16)
            dx = gemm(qdy, sdy, qw, sw, bf16)
            dw = gemm(qx.T, sx, qdy.T, sdy, f32)
            return y, dx, dw
        try:
            fn = jax.jit(layer, compiler_options=compiler_options("gpu"))
            hlo = fn.lower(x, w, dy, scales).compile().as_text()
            outs = [np.asarray(a, np.float32) for a in fn(x, w, dy, scales)]
            ref = outs if ref is None else ref
            err = [round(float(np.abs(o - r).max() / np.abs(r).max()), 5) for o, r in zip(outs, ref)]
            same = [round(float(np.mean(o != r)), 6) for o, r in zip(outs, ref)]
            ms = median_ms(fn, x, w, dy, scales, iters=20)
            print(f"{gemm.__name__:22s} {ms:7.3f} ms  max err vs first {err}  share of values that differ {same}"
                  f"  {gemm_lines(hlo)}", flush=True)
        except Exception as e:  # noqa: BLE001 - a probe: report and go on
            msg = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
            print(f"{gemm.__name__:22s} failed: {' | '.join(msg[:3])[:600]}", flush=True)


if __name__ == "__main__":
    main()
