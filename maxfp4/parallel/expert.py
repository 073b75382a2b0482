"""Expert parallelism: running a mixture-of-experts block's experts on each device's tokens,
with the experts split over ``mesh.expert`` and the tokens exchanged by all-to-all.

The block chooses each token's experts over the whole batch (:func:`maxfp4.model.moe.choose_experts`);
this module then runs, under ``shard_map`` over every mesh axis:

1. each device takes its tokens (the batch is split over data, fsdp and expert) and its
   X / mesh.expert experts (the weights' ``experts`` dim is split over ``expert``);
2. with mesh.expert = E > 1, every token-expert assignment is written to the buffer of the
   device that holds its expert: a fixed [E, N_local x top_k, D] buffer, room for every
   assignment of this device to go to one device, so nothing is ever dropped for lack of room
   (``jax.lax.ragged_all_to_all`` would move only the filled rows: it is not implemented on
   the CPU backend of jax 0.10.2, so the fixed buffer is the one form tested here);
3. ``all_to_all`` over ``expert`` delivers the buffers, each device runs its experts' grouped
   GEMMs over what it received (empty slots are skipped: their rows sort past every group),
   and a second ``all_to_all`` sends the results back;
4. each token sums its top_k results with its combine weights.

With E = 1 the same runs without the exchange. The expert weights' gradients are summed over the
devices that share them by ``shard_map``'s transpose; the FP8 delayed-scaling amaxes of the expert
GEMMs leave by max over devices (:func:`maxfp4.parallel.mesh.fan_out_max`), as every replica
must use the same scale.

Dimension letters: N tokens (of a device), k top_k, D d_model, A assignments (N x k), E devices
on ``expert``, G experts per device.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from maxfp4.parallel.mesh import LOGICAL_RULES, fan_out_max, logical_to_spec, traced_mesh

EXPERT_CLASSES = ("expert_up", "expert_down")


def run_experts(x_ND: jax.Array, experts_Nk: jax.Array, weights_Nk: jax.Array, w_up: jax.Array,
                w_down: jax.Array, lp, expert_ffn: Callable, kind: str) -> jax.Array:
    """Sum over each token's top_k experts of weight x expert(token), FP32 [N, D]
    (``experts_Nk`` = X marks a dropped assignment)."""
    mesh = traced_mesh()
    scales = {c: lp.scales[c] for c in EXPERT_CLASSES if lp.scales and c in lp.scales}
    if mesh is None or mesh.size == 1:
        return _on_device(x_ND, experts_Nk, weights_Nk, w_up, w_down, scales, lp.key, lp=lp,
                          expert_ffn=expert_ffn, kind=kind, ep=1)
    ep = mesh.shape.get("expert", 1)
    # The tokens' rows as the batch is split; N = B x T keeps each row's tokens together.
    rows = logical_to_spec(("batch",), (x_ND.shape[0],), mesh)[0]
    tokens = P(rows)
    experts = P("expert") if ep > 1 else P()
    everywhere = P(tuple(mesh.axis_names))
    fanned = fan_out_max(scales, jnp.ones((mesh.size,), bool))  # every device's amax counts
    key = lp.key if lp.key is not None else jax.random.key(0)

    def per_device(x, e, w, up, down, sc, k):
        sc = {c: s[0] for c, s in sc.items()}
        return _on_device(x, e, w, up, down, sc, k, lp=lp, expert_ffn=expert_ffn, kind=kind, ep=ep)

    in_specs = (tokens, tokens, tokens, experts, experts, {c: everywhere for c in fanned}, P())
    return jax.shard_map(per_device, mesh=mesh, in_specs=in_specs, out_specs=tokens, check_vma=False)(
        x_ND, experts_Nk, weights_Nk, w_up, w_down, fanned, key)


def _on_device(x_ND, experts_Nk, weights_Nk, w_up, w_down, scales, key, *, lp, expert_ffn, kind, ep):
    n, k = experts_Nk.shape
    g = w_up.shape[0]  # experts on this device
    x_total = g * ep
    # Only what crossed into shard_map: the block's other per-block inputs stay outside.
    lp = dataclasses.replace(lp, scales=scales, key=key)
    experts_A = experts_Nk.reshape(-1)
    rows_AD = jnp.repeat(x_ND, k, axis=0)
    if ep == 1:
        out_AD = expert_ffn(rows_AD, experts_A, w_up, w_down, lp, kind)
    else:
        valid_A = experts_A < x_total
        dest_A = jnp.where(valid_A, experts_A // g, ep)  # ep: nowhere (dropped)
        local_A = jnp.where(valid_A, experts_A % g, g)
        onehot_AE = jax.nn.one_hot(dest_A, ep, dtype=jnp.int32)
        slot_A = jnp.sum((jnp.cumsum(onehot_AE, axis=0) - 1) * onehot_AE, axis=-1)
        a = n * k
        send_EAD = jnp.zeros((ep, a, x_ND.shape[1]), rows_AD.dtype).at[dest_A, slot_A].set(rows_AD, mode="drop")
        send_EA = jnp.full((ep, a), g, jnp.int32).at[dest_A, slot_A].set(local_A, mode="drop")
        recv_EAD = jax.lax.all_to_all(send_EAD, "expert", 0, 0)
        recv_EA = jax.lax.all_to_all(send_EA, "expert", 0, 0)
        done = expert_ffn(recv_EAD.reshape(ep * a, -1), recv_EA.reshape(-1), w_up, w_down, lp, kind)
        back_EAD = jax.lax.all_to_all(done.reshape(ep, a, -1), "expert", 0, 0)
        out_AD = jnp.where(valid_A[:, None], back_EAD[jnp.minimum(dest_A, ep - 1), slot_A], 0)
    out_NkD = out_AD.reshape(n, k, -1).astype(jnp.float32)
    return jnp.sum(out_NkD * weights_Nk[..., None], axis=1)
