"""The global gradient norm and the clipping built on it, against NumPy in float64 and optax."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from maxfp4.optim import clip_by_global_norm, global_norm


def _tree(seed: int, scale: float = 1.0):
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "blocks": {"w_up": scale * jax.random.normal(k[0], (4, 16, 24), jnp.float32),
                   "norm": scale * jax.random.normal(k[1], (4, 16), jnp.float32)},
        "embed": scale * jax.random.normal(k[2], (32, 16), jnp.float32),
        "bias": (scale * jax.random.normal(k[3], (7,), jnp.float32)).astype(jnp.bfloat16),
    }


def test_global_norm_equals_the_float64_norm_of_all_leaves():
    tree = _tree(0, scale=3.0)
    want = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(tree)))
    got = float(jax.jit(global_norm)(tree))
    # FP32 sums of ~2,000 squares in a different order than float64's: well under 1e-6.
    assert abs(got - want) <= 1e-6 * want


def test_clipping_scales_by_max_norm_over_the_norm_only_above_max_norm():
    tree = _tree(1)
    norm = float(global_norm(tree))
    for max_norm in (0.5 * norm, 2.0 * norm):
        got, _ = clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        want, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
        for g, w, x in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(tree)):
            assert g.dtype == x.dtype
            if max_norm > norm:  # untouched, bit for bit
                np.testing.assert_array_equal(np.asarray(g), np.asarray(x))
            # optax's formula with a norm summed in another order (an ulp or two apart), then a
            # division and a product: a few FP32 ulps (2^-19), or one BF16 rounding (2^-7).
            np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                       rtol=2 ** -7 if x.dtype == jnp.bfloat16 else 2 ** -19)
        clipped_norm = float(global_norm(got))
        assert abs(clipped_norm - min(norm, max_norm)) <= 1e-2 * max_norm
