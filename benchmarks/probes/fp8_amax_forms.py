"""How fast XLA runs the per-tensor amax and the FP8 cast of an activation-sized operand, in the
forms the FP8 recipes could write them: one full reduction or a row reduction then a small one,
with and without the cast and the transposed copy beside it. The operand is produced by an
element-wise op (squared ReLU), as in the model, so XLA may fuse producer, cast and amax.

    python benchmarks/probes/fp8_amax_forms.py
"""

import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.model import layers  # noqa: E402
from maxfp4.precision import formats as F  # noqa: E402
from maxfp4.precision.recipes import _amax as amax_full  # noqa: E402  (the recipes' own form)


def relu2(a):
    """The model's squared ReLU, stored in the activation dtype as mlp_down's input is."""
    return layers.relu2(a).astype(layers.ACT_DTYPE)


def amax_rows(x):
    return jnp.max(jnp.max(jnp.abs(x), axis=1)).astype(jnp.float32)


FORMS = {
    "amax full": lambda a, s: amax_full(relu2(a)),
    "amax rows then all": lambda a, s: amax_rows(relu2(a)),
    "cast": lambda a, s: F.quantize_fp8(relu2(a), s, F.FP8_E5M2),
    "cast + transpose": lambda a, s: F.quantize_fp8(relu2(a), s, F.FP8_E5M2).T,
    "cast + amax full": lambda a, s: (F.quantize_fp8(relu2(a), s, F.FP8_E5M2), amax_full(relu2(a))),
    "cast + amax rows": lambda a, s: (F.quantize_fp8(relu2(a), s, F.FP8_E5M2), amax_rows(relu2(a))),
    "cast + T + amax full": lambda a, s: (F.quantize_fp8(relu2(a), s, F.FP8_E5M2).T, amax_full(relu2(a))),
    "cast + T + amax rows": lambda a, s: (F.quantize_fp8(relu2(a), s, F.FP8_E5M2).T, amax_rows(relu2(a))),
}


def main():
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    s = jnp.float32(64.0)
    for m, k in ((16384, 2048), (16384, 8192), (16384, 8512)):
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        gb = m * k * 2 / 1e9
        for name, fn in FORMS.items():
            ms = median_ms(jax.jit(fn), a, s, iters=30)
            print(f"[{m}, {k}] {name:<24}{ms * 1e3:>9.1f} us  {gb / ms:>6.2f} TB/s of BF16 input", flush=True)


if __name__ == "__main__":
    main()
