"""How the FP8 operand and its transpose (the weight gradient's TN operand) are formed, and what
that costs in one squared-ReLU MLP (hybrid-1b shapes: M=16384, D=2048, F=8192), forward and
backward, FP8 delayed scaling with power-of-two scales (the recipe's GEMM forms).

Forms of (q, q^T) for an FP8 operand x:
  barrier_then_T: q = barrier(fp8(x)); q^T = transpose(q)   (the recipes' form: two passes)
  T_in_barrier:   (q, q^T) = barrier((fp8(x), transpose(fp8(x))))   (one fusion may write both)
  two_casts:      q = barrier(fp8(x)); q^T = barrier(fp8(transpose(x)))

Prints ms per forward+backward under a few XLA options, the FP8 transposes XLA made (and how
many as Triton kernels), and checks that every form gives the same gradients bit for bit. The
timings spread by ~0.2 ms from run to run (docs/PERFORMANCE.md): repeat before reading a
difference.

    python benchmarks/probes/fp8_cast_transpose_forms.py [--first-form-only]
"""
import re
import sys
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.compiler import compiler_options  # noqa: E402
from maxfp4.precision import formats as F  # noqa: E402
from maxfp4.precision.recipes import fp8_gemm_tn  # noqa: E402

M, D, FF = (16384, 2048, 8192) if jax.default_backend() == "gpu" else (256, 64, 128)
E4, E5 = F.FP8_E4M3, F.FP8_E5M2


# formats.quantize_fp8 without its optimization barrier: the forms below place the barrier.
_cast = F.cast_fp8


def quantize_pair(x, s, dtype, form):
    if form == "barrier_then_T":
        q = jax.lax.optimization_barrier(_cast(x, s, dtype))
        return q, q.T
    if form == "T_in_barrier":
        q = _cast(x, s, dtype)
        return jax.lax.optimization_barrier((q, q.T))
    if form == "two_casts":
        return (jax.lax.optimization_barrier(_cast(x, s, dtype)),
                jax.lax.optimization_barrier(_cast(x.T, s, dtype)))
    raise ValueError(form)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_linear(x, w, s, form):
    return _fwd(x, w, s, form)[0]


def _fwd(x, w, s, form):
    qx, qxT = quantize_pair(x, s[0], E4, form)
    qw = jax.lax.optimization_barrier(_cast(w, s[1], E4))
    y = fp8_gemm_tn(qx, s[0], qw.T, s[1], power_2=True)
    amax = jnp.stack([jnp.max(jnp.abs(x)).astype(jnp.float32), jnp.max(jnp.abs(w)).astype(jnp.float32)])
    return y, (qxT, qw, s, amax)


def _bwd(form, res, dy):
    qxT, qw, s, amax = res
    qdy, qdyT = quantize_pair(dy, s[2], E5, form)
    dx = fp8_gemm_tn(qdy, s[2], qw, s[1], power_2=True)
    dw = fp8_gemm_tn(qxT, s[0], qdyT, s[2], jnp.float32, True)
    amaxes = jnp.concatenate([amax, jnp.max(jnp.abs(dy)).astype(jnp.float32)[None]])
    return dx, dw, amaxes


fp8_linear.defvjp(_fwd, _bwd)


def mlp_loss(params, scales, x, g, form):
    h = fp8_linear(x, params["up"], scales[0], form)
    a = jnp.square(jax.nn.relu(h))
    y = fp8_linear(a, params["down"], scales[1], form)
    return jnp.sum((y.astype(jnp.float32) * g))


def main():
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(keys[0], (M, D), jnp.bfloat16)
    g = jax.random.normal(keys[1], (M, D), jnp.float32) * 1e-3
    params = {"up": jax.random.normal(keys[2], (D, FF), jnp.float32) * 0.02,
              "down": jax.random.normal(keys[3], (FF, D), jnp.float32) * 0.02}
    scales = jnp.array([[64.0, 4096.0, 2.0 ** 20], [16.0, 4096.0, 2.0 ** 22]], jnp.float32)
    option_sets = {"default": {},
                   "no block-level rewriter": {"xla_gpu_experimental_enable_fusion_block_level_rewriter": False},
                   "fusion autotuner": {"xla_gpu_experimental_enable_fusion_autotuner": True},
                   "post-fusion autotune": {"xla_gpu_experimental_autotune_post_fusion": True}}
    if len(sys.argv) > 1 and sys.argv[1] == "--first-form-only":
        forms = ("barrier_then_T",)
    else:
        forms = ("barrier_then_T", "T_in_barrier", "two_casts")
    reference = None
    print(f"{'form':<16} {'options':<24} {'ms':>7} {'transposes':>10} {'(Triton)':>8} {'fusions':>8}")
    for form in forms:
        fn = jax.grad(partial(mlp_loss, form=form), argnums=(0, 1, 2))
        for opt_name, extra in option_sets.items():
            try:
                compiled = jax.jit(fn).lower(params, scales, x, g).compile(
                    compiler_options=compiler_options("gpu", extra))
            except Exception as error:  # an option this XLA lacks
                print(f"{form:<16} {opt_name:<24} fails: {str(error).splitlines()[0][:80]}")
                continue
            text = compiled.as_text()
            n_transpose = len(re.findall(r"^\s*%?\S*transpose\S* = f8", text, re.M))
            n_triton = len(re.findall(r"^\s*%?wrapped_transpose\S* = f8", text, re.M))
            n_fusion = len(re.findall(r"^\s*%?\S+ = \S+ fusion\(", text, re.M))
            ms = median_ms(compiled, params, scales, x, g, iters=20)
            grads = jax.tree.leaves(compiled(params, scales, x, g))
            if reference is None:
                reference = grads
            same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(grads, reference))
            print(f"{form:<16} {opt_name:<24} {ms:7.3f} {n_transpose:>10} {n_triton:>8} {n_fusion:>8}"
                  f"{'' if same else '  GRADIENTS DIFFER'}", flush=True)
            if opt_name == "default" and form != "barrier_then_T":
                for line in text.splitlines():
                    if re.match(r"^\s*%?\S+ = \(?f8\S* fusion\(", line) or re.match(r"^\s*%?\S+ = \(f8", line):
                        print("    " + line.strip()[:150])


if __name__ == "__main__":
    main()
