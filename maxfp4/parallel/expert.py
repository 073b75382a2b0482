"""Expert parallelism: running a mixture-of-experts block's experts on each device's tokens,
with the experts split over ``mesh.expert`` and the tokens exchanged by all-to-all.

The block chooses each token's experts over the whole batch (:func:`maxfp4.model.moe.choose_experts`);
this module then runs, under ``shard_map`` over every mesh axis:

1. each device takes its tokens (the batch is split over data, fsdp and expert, each sequence
   over context, and a tensor group's tokens over tensor) and its
   X / mesh.expert experts (the weights' ``experts`` dim is split over ``expert``). With
   ``model.moe.expert_tensor_parallel`` the tensor axis splits each expert's hidden units
   instead: every rank of a tensor group takes the group's tokens and 1/tensor of each
   expert's w_up and w_down, and the outputs are summed over tensor at the end (Megatron's
   expert tensor parallelism; the default, tokens split, is its expert tensor size 1);
2. each token-expert assignment gets a slot in a send buffer (:func:`exchange_plan`: the
   assignments sorted by expert, which groups them by the device holding the expert), and the
   tokens move straight into those slots (:func:`move_rows`, gathers both ways). With
   mesh.expert = E > 1 the buffers are [E, R, D] of R = ``model.moe.exchange_slack`` x the even
   share A / E rows, or, in a step where some device sends one destination more than R,
   [E, A, D] ones (room for every assignment of a device to go to one device): nothing is ever
   dropped for lack of room, and the common step moves and computes slack / E of the worst case
   (``jax.lax.ragged_all_to_all`` would move only the filled rows: it is not implemented on the
   CPU backend of jax);
3. ``all_to_all`` over ``expert`` delivers the buffers, each device sorts what it received by its
   local expert and runs the grouped GEMMs over it (empty slots sort past every group), and a
   second ``all_to_all`` sends the results back; with E = 1 the send buffer is already in expert
   order and goes straight to the grouped GEMMs;
4. each token sums its top_k results with its combine weights.

The expert weights' gradients are summed over the devices that share them by ``shard_map``'s
transpose; the FP8 delayed-scaling amaxes of the expert GEMMs leave by max over devices
(:func:`maxfp4.parallel.mesh.fan_out_max`), as every replica must use the same scale.

Dimension letters: N tokens (of a device), k top_k, D d_model, A assignments (N x k), E devices
on ``expert``, G experts per device, R rows a buffer holds for one destination, S = E x R slots.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxfp4.parallel.mesh import entry_axes, fan_out_max, logical_to_spec, spec_entry, traced_mesh

EXPERT_CLASSES = ("expert_up", "expert_down")


def exchange_rows(assignments: int, ep: int, slack: float) -> int:
    """Rows of each destination's send buffer in the common case: ``slack`` x the even share
    (assignments / ep), rounded up to 8 rows, at most every assignment (the worst case)."""
    if slack <= 0:
        return assignments
    return min(assignments, 8 * math.ceil(slack * assignments / ep / 8))


def run_experts(x_ND: jax.Array, experts_Nk: jax.Array, weights_Nk: jax.Array, w_up: jax.Array,
                w_down: jax.Array, lp, expert_ffn: Callable, kind: str, slack: float = 0.0,
                expert_tensor: bool = False) -> jax.Array:
    """Sum over each token's top_k experts of weight x expert(token), FP32 [N, D]
    (``experts_Nk`` = X marks a dropped assignment). ``slack``: the exchange's buffers
    (:func:`exchange_rows`; 0: the worst case). ``expert_tensor``: each expert's hidden units
    split over ``tensor`` (w_up [X, D, F, gates] on F, w_down [X, F, D] on F), each tensor rank
    running the group's tokens through its share and the outputs summed over tensor."""
    mesh = traced_mesh()
    scales = {c: lp.scales[c] for c in EXPERT_CLASSES if lp.scales and c in lp.scales}
    if mesh is None or mesh.size == 1:
        return _on_device(x_ND, experts_Nk, weights_Nk, w_up, w_down, scales, lp.key, lp=lp,
                          expert_ffn=expert_ffn, kind=kind, ep=1, slack=slack, axes=())
    ep = mesh.shape.get("expert", 1)
    # The tokens' rows as the batch is split; N = B x T keeps each row's tokens together, and
    # under a context split the rows are rank-major (maxfp4.precision.recipes.flat): each
    # context rank's tokens, then each batch shard's.
    rows = entry_axes(logical_to_spec(("batch",), (x_ND.shape[0],), mesh)[0])
    if mesh.shape.get("context", 1) > 1 and "context" not in mesh.manual_axes:
        rows = ("context",) + rows
    # The devices of a tensor group hold the same tokens; by default they take a share each here,
    # with every expert whole (Megatron's expert tensor parallelism of 1), rather than each
    # running all of them through the same experts. With ``expert_tensor`` each takes all of them
    # and its share of every expert's hidden units.
    tensor = mesh.shape.get("tensor", 1)
    splits_tensor = tensor > 1 and "tensor" not in mesh.manual_axes
    split_experts = expert_tensor and splits_tensor  # else the tokens, where they divide
    if (splits_tensor and not split_experts
            and x_ND.shape[0] % (tensor * math.prod(mesh.shape[a] for a in rows)) == 0):
        rows = rows + ("tensor",)
    tokens = P(spec_entry(rows))
    by_expert = "expert" if ep > 1 else None
    hidden = "tensor" if split_experts else None
    up, down = P(by_expert, None, hidden, None), P(by_expert, hidden, None)
    # The axes this shard_map splits: an axis an enclosing one made manual (pipeline stages) is
    # split already, runs other blocks at the same time or skips this one
    # (maxfp4.parallel.pipeline_stages.StageProgram). The exchange's choice of buffers is agreed
    # over these axes only, and the FP8 scales fan out to their devices.
    agreed = tuple(a for a in mesh.axis_names if a not in mesh.manual_axes)
    everywhere = P(agreed)
    fanned = fan_out_max(scales, jnp.ones((math.prod(mesh.shape[a] for a in agreed),), bool))  # every device's amax
    key = lp.key if lp.key is not None else jax.random.key(0)

    def per_device(x, e, w, up, down, sc, k):
        sc = {c: s[0] for c, s in sc.items()}
        y = _on_device(x, e, w, up, down, sc, k, lp=lp, expert_ffn=expert_ffn, kind=kind, ep=ep, slack=slack,
                       axes=agreed)
        # Each tensor rank's share of the hidden units gave its part of every token's output.
        return jax.lax.psum(y, "tensor") if split_experts else y

    in_specs = (tokens, tokens, tokens, up, down, {c: everywhere for c in fanned}, P())
    return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=tokens, check_vma=False)(
        x_ND, experts_Nk, weights_Nk, w_up, w_down, fanned, key)


