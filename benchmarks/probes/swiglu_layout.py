"""The gate/up GEMM's output layout for SwiGLU: interleaved [M, F, 2] (the model's) against two
halves [M, 2, F], one MLP forward and backward at Llama-3-8B shapes per GPU (M=16384, D=4096,
F=14336) in BF16 and FP8 delayed scaling. The halves' product and its gradient are written
here as the model's interleaved ones are (FP32 inside, one custom VJP).

    python benchmarks/probes/swiglu_layout.py
"""
import sys
from functools import partial

import jax
import jax.numpy as jnp

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.compiler import compiler_options  # noqa: E402
from maxfp4.model.activations import swiglu_product  # noqa: E402
from maxfp4.precision.recipes import bf16_dot, fp8_delayed_dot  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
M, D, FF = (16384, 4096, 14336) if ON_GPU else (128, 64, 96)


@jax.custom_vjp
def swiglu_halves(gate_up_M2F):
    g = gate_up_M2F[:, 0].astype(jnp.float32)
    return jax.nn.silu(g) * gate_up_M2F[:, 1].astype(jnp.float32)


def _halves_fwd(gate_up_M2F):
    return swiglu_halves(gate_up_M2F), gate_up_M2F


def _halves_bwd(gate_up_M2F, dh_MF):
    gu = gate_up_M2F.astype(jnp.float32)
    g, u = gu[:, :1], gu[:, 1:]
    sig = jax.nn.sigmoid(g)
    first = jax.lax.broadcasted_iota(jnp.int32, gu.shape, 1) == 0
    coef = jnp.where(first, u * sig * (1.0 + g * (1.0 - sig)), g * sig)
    return ((dh_MF.astype(jnp.float32)[:, None, :] * coef).astype(gate_up_M2F.dtype),)


swiglu_halves.defvjp(_halves_fwd, _halves_bwd)


def mlp(params, scales, x, g, layout, dot):
    up = params["up"]  # [D, F, 2] or [D, 2, F]
    gu = dot(x, up.reshape(D, 2 * FF), (), scales[0], None)
    h = swiglu_product(gu.reshape(M, FF, 2)) if layout == "interleaved" else swiglu_halves(gu.reshape(M, 2, FF))
    y = dot(h.astype(jnp.bfloat16), params["down"], (), scales[1], None)
    return jnp.sum(y.astype(jnp.float32) * g)


def main():
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(k[0], (M, D), jnp.bfloat16)
    g = jax.random.normal(k[1], (M, D), jnp.float32) * 1e-3
    w_down = jax.random.normal(k[3], (FF, D), jnp.float32) * 0.02
    w_up_interleaved = jax.random.normal(k[2], (D, FF, 2), jnp.float32) * 0.02
    layouts = {"interleaved": w_up_interleaved, "halves": jnp.swapaxes(w_up_interleaved, 1, 2)}
    scales = jnp.array([[64.0, 4096.0, 2.0 ** 20], [16.0, 4096.0, 2.0 ** 22]], jnp.float32)
    print(f"{'recipe':<8} {'layout':<12} {'ms':>8}")
    for name, dot in (("bf16", bf16_dot), ("fp8", fp8_delayed_dot)):
        grads = {}
        for layout, w_up in layouts.items():
            params = {"up": w_up, "down": w_down}
            fn = jax.jit(jax.grad(partial(mlp, layout=layout, dot=dot), argnums=(0, 2)),
                         compiler_options=compiler_options(jax.default_backend()))
            ms = median_ms(fn, params, scales, x, g, iters=20)
            grads[layout] = fn(params, scales, x, g)
            print(f"{name:<8} {layout:<12} {ms:8.3f}", flush=True)
        a, b = grads["interleaved"], grads["halves"]
        same = bool(jnp.array_equal(a[0]["up"], jnp.swapaxes(b[0]["up"], 1, 2))
                    and jnp.array_equal(a[1], b[1]) and jnp.array_equal(a[0]["down"], b[0]["down"]))
        print(f"{name:<8} gradients equal bit for bit: {same}")


if __name__ == "__main__":
    main()
