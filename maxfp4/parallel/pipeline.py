"""Pipeline parallelism (``mesh.pipeline``, ``mesh.pipeline_repeats``): the block stack cut into
stages of consecutive blocks, each stage's blocks resident on its device, microbatches streamed
through the stages.

Schedule (:mod:`maxfp4.parallel.pipeline_schedule`): P devices, V repeats, S = P x V stages,
stage s on device s mod P; V = 1 is GPipe's, V > 1 the circular (interleaved) one. It runs as one
scan over the ticks of :func:`~maxfp4.parallel.pipeline_schedule.schedule_table`: at each tick a
device reads which microbatch and which of its V stages to run, runs it and hands the output to
the next device round the ring (``ppermute``; with ``mesh.pipeline_overlap``, during the next
tick, beside its compute); device 0's first stage reads the embedded
microbatch; the last device keeps its last stage's output of each microbatch and, once the ticks
are done, applies the final norm, the LM head and the loss to them. Autodiff runs the ticks
backwards, so the backward pass is pipelined the same way. Bubble fraction:
(P - 1) / (V x M + P - 1) for M = ``train.microbatches`` (a multiple of P when V > 1); with
overlapped hand-overs 2 (P - 1) / (V x M + 2 (P - 1)) (a multiple of 2 P when V > 1).

The stages are one program (``shard_map`` over ``pipeline``, the other axes left to XLA, so data,
fsdp, tensor and expert compose as without stages): alike stages run the stage model
(:func:`~maxfp4.parallel.pipeline_stages.stage_model`) on their slice of the stacked blocks;
unequal ones run the slots of a :class:`~maxfp4.parallel.pipeline_stages.StageProgram`, each
stage skipping the slots it does not fill, on weights gathered at the start of the step
(:func:`_gather_rows`). The parameters keep
their one layout (stacked over all blocks in block order, the stack split into P contiguous parts
over ``pipeline`` by the ``layers`` rule of :mod:`maxfp4.parallel.mesh`): checkpoints and exports
do not depend on P or V. With V > 1 a device's stages are not its contiguous part, so each step
starts with an all-to-all over ``pipeline`` that hands every device its V stages' weights (and
the gradients go back the same way): most of the blocks' weights (half at P = V = 2, three
quarters at P = 4, V = 2) cross the pipeline axis twice a step, once for all M microbatches.
That is the price of the layout staying the checkpoint's.

FP8 delayed scaling: each tick hands the stage a copy of the scales whose cotangent (the amax)
counts only where the tick ran a real microbatch (:func:`fan_out_max`), and the copies combine
by max, as the microbatches of the unpipelined step do; a bubble tick's values never reach them.
The routers' statistics (token counts) come back the same way, summed (:func:`_fan_out`).

Dimension letters: M microbatches, B rows of a microbatch, T sequence, D d_model, N ticks,
V repeats (a device's stages), K chunks (or rows) a device sends another, P devices on the pipeline
axis, L slots of a stage, R rows a device gathers.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maxfp4.config import Config
from maxfp4.parallel.context import to_zigzag
from maxfp4.parallel.mesh import (constrain, entry_axes, fan_out_max, fan_out_sum, logical_to_spec,
                                  split_microbatches)
from maxfp4.parallel.pipeline_schedule import (bubble_fraction, circular_chunks, exchange_tables, handover_lag,
                                               schedule_table)
from maxfp4.parallel.pipeline_stages import alike_stages, check_stages, stage_model, stage_policy, stage_program
from maxfp4.model import abstract_params, get_model
from maxfp4.model.layers import ACT_DTYPE, embed_tokens, output_logits
from maxfp4.model.loss import chunked_loss_sum, token_losses
from maxfp4.model.router_state import PROBE
from maxfp4.model_spec import model_spec
from maxfp4.precision import PrecisionPolicy
from maxfp4.precision.state import with_reciprocals

AXIS = "pipeline"
# The start-up check and the bubble live beside the cuts and the schedule; callers import them here.
__all__ = ["AXIS", "bubble_fraction", "check_stages", "make_pipelined_loss"]


def _own_stages(local: jax.Array, stages: int, repeats: int, p: jax.Array) -> jax.Array:
    """[V x C, ...] (this device's contiguous part of a stack, C rows a stage) -> [V, C, ...]:
    this device's V stages (stage v x P + p as the v-th). One all-to-all over the pipeline axis;
    its transpose hands the gradients back to the checkpoint's layout."""
    chunks_VC = local.reshape(repeats, local.shape[0] // repeats, *local.shape[1:])
    if repeats == 1:
        return chunks_VC
    send_PPK, recv_PV, k = circular_chunks(stages, repeats)
    out_PK = jnp.take(chunks_VC, jnp.asarray(send_PPK)[p], axis=0)  # [P(destination), K, C, ...]
    in_PK = jax.lax.all_to_all(out_PK, AXIS, 0, 0)  # [P(source), K, C, ...]
    in_flat = in_PK.reshape(stages * k, *in_PK.shape[2:])
    return jnp.take(in_flat, jnp.asarray(recv_PV)[p], axis=0)


def _gather_rows(local: jax.Array, wanted_PR: np.ndarray, tables, p: jax.Array) -> jax.Array:
    """[R, ...]: the rows ``wanted_PR[p]`` of a stack (-1: any row, never read), from this
    device's contiguous part of it over the pipeline axis by one all-to-all (``tables``: its
    :func:`exchange_tables`) or, with ``tables`` None, from the whole stack (kept whole on every
    stage where the pipeline axis does not divide it)."""
    if tables is None:
        return jnp.take(local, jnp.asarray(np.maximum(wanted_PR, 0))[p], axis=0)
    send_PPK, recv_PR, _ = tables
    out_PK = jnp.take(local, jnp.asarray(send_PPK)[p], axis=0)  # [P(destination), K, ...]
    in_PK = jax.lax.all_to_all(out_PK, AXIS, 0, 0)  # [P(source), K, ...]
    return jnp.take(in_PK.reshape(-1, *in_PK.shape[2:]), jnp.asarray(recv_PR)[p], axis=0)


def _gather_split_rows(local: jax.Array, wanted_PR: np.ndarray, dim: int) -> jax.Array:
    """[R, ...]: the rows ``wanted_PR[p]`` of a stack the pipeline axis splits along its weight
    dim ``dim`` (as that dim's major part: device s holds its s-th part of every row) rather than
    along its rows: each device sends every other the rows it wants, of its part of the dim, by
    one all-to-all, and puts the parts it receives together in order. The transpose sends each
    row's gradient back in parts."""
    out_PR = jnp.take(local, jnp.asarray(np.maximum(wanted_PR, 0)), axis=0)  # [P(destination), R, ...]
    in_PR = jax.lax.all_to_all(out_PR, AXIS, 0, 0)  # [P(source), R, ...]
    parts = jnp.moveaxis(in_PR, 0, dim)  # [R, ..., P, dim / P, ...]
    return parts.reshape(*parts.shape[:dim], -1, *parts.shape[dim + 2:])


def _split_dim(spec: PartitionSpec) -> int:
    """The dim a parameter's layout splits over the pipeline axis, or -1."""
    return next((i for i, entry in enumerate(spec) if AXIS in entry_axes(entry)), -1)


def _fan_out(block_scales: dict, valid_N: jax.Array) -> dict:
    """The per-block inputs repeated for each tick: the FP8 amaxes come back by max over the
    ticks that ran a microbatch, the routers' statistics (token counts) by sum."""
    counts = {c: s for c, s in block_scales.items() if c == PROBE}
    amaxes = {c: s for c, s in block_scales.items() if c != PROBE}
    return {**fan_out_max(amaxes, valid_N), **fan_out_sum(counts, valid_N)}


def make_pipelined_loss(cfg: Config, policy: PrecisionPolicy, runs_per_row: int | None, mesh) -> Callable:
    """``loss_fn(params, scales, batch, key, denom)`` as :func:`maxfp4.step.make_loss_fn` gives
    it, computed over ``train.microbatches`` microbatches streamed through the stages of ``mesh``
    (the concrete mesh: cuDNN attention's partitioning rule inside the stages needs its devices)."""
    stages, repeats, m = cfg.mesh.pipeline, cfg.mesh.pipeline_repeats, cfg.train.microbatches
    lag = handover_lag(cfg.mesh.pipeline_overlap)
    alike = alike_stages(cfg.model, policy, stages * repeats)
    program = None if alike else stage_program(cfg.model, policy, cfg.data.seq_len, stages, repeats)
    model_cfg = stage_model(cfg.model, stages, repeats) if alike else program.stage_model(cfg.model)
    s_policy = stage_policy(policy, stages * repeats) if alike else program.stage_policy(policy)
    stage_forward = functools.partial(
        get_model(model_cfg).forward_embedded, cfg=model_cfg, policy=s_policy, remat=cfg.train.remat,
        scan_layers=cfg.train.scan_layers, logits=False, runs_per_row=runs_per_row,
        sequence_parallel=cfg.mesh.sequence_parallel)
    spec = model_spec(cfg.model)
    groups = tuple(dict.fromkeys(b.group for b in spec.blocks))
    # Each leaf's dim the parameter layout splits over pipeline (0: its blocks, where the axis
    # divides the stack, as alike stages' always are; another: a weight dim; -1: none, the leaf
    # whole on every stage), and which stacks are split by their blocks.
    layouts = jax.tree.map(lambda axes, x: logical_to_spec(axes, x.shape, mesh),
                           get_model(cfg.model).param_axes(cfg.model), abstract_params(cfg.model),
                           is_leaf=lambda a: isinstance(a, tuple))
    split_dims = {g: jax.tree.map(_split_dim, layouts[g], is_leaf=lambda a: isinstance(a, PartitionSpec))
                  for g in groups}
    split = {g: all(dim == 0 for dim in jax.tree.leaves(split_dims[g])) for g in groups}
    group_sizes = {g: sum(b.group == g for b in spec.blocks) for g in groups}
    if program is not None:
        group_rows = {g: program.group_rows(cfg.model, g) for g in groups}
        tables = {g: exchange_tables(group_sizes[g], stages, group_rows[g]) if split[g] else None for g in groups}
        blocks_PVL = np.stack([program.device_blocks_VL(p) for p in range(stages)])
    chunks = cfg.train.loss_chunks
    # Under sequence parallelism the stage's output is already split over tensor (along the
    # sequence) and crosses as it is, the layout the next stage's blocks read; otherwise d_model
    # is split for the crossing (the "handover" rule keeps a d_model tensor does not divide).
    split_handover = mesh.shape.get("tensor", 1) > 1 and not cfg.mesh.sequence_parallel
    table_NP2 = schedule_table(stages, repeats, m, lag)  # the ticks this loss runs, and the bubble's count
    # GPipe hands the last stage's output to nobody; the circular schedule back to device 0
    ring = [(s, (s + 1) % stages) for s in range(stages if repeats > 1 else stages - 1)]

    def head_loss(params, y_BTD, targets_BT, mask_BT, scales, key):
        """Summed token loss of one microbatch on the last stage (the full model's head)."""
        if chunks == 1:
            logits = output_logits(params, y_BTD, cfg=cfg.model, policy=policy, scales=scales, key=key)
            return jnp.sum(token_losses(logits, targets_BT) * mask_BT)
        return chunked_loss_sum(params, y_BTD, targets_BT, mask_BT, chunks, cfg=cfg.model, policy=policy,
                                scales=scales, key=key)

    # The last stage's head runs once the ticks are done, on the M outputs it kept, rather than
    # inside the ticks' loop: there it ran under a conditional whose residuals every stage keeps
    # for every tick, bubble included (the [B, T, V] logits and the FP32 LM head weight, M + P - 1
    # copies: by their sizes ~90 GB a device for Llama-3-8B at pipeline=4, 8 microbatches). The
    # ticks are lock-step, so the time the other stages wait for the head is the same either way.
    # Each microbatch's logits are recomputed in the backward pass (a third more LM-head FLOPs,
    # ~2% of Llama-3-8B's step), so one microbatch's live at a time, as in ``chunked_loss_sum``.
    head_loss = jax.checkpoint(head_loss, prevent_cse=False)  # inside a scan: no barrier needed
    # The tick at which the last device finishes each microbatch's last stage, in microbatch order.
    done_MP = np.argwhere((table_NP2[:, stages - 1, 0] >= 0) & (table_NP2[:, stages - 1, 1] == repeats - 1))[:, 0]
    done_M = done_MP[np.argsort(table_NP2[done_MP, stages - 1, 0])]

    def head_losses(others, y_MBTD, micro, head_scales, key):
        """The loss summed over the M microbatches, each with its copy of the head's scales (its
        amax counted, combined by max as the unpipelined step's microbatches are)."""
        def one(total, xs):
            i, y_BTD, targets_BT, mask_BT, scales = xs
            return total + head_loss(others, y_BTD, targets_BT, mask_BT, scales, jax.random.fold_in(key, i)), None

        scales_M = fan_out_max(head_scales, jnp.ones((m,), bool))
        xs = (jnp.arange(m), y_MBTD, micro["targets"], micro["loss_mask"], scales_M)
        return jax.lax.scan(one, jnp.zeros((), jnp.float32), xs)[0]

    def stage_inputs(blocks, block_scales, p):
        """This device's V stages' weights [V, ...] and per-block inputs [V, ...], and which of
        their slots run (None: alike stages run every block)."""
        if program is None:
            own = functools.partial(_own_stages, stages=stages, repeats=repeats, p=p)
            return jax.tree.map(own, blocks), jax.tree.map(own, block_scales), None
        weights = {}
        for g in groups:
            rows = group_rows[g]
            per_stage_rows = rows.shape[1] // repeats

            def stage_rows(a, dim, rows=rows, g=g):
                held = (_gather_split_rows(a, rows, dim) if dim > 0
                        else _gather_rows(a, rows, tables[g], p))
                return held.reshape(repeats, per_stage_rows, *held.shape[1:])

            weights[g] = jax.tree.map(stage_rows, blocks[g], split_dims[g])
        at_VL = jnp.asarray(np.maximum(blocks_PVL, 0))[p]
        scales = jax.tree.map(lambda a: jnp.take(a, at_VL, axis=0), block_scales)
        return weights, scales, jnp.asarray(blocks_PVL >= 0)[p]

    def per_stage(blocks, others, block_scales, head_scales, micro, key):
        p = jax.lax.axis_index(AXIS)
        blocks_V, block_scales_V, active_VL = stage_inputs(blocks, block_scales, p)
        microbatch_N, repeat_N = (jnp.asarray(table_NP2[..., j])[:, p] for j in (0, 1))
        valid_N = microbatch_N >= 0  # this device's ticks that run a real microbatch
        scales_N = {"blocks": _fan_out(block_scales_V, valid_N)}

        def tick(carry, xs):
            received_BTD, in_flight = carry
            microbatch, repeat, scales = xs
            i, v = jnp.maximum(microbatch, 0), jnp.maximum(repeat, 0)
            first = (p == 0) & (v == 0)
            x_BTD = jnp.where(first, embedded_MBTD[i], received_BTD)
            # GPipe's one stage a device is a static index: its program stays the one it was
            held = 0 if repeats == 1 else v
            stage_blocks = jax.tree.map(lambda a: a[held], blocks_V)
            stage_scales = jax.tree.map(lambda a: a[held], scales["blocks"])
            active = {} if active_VL is None else {"active_L": active_VL[held]}
            mb_key = jax.random.fold_in(key, i)
            y_BTD = stage_forward({**others, **stage_blocks}, x_BTD, micro["positions"][i],
                                  micro["segment_ids"][i], scales={"blocks": stage_scales},
                                  key=jax.random.fold_in(mb_key, v * stages + p), **active)
            stage_output_BTD = y_BTD  # as the blocks leave it: the head reads the last stage's
            if split_handover:  # 1/tensor of it crosses stages; the receiver gathers it over tensor
                y_BTD = constrain(y_BTD, ("batch", "seq", "handover"))
            # Lag 1 sends this tick's output; lag 2 the previous tick's, which this tick's
            # compute does not depend on, so the send runs beside it (forward and backward).
            sending = in_flight + (y_BTD,)
            handed = jax.lax.ppermute(sending[0], AXIS, ring)
            if split_handover and lag > 1:
                # Gathered over tensor now, beside the compute, not when read; split first, so
                # that the gradient sent back (the transposes, in reverse order) is split too.
                handed = constrain(constrain(handed, ("batch", "seq", "handover")), ("batch", "seq", None))
            return (handed, tuple(sending[1:])), stage_output_BTD

        # Every microbatch embedded once, before the ticks, inside the stages' program: what
        # crosses the stage boundary backwards is then the FP32 table's gradient (XLA's CPU
        # compiler fails on a BF16 cotangent summed over stages), and its scatter into the table
        # runs once a step, not once a tick on every device (a [V, D] FP32 gradient a tick, bubble
        # included, when each tick embedded). Device 0's first stage reads them.
        embedded_MBTD = jnp.stack([embed_tokens(others["embed"], micro["inputs"][j]) for j in range(m)])
        b, t = micro["inputs"].shape[1:]
        zeros_BTD = jnp.zeros((b, t, cfg.model.d_model), ACT_DTYPE)
        init = (zeros_BTD, (zeros_BTD,) * (lag - 1))
        _, y_NBTD = jax.lax.scan(tick, init, (microbatch_N, repeat_N, scales_N))
        y_MBTD = jnp.take(y_NBTD, jnp.asarray(done_M), axis=0)  # what the last device's ticks output
        total = jax.lax.cond(p == stages - 1, lambda: head_losses(others, y_MBTD, micro, head_scales, key),
                             lambda: jnp.zeros((), jnp.float32))
        return jax.lax.psum(total, AXIS)

    def loss_fn(params, scales, batch, key, denom):
        # mesh.context > 1: the load-balanced token order the context split needs, as unpipelined
        micro = split_microbatches(to_zigzag(batch, cfg.mesh.context), m)
        micro["loss_mask"] = micro["loss_mask"].astype(jnp.float32)
        scales = with_reciprocals(scales, policy)  # as unpipelined: one division a class
        blocks = {g: params[g] for g in groups}
        others = {k: v for k, v in params.items() if k not in groups}
        block_scales = scales.get("blocks", {})
        head_scales = {"lm_head": scales["lm_head"]} if "lm_head" in scales else {}
        stacked, whole = PartitionSpec(AXIS), PartitionSpec()
        # Each leaf enters as its layout splits it over pipeline (by blocks, by a weight dim, or
        # whole), and every block's per-block inputs whole (the transpose sums their cotangents
        # over the stages: each block's are nonzero on one).
        block_specs = {g: jax.tree.map(lambda dim: whole if dim < 0 else PartitionSpec(*[None] * dim, AXIS),
                                       split_dims[g]) for g in groups}
        in_specs = (block_specs, jax.tree.map(lambda _: whole, others),
                    jax.tree.map(lambda _: stacked if alike else whole, block_scales),
                    jax.tree.map(lambda _: whole, head_scales), jax.tree.map(lambda _: whole, micro), whole)
        run = jax.shard_map(per_stage, mesh=mesh, in_specs=in_specs, out_specs=whole, axis_names={AXIS},
                            check_vma=False)
        return run(blocks, others, block_scales, head_scales, micro, key) / denom

    return loss_fn