def _on_device(x_ND, experts_Nk, weights_Nk, w_up, w_down, scales, key, *, lp, expert_ffn, kind, ep, slack, axes):
    n, k = experts_Nk.shape
    g = w_up.shape[0]  # experts on this device
    # Only what crossed into shard_map: the block's other per-block inputs stay outside.
    lp = dataclasses.replace(lp, scales=scales, key=key, class_keys=None)  # (derived from key in here)
    compute = lambda sorted_MD, sizes_G: expert_ffn(sorted_MD, sizes_G, w_up, w_down, lp, kind)  # noqa: E731
    out_AD, _ = exchange(x_ND, experts_Nk.reshape(-1), k, g, ep, compute, slack, axes)
    out_NkD = out_AD.reshape(n, k, -1).astype(jnp.float32)
    return jnp.sum(out_NkD * weights_Nk[..., None], axis=1)


@jax.custom_vjp
def move_rows(x_ID: jax.Array, src_O: jax.Array, back_IK: jax.Array) -> jax.Array:
    """Rows of ``x`` to new places: ``out[o] = x[src[o]]``, a zero row where ``src[o]`` = I.
    ``back_IK`` lists each row's K places in ``out`` (O: none), so that the transpose is a gather
    and a sum over K too: autodiff's transpose of a gather is a scatter-add, several times
    slower on a GPU for rows of a few kilobytes (the expert exchange's buffers spent more time in
    them than in the experts' GEMMs). The sum over K is in FP32."""
    return _take_rows(x_ID, src_O)


def _take_rows(x_ID, idx):
    return jnp.take(x_ID, idx, axis=0, mode="fill", fill_value=0)


def _move_rows_fwd(x_ID, src_O, back_IK):
    return _take_rows(x_ID, src_O), (src_O, back_IK)


def _move_rows_bwd(res, dout_OD):
    src_O, back_IK = res
    i, k = back_IK.shape
    if k == 1:
        dx_ID = _take_rows(dout_OD, back_IK[:, 0])
    else:
        picked = _take_rows(dout_OD, back_IK.reshape(-1)).reshape(i, k, -1)
        dx_ID = jnp.sum(picked.astype(jnp.float32), axis=1).astype(dout_OD.dtype)
    return dx_ID, None, None


move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def _counts(ids: jax.Array, n: int) -> jax.Array:
    """int32 [n]: how many of ``ids`` are each of 0..n-1 (ids of n or more, dropped or empty, not
    counted)."""
    return jnp.bincount(jnp.minimum(ids, n), length=n + 1)[:n].astype(jnp.int32)


