"""Context parallelism: the ``context`` mesh axis splits every sequence of the batch.

Layout ("zigzag", the load-balanced order of ring-attention implementations): the sequence of T
tokens is cut into 2C chunks of S = T / 2C tokens, and context rank r holds chunks r and
2C-1-r, side by side. Under causal attention chunk j attends to j+1 chunks, so every rank
attends to (r+1) + (2C-r) = 2C+1 chunk pairs: the same causal work on every rank.

The step permutes the batch into this order once (:func:`to_zigzag`: tokens, targets, positions,
segment ids and the loss mask together) and the logical ``seq`` axis maps to ``context``
(maxfp4.parallel.mesh), so every per-token op (embedding, norms, MLPs, RoPE with the permuted
positions, the loss) runs unchanged on each rank's 2S tokens. Only the ops that mix tokens know
about the split:

- attention (:func:`context_attention`): keys and values are all-gathered over ``context``
  once a layer (the kv heads only: GQA moves K/N of the query bytes), and each rank's queries
  attend to them through a mask built from the tokens' original indices and segment ids;
- Mamba-2 (maxfp4.model.mamba): each rank runs its two chunks with a zero initial state, the
  chunks' final states and decays are all-gathered (:func:`gather_chunks`), and the
  convolution's window comes from the previous chunk (:func:`from_previous_chunk`).

Dimension letters: B batch, T sequence (per rank inside ``shard_map``), S tokens of one chunk,
C context ranks, N query heads, K kv heads, H head dim.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maxfp4.kernels import cudnn_attention
from maxfp4.parallel.mesh import constrain, logical_to_spec, per_device, traced_mesh

AXIS = "context"


def context_ranks() -> int:
    """Devices on the ``context`` axis of the mesh the step is traced under (1 without one)."""
    mesh = traced_mesh()
    return 1 if mesh is None else mesh.shape.get(AXIS, 1)


def zigzag_order(t: int, c: int) -> np.ndarray:
    """Original token index at each position of the zigzag layout: [chunk 0, chunk 2C-1, chunk 1,
    chunk 2C-2, ...], so rank r's contiguous block of T/C holds chunks r and 2C-1-r."""
    s = t // (2 * c)
    chunks = [j for r in range(c) for j in (r, 2 * c - 1 - r)]
    return np.concatenate([np.arange(j * s, (j + 1) * s) for j in chunks])


def to_zigzag(batch: dict[str, jax.Array], c: int) -> dict[str, jax.Array]:
    """Every [B, T] array of ``batch`` in the zigzag order, its T split over ``context``."""
    if c == 1:
        return batch

    def permute(x):
        return constrain(x[:, zigzag_order(x.shape[1], c)], ("batch", "seq"))
    return {k: permute(v) for k, v in batch.items()}


def rank_chunks(rank, c: int):
    """The original chunk ids (r, 2C-1-r) rank ``rank`` holds, first and second half."""
    return rank, 2 * c - 1 - rank


def rank_token_index(rank, t_local: int, c: int) -> jax.Array:
    """[2S] original index of each of rank ``rank``'s tokens."""
    s = t_local // 2
    first, second = rank_chunks(rank, c)
    return jnp.concatenate([first * s + jnp.arange(s), second * s + jnp.arange(s)])


def rank_attention_mask(q_index_Q: jax.Array, k_index_K: jax.Array, seg_q_BQ: jax.Array,
                        seg_k_BK: jax.Array) -> jax.Array:
    """[B, 1, Q, K]: query attends to key iff the key is not later in the original sequence
    and both are in one segment (the mask of ``attend`` with ``is_causal`` on the whole row)."""
    causal_QK = k_index_K[None, :] <= q_index_Q[:, None]
    same_BQK = seg_q_BQ[:, :, None] == seg_k_BK[:, None, :]
    return (causal_QK[None] & same_BQK)[:, None]


def _specs(arrays: Sequence[jax.Array], logical: Sequence[tuple[str | None, ...]], mesh) -> list[PartitionSpec]:
    """Each array's spec from its logical axes, with ``seq`` on ``context`` (mesh.LOGICAL_RULES)."""
    return [logical_to_spec(axes, a.shape, mesh) for a, axes in zip(arrays, logical)]


