"""Mamba-2 state-space-duality (SSD) core over packed sequences, in plain jax.numpy.

Dimension letters: B batch, T sequence, H heads, P head dim, G groups of B/C (H = G*R, head h
uses group h // R), R heads per group, N state size, K chunks, Q positions inside a chunk
(``..QQ`` is [query position, key position]).

Per head, with a_t = dt_t * A (negative) and the state h_t of shape [P, N]:

    h_t = exp(a_t) * h_{t-1} + dt_t * outer(x_t, B_t)          y_t[p] = sum_n h_t[p, n] C_t[n]

At the first token of a segment (segment id differs from the previous token's) the carried
state is dropped before that token's input is added, so no information crosses a document
boundary. A segment is a contiguous run of one id: an id that comes back later starts a new
segment. No D skip and no gating here; the caller adds them.

Everything (A, dt, decays, segment sums, states, and the x/B/C products) is computed in FP32,
or in float64 when an input is float64; the output has x's dtype. Matmuls ask for HIGHEST
precision so that FP32 operands are not rounded to TF32 on GPU. ``ssd_chunked(...,
matmul_dtype=jnp.bfloat16)`` instead feeds the four token-length matmuls (C.B, the masked
product with x, the chunk states, and C times the entry states) BF16 operands with FP32
accumulation, as Mamba-2's Triton kernels do; on Hopper that moves them from FP32 CUDA cores
(~60 TFLOP/s) to tensor cores. Decays, segment sums, the inter-chunk recurrence and the
states themselves stay FP32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxfp4.kernels.ssd_ops import check_shapes, compute_dtype, lowp_einsum, masked_exp, segment_starts

_HIGHEST = jax.lax.Precision.HIGHEST
_einsum = functools.partial(jnp.einsum, precision=_HIGHEST)


def ssd_reference(x_BTHP: jax.Array, dt_BTH: jax.Array, A_H: jax.Array, B_BTGN: jax.Array,
                  C_BTGN: jax.Array, segment_ids_BT: jax.Array) -> jax.Array:
    """The recurrence as a sequential scan over T: O(T) steps, the ground truth for tests."""
    g, r = check_shapes(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, segment_ids_BT)
    b, t, h, p = x_BTHP.shape
    n = B_BTGN.shape[-1]
    cdt = compute_dtype(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN)
    # Heads split as [G, R] so that B and C broadcast over R instead of being copied H times.
    x_TBGRP = jnp.moveaxis(x_BTHP.astype(cdt).reshape(b, t, g, r, p), 1, 0)
    dt_TBGR = jnp.moveaxis(dt_BTH.astype(cdt).reshape(b, t, g, r), 1, 0)
    A_GR = A_H.astype(cdt).reshape(g, r)
    B_TBGN = jnp.moveaxis(B_BTGN.astype(cdt), 1, 0)
    C_TBGN = jnp.moveaxis(C_BTGN.astype(cdt), 1, 0)
    start_TB = jnp.moveaxis(segment_starts(segment_ids_BT), 1, 0)

    def step(h_BGRPN, inputs):
        x_BGRP, dt_BGR, B_BGN, C_BGN, start_B = inputs
        decayed_BGRPN = jnp.exp(dt_BGR * A_GR)[..., None, None] * h_BGRPN
        # Reset by select, not by multiplying with 0: a state that overflowed in another
        # segment must not leak NaN (0 * inf) into this one.
        carried_BGRPN = jnp.where(start_B[:, None, None, None, None], 0.0, decayed_BGRPN)
        h_BGRPN = carried_BGRPN + (dt_BGR[..., None] * x_BGRP)[..., None] * B_BGN[:, :, None, None, :]
        y_BGRP = _einsum("bgrpn,bgn->bgrp", h_BGRPN, C_BGN)
        return h_BGRPN, y_BGRP

    h0_BGRPN = jnp.zeros((b, g, r, p, n), cdt)
    _, y_TBGRP = jax.lax.scan(step, h0_BGRPN, (x_TBGRP, dt_TBGR, B_TBGN, C_TBGN, start_TB))
    return jnp.moveaxis(y_TBGRP, 0, 1).reshape(b, t, h, p).astype(x_BTHP.dtype)


def _segsum(a_XQ: jax.Array) -> jax.Array:
    """[..., Q, Q] with out[i, j] = sum_{k=j+1..i} a[k] for i >= j (0 above the diagonal).

    Built by a cumulative sum over i of a[i] masked to i > j, so every entry sums only its own
    terms. The shortcut cumsum[i] - cumsum[j] cancels catastrophically once the running sum is
    large (strong decay over a long chunk) and is inf - inf = NaN once it overflows.
    """
    q = a_XQ.shape[-1]
    below_QQ = jnp.tril(jnp.ones((q, q), dtype=bool), k=-1)
    terms_XQQ = jnp.where(below_QQ, a_XQ[..., :, None], 0.0)
    return jnp.cumsum(terms_XQQ, axis=-2)


def _token_matmul(spec: str, lhs: jax.Array, rhs: jax.Array, matmul_dtype, cdt) -> jax.Array:
    """A token-length matmul: HIGHEST in ``cdt``, or ``matmul_dtype`` operands accumulated in
    ``cdt`` (model.mamba.ssd_matmul)."""
    if matmul_dtype is None:
        return _einsum(spec, lhs, rhs)
    return lowp_einsum(spec, lhs.astype(matmul_dtype), rhs.astype(matmul_dtype), cdt)


def ssd_chunked(x_BTHP: jax.Array, dt_BTH: jax.Array, A_H: jax.Array, B_BTGN: jax.Array,
                C_BTGN: jax.Array, segment_ids_BT: jax.Array, chunk_size: int,
                matmul_dtype: jnp.dtype | None = None) -> jax.Array:
    """The SSD block decomposition (Mamba-2, arXiv 2405.21060, ``ssd_minimal``) with segment
    resets. Work is O(T * Q * (N + P) + T * P * N) per head plus O(K^2 * P * N) for passing
    states between chunks; every step is a batched matmul, nothing is sequential over T.

    Segment resets are boolean masks from cumulative counts of segment starts, never -inf or
    huge negatives in dt*A: positions i >= j of one chunk are in one segment iff no segment
    starts in (j, i], which is an equality of integer counts.
    """
    g, r = check_shapes(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN, segment_ids_BT)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    b, t, h, p = x_BTHP.shape
    q = chunk_size
    k = -(-t // q)
    pad = k * q - t
    cdt = compute_dtype(x_BTHP, dt_BTH, A_H, B_BTGN, C_BTGN)

    def mm(spec, lhs, rhs):
        return _token_matmul(spec, lhs, rhs, matmul_dtype, cdt)

    def chunked(arr):
        # Padding goes after the last token, so it cannot affect any real output (causality);
        # it is zero in every input.
        widths = [(0, 0), (0, pad)] + [(0, 0)] * (arr.ndim - 2)
        arr = jnp.pad(arr, widths) if pad else arr
        return arr.reshape(b, k, q, *arr.shape[2:])

    x_BKQGRP = chunked(x_BTHP.astype(cdt)).reshape(b, k, q, g, r, p)
    dt_BKQGR = chunked(dt_BTH.astype(cdt)).reshape(b, k, q, g, r)
    B_BKQGN = chunked(B_BTGN.astype(cdt))
    C_BKQGN = chunked(C_BTGN.astype(cdt))
    # Padded start flags are False: the padding just extends the last segment.
    start_BKQ = chunked(segment_starts(segment_ids_BT))
    A_GR = A_H.astype(cdt).reshape(g, r)

    dt_BKGRQ = jnp.moveaxis(dt_BKQGR, 2, -1)
    a_BKGRQ = dt_BKGRQ * A_GR[..., None]

    # Segment bookkeeping. starts_before_BKQ[i] = segment starts at positions 0..i of the chunk.
    starts_before_BKQ = jnp.cumsum(start_BKQ.astype(jnp.int32), axis=-1)
    causal_QQ = jnp.tril(jnp.ones((q, q), dtype=bool))
    same_segment_BKQQ = causal_QQ & (starts_before_BKQ[..., :, None] == starts_before_BKQ[..., None, :])
    # Token j still reaches the chunk's end state iff no segment starts after it in the chunk.
    reaches_end_BKQ = starts_before_BKQ == starts_before_BKQ[..., -1:]
    # The state entering the chunk reaches position i iff no segment starts at 0..i.
    sees_entry_BKQ = starts_before_BKQ == 0
    # A state crosses chunk k whole iff no segment starts anywhere in it.
    chunk_starts_BK = jnp.cumsum((starts_before_BKQ[..., -1] > 0).astype(jnp.int32), axis=-1)
    causal_KK = jnp.tril(jnp.ones((k, k), dtype=bool))
    carries_BKK = causal_KK & (chunk_starts_BK[:, :, None] == chunk_starts_BK[:, None, :])

    # (1) Diagonal blocks: y_i = sum_{j<=i, same segment} C_i.B_j * exp(a_{j+1..i}) * dt_j * x_j.
    segsum_BKGRQQ = _segsum(a_BKGRQ)
    L_BKGRQQ = masked_exp(segsum_BKGRQQ, same_segment_BKQQ[:, :, None, None])
    # C.B is per group; it broadcasts over the R heads of the group.
    CB_BKGQQ = mm("bklgn,bksgn->bkgls", C_BKQGN, B_BKQGN)
    M_BKGRQQ = CB_BKGQQ[:, :, :, None] * L_BKGRQQ * dt_BKGRQ[..., None, :]
    y_diag_BKQGRP = mm("bkgrls,bksgrp->bklgrp", M_BKGRQQ, x_BKQGRP)

    # (2) Each chunk's end state from its own tokens. The log decay from token j to the chunk
    # end is the last row of the segment sum (sum of a_{j+1..Q-1}), again without differences.
    to_end_BKGRQ = masked_exp(segsum_BKGRQQ[..., -1, :], reaches_end_BKQ[:, :, None, None])
    weight_BKQGR = jnp.moveaxis(to_end_BKGRQ * dt_BKGRQ, -1, 2)
    states_BKGRPN = mm("bksgn,bksgrp->bkgrpn", B_BKQGN, x_BKQGRP * weight_BKQGR[..., None])

    # (3) Between chunks: end state of chunk z = sum_{s<=z} exp(sum of a over chunks s+1..z)
    # * states[s], kept only where no segment starts in chunks s+1..z. Same stable segsum,
    # over K chunks; parallel (a K x K matmul) rather than a sequential scan.
    chunk_a_BGRK = jnp.moveaxis(jnp.sum(a_BKGRQ, axis=-1), 1, -1)
    chunk_decay_BGRKK = masked_exp(_segsum(chunk_a_BGRK), carries_BKK[:, None, None])
    end_BKGRPN = _einsum("bgrzs,bsgrpn->bzgrpn", chunk_decay_BGRKK, states_BKGRPN)
    # The state entering chunk z is the end state of chunk z-1 (zero for the first chunk).
    entry_BKGRPN = jnp.concatenate([jnp.zeros_like(end_BKGRPN[:, :1]), end_BKGRPN[:, :-1]], axis=1)

    # (4) Entry state to outputs: exp(a_{0..i}) * C_i . entry. A plain inclusive cumsum from
    # the chunk start is a single running sum, no differences involved.
    from_entry_BKGRQ = masked_exp(jnp.cumsum(a_BKGRQ, axis=-1), sees_entry_BKQ[:, :, None, None])
    y_off_BKQGRP = (mm("bklgn,bkgrpn->bklgrp", C_BKQGN, entry_BKGRPN)
                    * jnp.moveaxis(from_entry_BKGRQ, -1, 2)[..., None])

    y_BTHP = (y_diag_BKQGRP + y_off_BKQGRP).reshape(b, k * q, h, p)[:, :t]
    return y_BTHP.astype(x_BTHP.dtype)


# Context parallelism (maxfp4.parallel.context) cuts the sequence into chunks held by different
# devices. Each device runs the SSD above on its chunks with a zero entry state; the three
# functions below then carry the states across chunks with the same recurrence as step (3):
# a chunk's exit state is its decay times its entry state plus the state of its own tokens.
# ``start_BS`` flags a segment start with the original sequence's previous token in view (at
# position 0 too: a chunk can begin a document or continue one).

# Token sums over a chunk run in blocks of this many tokens: a triangular matmul inside each
# block plus one over the blocks' totals. One [S, S] triangle was S^2 work a sum: at S = 8192
# tokens it ran as an FP32 GEMM of ~1 ms, 42 of them a nemotron-h-8b step at context=2
# (32,768 tokens, two H200s, 2026-11-29), where a [S, 128] one costs 1/64 of that.
TOKEN_SUM_BLOCK = 128


def _sum_over_tokens(x_BS: jax.Array, before: bool, block: int = TOKEN_SUM_BLOCK) -> jax.Array:
    """Along axis 1 (S tokens): at each token the sum of the tokens up to it (``before``, itself
    included) or of those after it. Triangular matmuls rather than ``cumsum``: XLA's CPU form of
    a cumulative sum (an associative scan) compiled 4x slower than the rest of the mixer. With S
    a multiple of ``block`` (and more than one block), a block's own triangle plus the sum over
    the whole blocks before (or after) it; the sums are exact in the FP32 (float64) of x."""
    s = x_BS.shape[1]

    def triangle(n: int, strict: bool):  # [n, n] 0/1: row i sums columns j up to i (or after i)
        i_N, j_N = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
        keep = ((j_N < i_N) if strict else (j_N <= i_N)) if before else (j_N > i_N)
        return keep.astype(x_BS.dtype)

    if s % block or s <= block:
        return _einsum("ij,bj...->bi...", triangle(s, strict=False), x_BS)
    k = s // block
    x_BKL = x_BS.reshape(x_BS.shape[0], k, block, *x_BS.shape[2:])
    within_BKL = _einsum("ij,bkj...->bki...", triangle(block, strict=False), x_BKL)
    # The whole blocks strictly before (after) each block.
    across_BK = _einsum("kl,bl...->bk...", triangle(k, strict=True), jnp.sum(x_BKL, axis=2))
    return (within_BKL + across_BK[:, :, None]).reshape(x_BS.shape)


def chunk_exit(x_BSHP: jax.Array, dt_BSH: jax.Array, A_H: jax.Array, B_BSGN: jax.Array,
               start_BS: jax.Array, matmul_dtype=None) -> tuple[jax.Array, jax.Array]:
    """(state [B, G, R, P, N] at the chunk's end from its own tokens, the decay [B, G, R] its
    entry state is carried to the end by: exp(sum of a over the chunk), 0 if a segment starts
    in it), in FP32. ``matmul_dtype`` as ``ssd_chunked``'s: the states' matmul of the weighted
    x and B takes operands of that dtype (BF16: tensor cores), accumulated in FP32."""
    b, s, h, p = x_BSHP.shape
    g, n = B_BSGN.shape[2:]
    r = h // g
    cdt = compute_dtype(x_BSHP, dt_BSH, A_H, B_BSGN, B_BSGN)
    dt_BSGR = dt_BSH.astype(cdt).reshape(b, s, g, r)
    a_BSGR = dt_BSGR * A_H.astype(cdt).reshape(g, r)
    # sum of a over the tokens after s: a sum of its own terms, no differences.
    after_BSGR = _sum_over_tokens(a_BSGR, before=False)
    starts_after_BS = _sum_over_tokens(start_BS.astype(cdt), before=False)
    to_end_BSGR = masked_exp(after_BSGR, (starts_after_BS == 0)[..., None, None])
    x_BSGRP = x_BSHP.astype(cdt).reshape(b, s, g, r, p) * (to_end_BSGR * dt_BSGR)[..., None]
    state_BGRPN = _token_matmul("bsgrp,bsgn->bgrpn", x_BSGRP, B_BSGN.astype(cdt), matmul_dtype, cdt)
    decay_BGR = masked_exp(jnp.sum(a_BSGR, axis=1), ~jnp.any(start_BS, axis=1)[:, None, None])
    return state_BGRPN, decay_BGR


def pass_states(state_JBGRPN: jax.Array, decay_JBGR: jax.Array) -> jax.Array:
    """[J, B, G, R, P, N] the state entering each of J consecutive chunks (zero for the first),
    from each chunk's own exit state and decay (:func:`chunk_exit`). J is small (2 x context
    ranks): a loop over chunks."""
    entry = jnp.zeros_like(state_JBGRPN[0])
    entries = []
    for j in range(state_JBGRPN.shape[0]):
        entries.append(entry)
        entry = decay_JBGR[j][..., None, None] * entry + state_JBGRPN[j]
    return jnp.stack(entries)


def entry_output(C_BSGN: jax.Array, dt_BSH: jax.Array, A_H: jax.Array, start_BS: jax.Array,
                 entry_BGRPN: jax.Array, matmul_dtype=None) -> jax.Array:
    """[B, S, H, P] (FP32) what the state entering the chunk adds to its outputs:
    exp(a_0 + ... + a_i) * C_i . entry, up to the chunk's first segment start. ``matmul_dtype``
    as ``chunk_exit``'s: C and the entry state enter their matmul in it (``ssd_chunked`` rounds
    the entry state the same way for its own chunks)."""
    b, s, h = dt_BSH.shape
    g, r = entry_BGRPN.shape[1:3]
    cdt = entry_BGRPN.dtype
    a_BSGR = dt_BSH.astype(cdt).reshape(b, s, g, r) * A_H.astype(cdt).reshape(g, r)
    sees_entry_BS = _sum_over_tokens(start_BS.astype(cdt), before=True) == 0
    from_entry_BSGR = masked_exp(_sum_over_tokens(a_BSGR, before=True), sees_entry_BS[..., None, None])
    y_BSGRP = (_token_matmul("bsgn,bgrpn->bsgrp", C_BSGN.astype(cdt), entry_BGRPN, matmul_dtype, cdt)
               * from_entry_BSGR[..., None])
    return y_BSGRP.reshape(b, s, h, -1)
