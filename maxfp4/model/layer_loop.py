"""Running a stack of blocks: one ``lax.scan`` over stacked weights, or an unrolled loop.

``train.scan_layers`` picks. A scan compiles one block whatever the depth, but the backward
pass needs each block's residuals, which a scan stacks into [L, ...] buffers: XLA fills each
buffer with zeros before the loop and copies every block's residual into its slice. Unrolled,
each residual is a buffer of its own and XLA schedules and fuses across block boundaries, at
the price of compile time that grows with depth.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def unstack(tree: Any, n: int) -> list[Any]:
    """[n, ...] leaves -> n trees of [...] leaves. Float leaves are split with ``lax.split``,
    whose transpose is one concatenate (indexing ``a[i]`` would transpose to n padded copies of
    the whole stack, added up); PRNG keys and integers carry no gradient and are indexed."""
    def split(a):
        if jnp.issubdtype(a.dtype, jnp.floating):
            return [p[0] for p in jnp.split(a, n, axis=0)]
        return [a[i] for i in range(n)]

    leaves, treedef = jax.tree.flatten(tree)
    parts = [split(a) for a in leaves]
    return [jax.tree.unflatten(treedef, [p[i] for p in parts]) for i in range(n)]


def run_layers(body: Callable, x: Any, xs: Any, n: int, *, scan: bool) -> Any:
    """Apply ``body(x, xs_i) -> (x, _)`` for i < n; ``xs`` has a leading axis of n."""
    if scan:
        x, _ = jax.lax.scan(body, x, xs)
        return x
    for xs_i in unstack(xs, n):
        x, _ = body(x, xs_i)
    return x


def skippable(block: Callable, active: jax.Array, x: Any) -> Any:
    """``block(x)`` where ``active`` (a traced bool) holds, else ``x``: a conditional, so a skipped
    block costs no FLOPs (a select would run it), and its backward pass is skipped with it."""
    return jax.lax.cond(active, block, lambda x: x, x)