# Scores a rank materialises at once in XLA's attention (FP32 elements, 1 GiB): past it the
# queries go in blocks, each recomputed in the backward pass. Llama-3-8B at 65,536 tokens on 4
# ranks would otherwise hold 32 heads x 16k x 64k scores a layer (128 GiB).
MAX_SCORES = 2**28


def query_block(t_local: int, rows_times_heads: int, t: int, max_scores: int) -> int:
    """The largest divisor of ``t_local`` whose scores (rows x heads x block x t) fit ``max_scores``."""
    fit = max(1, max_scores // (rows_times_heads * t))
    return max(d for d in range(1, t_local + 1) if t_local % d == 0 and d <= fit)


def context_attention(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, segment_ids_BT: jax.Array,
                      implementation: str, max_scores: int = MAX_SCORES) -> jax.Array:
    """Causal attention of the zigzag-ordered sequence split over ``context``.

    All-gather rather than a ring of ppermutes: with GQA the gathered K and V are K/N of the
    queries' bytes, one collective a layer is simpler to keep exact (packed documents, the
    mask from original indices) and is what Megatron and MaxText use at moderate C; the ring
    pays off when K and V of the whole sequence do not fit, which a hybrid's few attention
    layers rarely reach. ``implementation``: ``cudnn`` or ``cudnn_mask`` run cuDNN's fused
    kernel (:func:`_fused_rank_attention`), anything else XLA's, whose queries go in blocks of
    at most ``max_scores`` scores (:data:`MAX_SCORES`), each recomputed in the backward pass."""
    mesh = traced_mesh()
    c = mesh.shape[AXIS]
    fused = implementation in ("cudnn", "cudnn_mask")
    q_spec, k_spec, v_spec, seg_spec = _specs(
        (q_BTNH, k_BTKH, v_BTKH, segment_ids_BT),
        (("batch", "seq", "heads", None), ("batch", "seq", "kv_heads", None),
         ("batch", "seq", "kv_heads", None), ("batch", "seq")), mesh)

    def local(q, k, v, seg):
        b, t_local, n, _ = q.shape
        k_all = jax.lax.all_gather(k, AXIS, axis=1, tiled=True)
        v_all = jax.lax.all_gather(v, AXIS, axis=1, tiled=True)
        seg_all = jax.lax.all_gather(seg, AXIS, axis=1, tiled=True)
        if fused:
            return _fused_rank_attention(q, k, v, seg, k_all, v_all, seg_all, c)
        q_index = rank_token_index(jax.lax.axis_index(AXIS), t_local, c)
        k_index = jnp.asarray(zigzag_order(t_local * c, c))

        def attend_block(q_blk, q_index_blk, seg_blk):
            mask = rank_attention_mask(q_index_blk, k_index, seg_blk, seg_all)
            return jax.nn.dot_product_attention(q_blk, k_all, v_all, mask=mask, implementation="xla")

        qb = query_block(t_local, b * n, t_local * c, max_scores)
        if qb == t_local:
            return attend_block(q, q_index, seg)
        nb = t_local // qb
        blocks = (jnp.moveaxis(q.reshape(b, nb, qb, *q.shape[2:]), 1, 0), q_index.reshape(nb, qb),
                  jnp.moveaxis(seg.reshape(b, nb, qb), 1, 0))
        out = jax.lax.map(lambda xs: jax.checkpoint(attend_block)(*xs), blocks)
        return jnp.moveaxis(out, 0, 1).reshape(q.shape)

    return jax.shard_map(local, mesh=mesh, in_specs=(q_spec, k_spec, v_spec, seg_spec), out_specs=q_spec,
                         check_vma=False)(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)


def _fused_rank_attention(q_B2SNH, k_B2SKH, v_B2SKH, seg_B2S, k_all, v_all, seg_all, c: int):
    """One rank's attention by cuDNN (inside ``shard_map``): each of its two chunks j attends to
    (1) its own keys, causal within the chunk and its documents (the segment mask as a bias of
    S x S), and (2) the keys before the chunk, where only the chunk's leading run of tokens (if
    its document began in an earlier chunk) sees anything: keys from that document's start up to
    the chunk, handed to cuDNN as a padded prefix of the keys rolled to start there. The two
    parts merge by their log-sum-exp (maxfp4.kernels.cudnn_attention.attention_merged), so only
    causal work is done, with no T-wide mask."""
    s = q_B2SNH.shape[1] // 2
    t = s * 2 * c
    to_original = np.argsort(zigzag_order(t, c))
    k_orig, v_orig, seg_orig = k_all[:, to_original], v_all[:, to_original], seg_all[:, to_original]
    index_T = jnp.arange(t)
    outs = []
    for half, chunk in enumerate(rank_chunks(jax.lax.axis_index(AXIS), c)):
        part = slice(half * s, (half + 1) * s)
        q, seg = q_B2SNH[:, part], seg_B2S[:, part]
        same_B1SS = (seg[:, :, None] == seg[:, None, :])[:, None]
        own = (k_B2SKH[:, part], v_B2SKH[:, part], cudnn_attention.Mask(causal=True, allowed_B1TS=same_B1SS))
        first = chunk * s  # the chunk's first original index
        before_B = seg_orig[:, jnp.maximum(first - 1, 0)]  # segment of the token before the chunk
        continues_B = (chunk > 0) & (seg[:, 0] == before_B)
        # the document's start: one past the last earlier token of another segment
        other_BT = (index_T[None] < first) & (seg_orig != before_B[:, None])
        start_B = jnp.max(jnp.where(other_BT, index_T[None], -1), axis=1) + 1
        differs_BS = seg != seg[:, :1]
        run_B = jnp.where(jnp.any(differs_BS, axis=1), jnp.argmax(differs_BS, axis=1), s)
        rolled_BT = (start_B[:, None] + index_T[None]) % t
        k_prev = jnp.take_along_axis(k_orig, rolled_BT[:, :, None, None], axis=1)
        v_prev = jnp.take_along_axis(v_orig, rolled_BT[:, :, None, None], axis=1)
        earlier = (k_prev, v_prev, cudnn_attention.Mask(q_lengths_B=jnp.where(continues_B, run_B, 0),
                                                        kv_lengths_B=jnp.where(continues_B, first - start_B, 0)))
        outs.append(cudnn_attention.attention_merged(q, [own, earlier]))
    return jnp.concatenate(outs, axis=1)


def per_context_rank(fn: Callable, batched: Sequence[jax.Array], whole: Sequence[Any],
                     tensor: bool = False) -> jax.Array:
    """``fn(*batched, *whole)`` on each device's rows and its context rank's 2S tokens: every
    array in ``batched`` and the output is [B, T, ...], split over the batch axes and ``context``;
    ``whole`` (parameters) is given whole to every device. ``fn`` may use the collectives below.
    ``tensor``: the last dim of the first array in ``batched`` and of the output is split over
    ``tensor`` too (``jax.lax.axis_index("tensor")`` says which block a device has)."""
    mesh = traced_mesh()
    rows_and_tokens = PartitionSpec(logical_to_spec(("batch",), batched[0].shape[:1], mesh)[0], AXIS)
    first = rows_and_tokens
    if tensor:
        first = PartitionSpec(*rows_and_tokens, *([None] * (batched[0].ndim - 3)), "tensor")
    return per_device(fn, batched, whole, first, rows_and_tokens, mesh)


def gather_chunks(x_B2X: jax.Array) -> jax.Array:
    """Inside :func:`per_context_rank`: [B, 2, ...] per-chunk values of this rank's two chunks ->
    [2C, B, ...] every chunk's, in the original chunk order."""
    g_CB2X = jax.lax.all_gather(x_B2X, AXIS, axis=0)
    # Rank r holds chunks r (first half) and 2C-1-r (second half).
    return jnp.concatenate([g_CB2X[:, :, 0], g_CB2X[::-1, :, 1]], axis=0)


def own_chunks(x_JBX: jax.Array) -> jax.Array:
    """[2C, B, ...] per original chunk -> [B, 2, ...] this rank's two chunks."""
    c = x_JBX.shape[0] // 2
    first, second = rank_chunks(jax.lax.axis_index(AXIS), c)
    return jnp.stack([x_JBX[first], x_JBX[second]], axis=1)


def from_previous_chunk(x_B2X: jax.Array, fill) -> jax.Array:
    """Inside :func:`per_context_rank`: for each of this rank's two chunks, the value ``x`` holds
    for the chunk before it in the original order (``fill`` before chunk 0)."""
    all_JBX = gather_chunks(x_B2X)
    previous_JBX = jnp.concatenate([jnp.full_like(all_JBX[:1], fill), all_JBX[:-1]], axis=0)
    return own_chunks(previous_JBX)
