"""Grouped GEMMs on Hopper GPUs by the Mosaic GPU kernels that jax ships
(``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`` and ``transposed_ragged_dot_mgpu``): a
persistent wgmma kernel that walks each expert's run of sorted rows, where XLA's GPU lowering of
``jax.lax.ragged_dot`` expands the groups densely (about 1% of the BF16 peak on an H200,
docs/MOE.md).

The three GEMMs of an expert layer, ``y[m] = x[m] @ w[g(m)]`` over rows sorted by expert:

- :func:`ragged` (fprop) and :func:`ragged_t` (dgrad, ``dy[m] @ w[g(m)]^T``): ``ragged_dot``,
  the second reading w transposed in shared memory;
- :func:`ragged_wgrad` (``dW[g] = X_g^T dY_g``): ``transposed_ragged_dot``, the tokens as the
  ragged contraction.

What differs from ``jax.lax.ragged_dot``'s contract, and is fixed up here:

- the kernels write only the rows of the groups (rows past ``sum(sizes)``, which the MoE block
  uses for dropped or other devices' assignments, are left unwritten) and skip empty groups'
  weight gradients: both are zeroed;
- the output is in the operands' dtype (BF16), FP32 only inside the accumulators: the weight
  gradient is BF16-rounded (Megatron's grouped GEMM without gradient-accumulation fusion does
  the same), and FP8 recipes apply their FP32 scales to the BF16 product (one more rounding than
  a GEMM with a scaling epilogue).

Dimension letters: M rows (sorted by group), K contraction, N output features, G groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxfp4.kernels.launch import on_hopper
from maxfp4.model_spec import mixer_linears
from maxfp4.reliability.signal_exit import stop_handlers_kept


def _tiles(n: int, wgrad: bool) -> dict:
    """Tiles for an output of N columns. A sweep on one H200 (jax 0.11.2, 2026-11-28; 131,072 rows
    in 64 groups, K 2048, N 1536; block_m 64/128 x block_n 128/256 x 2/4 stages x grid_block_n
    1/2) put 64 x 256 with 4 stages first: fprop 514 TF/s with grid_block_n 2, wgrad 649 with 1
    (128 x 128: 493 and 624; 128 x 256 exceeds what the pipeline keeps in flight: ~100)."""
    block_n = 256 if n % 256 == 0 else 128
    grid_block_n = 1 if wgrad or n % (2 * block_n) else 2
    return dict(block_m=64, block_n=block_n, block_k=64, max_concurrent_steps=4, grid_block_n=grid_block_n)


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """A Hopper GPU (sm_90) and the kernels' module in this jax."""
    try:
        if not on_hopper():
            return False
        # The module imports jax's test utilities, which install absl's SIGTERM handler: keep ours.
        with stop_handlers_kept():
            from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu  # noqa: F401
    except Exception:  # any import or backend failure means: use XLA's ragged_dot
        return False
    return True


def tiles_fit(k: int, n: int) -> bool:
    """Whether a [*, K] x [G, K, N] grouped GEMM (and its transposes) tiles with the kernels'
    blocks: K and N multiples of 128."""
    return k % 128 == 0 and n % 128 == 0


def experts_tile(model, tensor: int = 1) -> bool:
    """Whether every expert layer of ``model`` (w_up, w_down: maxfp4.model_spec) tiles, as each of
    ``tensor`` devices holds it (with model.moe.expert_tensor_parallel, 1/tensor of the hidden units)."""
    t = tensor if model.moe.expert_tensor_parallel else 1
    return all(tiles_fit(lin.k // (t if lin.parallel == "row" else 1), lin.n // (t if lin.parallel == "column" else 1))
               for lin in mixer_linears(model, "moe") if lin.experts)


def _rows_of_groups(y_MN: jax.Array, sizes_G: jax.Array) -> jax.Array:
    filled = jnp.arange(y_MN.shape[0]) < jnp.sum(sizes_G)
    return jnp.where(filled[:, None], y_MN, jnp.zeros((), y_MN.dtype))


def ragged(x_MK: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array) -> jax.Array:
    """BF16 ``x[m] @ w[g(m)]`` [M, N]; 0 past the groups."""
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    y = ragged_dot(x_MK, w_GKN, group_sizes=sizes_G.astype(jnp.int32), **_tiles(w_GKN.shape[2], False))
    return _rows_of_groups(y, sizes_G)


def ragged_t(dy_MN: jax.Array, w_GKN: jax.Array, sizes_G: jax.Array) -> jax.Array:
    """BF16 ``dy[m] @ w[g(m)]^T`` [M, K]; 0 past the groups."""
    from jax.experimental.pallas.ops.gpu.ragged_dot_mgpu import ragged_dot
    y = ragged_dot(dy_MN, w_GKN, group_sizes=sizes_G.astype(jnp.int32), transpose_rhs=True,
                   **_tiles(w_GKN.shape[1], False))
    return _rows_of_groups(y, sizes_G)


def ragged_wgrad(x_MK: jax.Array, dy_MN: jax.Array, sizes_G: jax.Array) -> jax.Array:
    """BF16 ``dW[g] = X_g^T dY_g`` [G, K, N]; 0 for an empty group."""
    from jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu import transposed_ragged_dot
    dw = transposed_ragged_dot(x_MK, dy_MN, group_sizes=sizes_G.astype(jnp.int32), **_tiles(dy_MN.shape[1], True))
    return jnp.where((sizes_G > 0)[:, None, None], dw, jnp.zeros((), dw.dtype))
