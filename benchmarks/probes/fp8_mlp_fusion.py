"""The MLP blocks' forward and backward under FP8 delayed scaling, as the model runs them
(blocks unrolled, ``train.remat=save_gemm``), three ways:

- ``recipes``: ``lp.dot`` for mlp_up and mlp_down with the activation's own VJP between them;
  each FP8 operand is cast from a BF16 tensor by a pass of its own;
- ``up fused``: mlp_up and the activation as one VJP (``fp8_mlp.up_activation``), whose
  backward stores mlp_up's output gradient in E5M2 itself;
- ``mlp fused``: the whole MLP as one VJP (``fp8_mlp.mlp``), whose forward also stores
  mlp_down's input in E4M3.

Shapes: Llama-3-8B's MLP at one GPU's two sequences of 8192 tokens (SwiGLU, D 4096, F 14336),
and hybrid-1b's (squared ReLU, D 2048, F 8192, 8 sequences of 2048). Prints ms per block and
whether every output and gradient is the same bit for bit; BF16 for reference.

    python benchmarks/probes/fp8_mlp_fusion.py
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.config import load_config  # noqa: E402
from maxfp4.model import fp8_mlp  # noqa: E402
from maxfp4.model.activations import relu2, swiglu_product  # noqa: E402
from maxfp4.model.remat import remat_body  # noqa: E402
from maxfp4.precision import LayerPrecision, resolve_policy  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
BLOCKS = 4
SHAPES = {  # name: (kind, M tokens, D, F)
    "llama3-8b swiglu": ("swiglu", 16384, 4096, 14336) if ON_GPU else ("swiglu", 256, 64, 96),
    "hybrid-1b relu2": ("relu2", 16384, 2048, 8192) if ON_GPU else ("relu2", 256, 64, 96),
}


def recipes_path(kind, f):
    def mlp(x, w_up, w_down, lp):
        y = lp.dot(x, w_up, "mlp_up")
        h = swiglu_product(y.reshape(*y.shape[:-1], f, 2)) if kind == "swiglu" else relu2(y)
        return lp.dot(h.astype(jnp.bfloat16), w_down, "mlp_down")
    return mlp


def up_fused(kind, f):
    def mlp(x, w_up, w_down, lp):
        return lp.dot(fp8_mlp.up_activation(x, w_up, lp, kind).astype(jnp.bfloat16), w_down, "mlp_down")
    return mlp


def mlp_fused(kind, f):
    return lambda x, w_up, w_down, lp: fp8_mlp.mlp(x, w_up, w_down, lp, kind)


def step_fn(mlp, policy):
    """BLOCKS residual MLP blocks, each rematerialised as the model does, and their gradients."""
    def loss(x, params, scales):
        for i in range(BLOCKS):
            lp = LayerPrecision(policy, i, scales[i])
            block = remat_body(lambda x, p, lp=lp: x + mlp(x, p[0], p[1], lp), "save_gemm", scanned=False)
            x = block(x, params[i])
        return jnp.sum(x.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def main():
    fp8 = resolve_policy(load_config(None, ["precision.default=fp8_delayed"]).precision, BLOCKS)
    bf16 = resolve_policy(load_config(None, ["precision.default=bf16"]).precision, BLOCKS)
    for name, (kind, m, d, f) in SHAPES.items():
        gates = 2 if kind == "swiglu" else 1
        k = jax.random.split(jax.random.key(0), 2 * BLOCKS + 1)
        x = jax.random.normal(k[0], (m // 2048 if ON_GPU else 2, 2048 if ON_GPU else m // 2, d),
                              jnp.float32).astype(jnp.bfloat16)
        params = [(0.02 * jax.random.normal(k[2 * i + 1], (d, gates * f), jnp.float32),
                   0.02 * jax.random.normal(k[2 * i + 2], (f, d), jnp.float32)) for i in range(BLOCKS)]
        s = jnp.array([4.0, 2000.0, 2.0 ** 20], jnp.float32)
        scales = [{"mlp_up": s, "mlp_down": s} for _ in range(BLOCKS)]
        results = {}
        for form, make, policy in [("bf16", recipes_path, bf16), ("recipes", recipes_path, fp8),
                                   ("up fused", up_fused, fp8), ("mlp fused", mlp_fused, fp8)]:
            fn = step_fn(make(kind, f), policy)
            ms = median_ms(fn, x, params, scales, iters=10)
            results[form] = [np.asarray(a, np.float32) for a in jax.tree_util.tree_leaves(fn(x, params, scales))]
            print(f"{name:<18} {form:<10} {ms / BLOCKS:8.3f} ms a block", flush=True)
        for form in ("up fused", "mlp fused"):
            same = all(np.array_equal(a, b) for a, b in zip(results[form], results["recipes"]))
            print(f"{name:<18} {form:<10} same bits as recipes: {same}", flush=True)


if __name__ == "__main__":
    main()
