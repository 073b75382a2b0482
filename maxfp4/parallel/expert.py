"""Expert parallelism: running a mixture-of-experts block's experts on each device's tokens,
with the experts split over ``mesh.expert`` and the tokens exchanged by all-to-all.

The block chooses each token's experts over the whole batch (:func:`maxfp4.model.moe.choose_experts`);
this module then runs, under ``shard_map`` over every mesh axis:

1. each device takes its tokens (the batch is split over data, fsdp and expert, each sequence
   over context, and a tensor group's tokens over tensor) and its
   X / mesh.expert experts (the weights' ``experts`` dim is split over ``expert``);
2. with mesh.expert = E > 1, every token-expert assignment is written to the buffer of the
   device that holds its expert (:func:`exchange`): [E, R, D] buffers of R =
   ``model.moe.exchange_slack`` x the even share A / E rows, or, in a step where some device
   sends one destination more than R, [E, A, D] ones (room for every assignment of a device to
   go to one device): nothing is ever dropped for lack of room, and the common step moves and
   computes slack / E of the worst case (``jax.lax.ragged_all_to_all`` would move only the
   filled rows: it is not implemented on the CPU backend of jax 0.10.2);
3. ``all_to_all`` over ``expert`` delivers the buffers, each device runs its experts' grouped
   GEMMs over what it received (empty slots are skipped: their rows sort past every group),
   and a second ``all_to_all`` sends the results back;
4. each token sums its top_k results with its combine weights.

With E = 1 the same runs without the exchange. The expert weights' gradients are summed over the
devices that share them by ``shard_map``'s transpose; the FP8 delayed-scaling amaxes of the expert
GEMMs leave by max over devices (:func:`maxfp4.parallel.mesh.fan_out_max`), as every replica
must use the same scale.

Dimension letters: N tokens (of a device), k top_k, D d_model, A assignments (N x k), E devices
on ``expert``, G experts per device, R rows a buffer holds for one destination.
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
                w_down: jax.Array, lp, expert_ffn: Callable, kind: str, slack: float = 0.0) -> jax.Array:
    """Sum over each token's top_k experts of weight x expert(token), FP32 [N, D]
    (``experts_Nk`` = X marks a dropped assignment). ``slack``: the exchange's buffers
    (:func:`exchange_rows`; 0: the worst case)."""
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
    # The devices of a tensor group hold the same tokens (the activations are whole over tensor);
    # they take a share each here, with every expert whole (Megatron's expert tensor parallelism
    # of 1), rather than each running all of them through the same experts.
    tensor = mesh.shape.get("tensor", 1)
    if tensor > 1 and "tensor" not in mesh.manual_axes and x_ND.shape[0] % (tensor * math.prod(
            mesh.shape[a] for a in rows)) == 0:
        rows = rows + ("tensor",)
    tokens = P(spec_entry(rows))
    experts = P("expert") if ep > 1 else P()
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
        return _on_device(x, e, w, up, down, sc, k, lp=lp, expert_ffn=expert_ffn, kind=kind, ep=ep, slack=slack,
                          axes=agreed)

    in_specs = (tokens, tokens, tokens, experts, experts, {c: everywhere for c in fanned}, P())
    return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=tokens, check_vma=False)(
        x_ND, experts_Nk, weights_Nk, w_up, w_down, fanned, key)


def _on_device(x_ND, experts_Nk, weights_Nk, w_up, w_down, scales, key, *, lp, expert_ffn, kind, ep, slack, axes):
    n, k = experts_Nk.shape
    g = w_up.shape[0]  # experts on this device
    x_total = g * ep
    # Only what crossed into shard_map: the block's other per-block inputs stay outside.
    lp = dataclasses.replace(lp, scales=scales, key=key, class_keys=None)  # (derived from key in here)
    experts_A = experts_Nk.reshape(-1)
    rows_AD = jnp.repeat(x_ND, k, axis=0)
    if ep == 1:
        out_AD = expert_ffn(rows_AD, experts_A, w_up, w_down, lp, kind)
    else:
        valid_A = experts_A < x_total
        compute = lambda recv_RD, local_R: expert_ffn(recv_RD, local_R, w_up, w_down, lp, kind)  # noqa: E731
        out_AD, _ = exchange(rows_AD, jnp.where(valid_A, experts_A // g, ep), jnp.where(valid_A, experts_A % g, g),
                             ep, g, compute, slack, axes)
    out_NkD = out_AD.reshape(n, k, -1).astype(jnp.float32)
    return jnp.sum(out_NkD * weights_Nk[..., None], axis=1)


def exchange(rows_AD: jax.Array, dest_A: jax.Array, local_A: jax.Array, ep: int, empty: int, compute: Callable,
             slack: float, axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """Under shard_map: each assignment's row to device ``dest_A`` (ep: dropped upstream, comes
    back 0) over ``expert``, ``compute(rows_RD, local_R)`` there on what arrived (``local_R``: the
    expert on that device, ``empty`` for an empty row), and its result back. Returns the results [A, D]
    and whether the worst-case buffers were taken (agreed over ``axes``).

    Dropless either way: [E, R, D] buffers of :func:`exchange_rows` rows unless some device sends
    one destination more than R; then every device takes [E, A, D] ones (the predicate is agreed
    over ``axes``, so the collectives of the branch taken match)."""
    a = rows_AD.shape[0]
    valid_A = dest_A < ep
    onehot_AE = jax.nn.one_hot(dest_A, ep, dtype=jnp.int32)
    slot_A = jnp.sum((jnp.cumsum(onehot_AE, axis=0) - 1) * onehot_AE, axis=-1)

    def through(rows: int) -> jax.Array:
        send_ERD = jnp.zeros((ep, rows, rows_AD.shape[1]), rows_AD.dtype).at[dest_A, slot_A].set(rows_AD, mode="drop")
        send_ER = jnp.full((ep, rows), empty, jnp.int32).at[dest_A, slot_A].set(local_A, mode="drop")
        recv_ERD = jax.lax.all_to_all(send_ERD, "expert", 0, 0)
        recv_ER = jax.lax.all_to_all(send_ER, "expert", 0, 0)
        done = compute(recv_ERD.reshape(ep * rows, -1), recv_ER.reshape(-1))
        back_ERD = jax.lax.all_to_all(done.reshape(ep, rows, -1), "expert", 0, 0)
        return jnp.where(valid_A[:, None], back_ERD[jnp.minimum(dest_A, ep - 1), slot_A], 0)

    rows = exchange_rows(a, ep, slack)
    if rows == a:
        return through(a), jnp.array(True)
    overflow = jnp.max(jnp.sum(onehot_AE, axis=0)) > rows
    if axes:
        overflow = jax.lax.pmax(overflow, axes)
    return jax.lax.cond(overflow, lambda: through(a), lambda: through(rows)), overflow
