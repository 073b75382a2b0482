"""Element-wise and reduction passes of a Llama-3-8B FSDP step, one GPU's share at two
sequences of 8192 tokens (M=16384, F=14336; each GPU holds half of every weight), in
isolation:

- SwiGLU's backward as remat recomputes it: the product h (for mlp_down's weight gradient) and
  the [M, F, 2] gate/up gradient, from slices and the general FP32 formula over [M, F, 2], and
  from the (gate, up) pairs read as 32-bit words (``activations.swiglu_product`` on BF16);
- the global gradient norm over 32 blocks' FP32 gradients of ``w_gate_up`` ([2048, 28672] a
  block and GPU) that XLA concatenates into the stacked [32, ...] leaf: one reduction of the
  concatenation (``optax.tree.norm``) against per-block sums (``optim.global_norm``).

    python benchmarks/probes/llama_elementwise.py
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.model import activations  # noqa: E402
from maxfp4.optim import global_norm  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
M, F = (16384, 14336) if ON_GPU else (256, 384)
L, ROWS, COLS = (32, 2048, 28672) if ON_GPU else (4, 64, 96)


def swiglu_slices(gu):
    """The product read as two slices of [M, F, 2] (the form before the packed words)."""
    return jax.nn.silu(gu[..., 0].astype(jnp.float32)) * gu[..., 1].astype(jnp.float32)


def swiglu_grad_general(gu, dh):
    """The general path's gradient formula over [M, F, 2] (the form before the packed words)."""
    g32 = gu.astype(jnp.float32)
    g, u = g32[..., :1], g32[..., 1:]
    sig = jax.nn.sigmoid(g)
    first = jax.lax.broadcasted_iota(jnp.int32, g32.shape, g32.ndim - 1) == 0
    coef = jnp.where(first, u * sig * (1.0 + g * (1.0 - sig)), g * sig)
    return (dh.astype(jnp.float32)[..., None] * coef).astype(gu.dtype)


def swiglu_pass(product_fn, grad_fn):
    def run(gu, dh):
        return product_fn(gu).astype(jnp.bfloat16), grad_fn(gu, dh)
    return jax.jit(run)


def main():
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    gu = (2.0 * jax.random.normal(k[0], (M, F, 2), jnp.float32)).astype(jnp.bfloat16)
    dh = jax.random.normal(k[1], (M, F), jnp.float32).astype(jnp.bfloat16)
    gb = 2 * (2 * M * F * 2 + M * F * 2) / 1e9  # read gu and dh, write h and the gradient
    results = {}
    forms = {"slices, general [M,F,2]": (swiglu_slices, swiglu_grad_general),
             "packed words": (activations.swiglu_product, activations.swiglu_grad_bf16_pairs)}
    for name, (product_fn, grad_fn) in forms.items():
        f = swiglu_pass(product_fn, grad_fn)
        ms = median_ms(f, gu, dh, iters=20)
        results[name] = [np.asarray(a.astype(jnp.float32)) for a in f(gu, dh)]
        print(f"swiglu h + grad, {name:<24} {ms * 1e3:8.1f} us  ({gb / ms * 1e3:6.0f} GB/s at one pass)",
              flush=True)
    same = all(np.array_equal(a, b) for a, b in zip(*results.values()))
    print(f"swiglu forms equal bit for bit: {same}")
    del gu, dh

    parts = [jax.random.normal(jax.random.fold_in(k[2], i), (ROWS, COLS), jnp.float32) for i in range(L)]
    stacked = lambda ps: jnp.stack(ps)  # the concatenation XLA forms from the blocks' gradients
    forms = {
        "optax.tree.norm": jax.jit(lambda ps: optax.tree.norm({"w": stacked(ps)})),
        "optim.global_norm": jax.jit(lambda ps: global_norm({"w": stacked(ps)})),
    }
    gb = L * ROWS * COLS * 4 / 1e9
    norms = {}
    for name, f in forms.items():
        ms = median_ms(f, parts, iters=20)
        norms[name] = float(f(parts))
        print(f"grad norm, {name:<20} {ms * 1e3:8.1f} us  ({gb / ms * 1e3:6.0f} GB/s)", flush=True)
    print("norms:", norms)


if __name__ == "__main__":
    main()