def _sorted_by(keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the stable sort's order: sorted position -> index, and its inverse: index -> sorted
    position), int32."""
    order = jnp.argsort(keys, stable=True)
    size = keys.shape[0]
    position = jnp.zeros((size,), jnp.int32).at[order].set(jnp.arange(size, dtype=jnp.int32), unique_indices=True)
    return order, position


def exchange_plan(experts_A: jax.Array, g: int, ep: int, rows: int) -> tuple[jax.Array, jax.Array]:
    """Where each assignment travels, as index arithmetic (no row moves): the assignments sorted
    by expert (a device's experts are consecutive, so this groups them by destination device and,
    within one, by its local expert) and laid out as ``ep`` buffers of ``rows`` slots. Returns each
    assignment's slot ``slot_A`` (ep x rows for a dropped one, expert id = g x ep) and each slot's
    assignment ``assignment_S`` (A for an empty slot). ``rows`` must hold what any destination
    gets (:func:`exchange` checks)."""
    a = experts_A.shape[0]
    order_A, position_A = _sorted_by(experts_A)
    dest_A = jnp.minimum(experts_A // g, ep)  # ep: dropped
    sent_E = _counts(dest_A, ep)
    start_E = jnp.cumsum(sent_E) - sent_E
    kept_A = dest_A < ep
    to_A = jnp.minimum(dest_A, ep - 1)
    slot_A = jnp.where(kept_A, to_A * rows + position_A - start_E[to_A], ep * rows)
    slot_R = jnp.arange(rows, dtype=jnp.int32)
    filled_ER = slot_R[None, :] < sent_E[:, None]
    assignment_ER = jnp.where(filled_ER, order_A[jnp.minimum(start_E[:, None] + slot_R[None, :], a - 1)], a)
    return slot_A, assignment_ER.reshape(-1)


def exchange(x_ND: jax.Array, experts_A: jax.Array, k: int, g: int, ep: int, compute: Callable, slack: float,
             axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """Under shard_map: each token's k assignments (``experts_A``, token-major, global expert ids;
    g x ep: dropped, comes back 0) to the device holding the expert over ``expert``,
    ``compute(rows_MD, sizes_G)`` there on what arrived sorted by its G local experts (rows past
    the groups are empty), and the results back, [A, D] in the assignments' order. Returns them
    and whether the worst-case buffers were taken (agreed over ``axes``).

    The rows move by :func:`move_rows` only: tokens straight into the send buffers, the received
    rows into expert order and back, the results out of the buffers. With ep = 1 the send buffer is
    already in expert order and nothing is exchanged. Dropless either way: [E, R, D] buffers of
    :func:`exchange_rows` rows unless some device sends one destination more than R; then every
    device takes [E, A, D] ones (the predicate is agreed over ``axes``, so the collectives of the
    branch taken match)."""
    n, a = x_ND.shape[0], experts_A.shape[0]

    def through(rows: int) -> jax.Array:
        slot_A, assignment_S = exchange_plan(experts_A, g, ep, rows)
        slots = ep * rows
        filled_S = assignment_S < a
        token_S = jnp.where(filled_S, assignment_S // k, n)
        send_SD = move_rows(x_ND, token_S, slot_A.reshape(n, k))
        local_S = jnp.where(filled_S, experts_A[jnp.minimum(assignment_S, a - 1)] % g, g)
        if ep == 1:
            done_SD = compute(send_SD, _counts(local_S, g))
        else:
            recv_SD = jax.lax.all_to_all(send_SD.reshape(ep, rows, -1), "expert", 0, 0).reshape(slots, -1)
            recv_S = jax.lax.all_to_all(local_S.reshape(ep, rows), "expert", 0, 0).reshape(-1)
            # Each source's rows arrive in local-expert order; the grouped GEMMs want all of them.
            order_S, position_S = _sorted_by(recv_S)
            out_SD = compute(move_rows(recv_SD, order_S, position_S[:, None]), _counts(recv_S, g))
            out_SD = move_rows(out_SD, position_S, order_S[:, None])
            done_SD = jax.lax.all_to_all(out_SD.reshape(ep, rows, -1), "expert", 0, 0).reshape(slots, -1)
        return move_rows(done_SD, slot_A, jnp.where(filled_S, assignment_S, a)[:, None])

    rows = exchange_rows(a, ep, slack)  # every assignment with ep = 1
    if rows == a:
        return through(a), jnp.array(True)
    overflow = jnp.max(_counts(experts_A // g, ep)) > rows
    if axes:
        overflow = jax.lax.pmax(overflow, axes)
    return jax.lax.cond(overflow, lambda: through(a), lambda: through(rows)), overflow
