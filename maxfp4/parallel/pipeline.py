"""Pipeline parallelism (``mesh.pipeline``): the block stack split into stages of consecutive
blocks, each stage's blocks resident on its devices, microbatches streamed through the stages.

Schedule: GPipe's, written as one scan over ``M + P - 1`` ticks (M = ``train.microbatches``, P
stages). At tick t stage p runs microbatch t - p through its blocks and hands its output to stage
p + 1 (``ppermute``); stage 0 reads the embedded microbatch, the last stage applies the final norm,
the LM head and the loss. Autodiff runs the ticks backwards, so the backward pass is pipelined the
same way. Each stage idles for P - 1 of the M + P - 1 ticks of each pass: the bubble fraction is
``(P - 1) / (M + P - 1)``, which shrinks as the microbatches grow (M = 4 P: 11% at P = 2).

The stages are one program (``shard_map`` over ``pipeline``, the other axes left to XLA, so data,
fsdp and tensor compose as without stages): every stage runs the blocks of the stage model
(:func:`stage_model`), a model of ``n_layers / P`` blocks whose parameters are that stage's slice
of the stacked blocks. So the stages must be alike: the same block types in the same order (a
hybrid pattern made of P equal parts) and the same recipes (:func:`check_stages`). The
parameters keep their one layout (stacked over all blocks, the stack split over ``pipeline`` by
the ``layers`` rule of :mod:`maxfp4.parallel.mesh`): checkpoints and exports do not depend on P.

FP8 delayed scaling: each tick hands the stage a copy of the scales whose cotangent (the amax)
counts only where the tick ran a real microbatch (:func:`_fan_out_max`), and the copies combine
by max, as the microbatches of the unpipelined step do; a bubble tick's values never reach them.

Dimension letters: M microbatches, B rows of a microbatch, T sequence, D d_model.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from maxfp4.config import Config, ConfigError, ModelConfig
from maxfp4.parallel.mesh import split_microbatches
from maxfp4.model import get_model
from maxfp4.model.layers import ACT_DTYPE, embed_tokens, output_logits
from maxfp4.model.loss import chunked_loss_sum, token_losses
from maxfp4.model_spec import model_spec
from maxfp4.precision import PrecisionPolicy

AXIS = "pipeline"


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The share of a pass each stage idles: (P - 1) / (M + P - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def _working_degrees(n_blocks: int, alike) -> list[int]:
    return [p for p in range(1, n_blocks + 1) if n_blocks % p == 0 and alike(p)]


def stage_model(model: ModelConfig, stages: int) -> ModelConfig:
    """The model one stage runs: ``n_layers / stages`` blocks (a hybrid: one of ``stages`` equal
    parts of the pattern). One line naming the keys when the stack does not split so."""
    n = model.n_layers
    spec = model_spec(model)
    types = tuple(b.type for b in spec.blocks)

    def alike(p: int) -> bool:
        part = n // p
        return all(types[i] == types[i % part] for i in range(n))

    if n % stages or not alike(stages):
        works = ", ".join(str(p) for p in _working_degrees(n, alike))
        what = "model.pattern into equal parts" if model.kind == "hybrid" else f"the {n} blocks"
        raise ConfigError(f"mesh.pipeline={stages}: cannot split {what}, one a stage; expected one of {works}")
    part = n // stages
    # cuDNN's fused attention does not compile inside the stages' shard_map (XLA segfaults, H200,
    # jax 0.11.2, 2026-11-28): the stages take XLA's attention (check_stages refuses cudnn).
    model = dataclasses.replace(model, attention="xla")
    if model.kind == "hybrid":
        return dataclasses.replace(model, pattern=model.pattern[:part], n_layers=part)
    return dataclasses.replace(model, n_layers=part)


def stage_policy(policy: PrecisionPolicy, stages: int) -> PrecisionPolicy:
    """The policy of one stage's blocks: every stage's rows must be the first stage's (the stages
    are one program); one line naming the first block that differs."""
    part = policy.n_layers // stages
    rows = policy.block_table[:part]
    for i, row in enumerate(policy.block_table):
        if row != rows[i % part]:
            raise ConfigError(
                f"mesh.pipeline={stages}: precision gives block {i} the recipes {'/'.join(sorted(set(row)))} "
                f"and block {i % part} (the same place in the first stage) {'/'.join(sorted(set(rows[i % part])))}; "
                f"expected the same recipes at the same place of every stage (precision.rules without "
                f"'layers', or layers that repeat every {part} blocks)")
    return dataclasses.replace(policy, n_layers=part, block_table=rows)


def check_stages(cfg: Config, policy: PrecisionPolicy) -> None:
    """Every start-up check of ``mesh.pipeline``: blocks, recipes and microbatches."""
    stages = cfg.mesh.pipeline
    if stages == 1:
        return
    stage_model(cfg.model, stages)
    stage_policy(policy, stages)
    if cfg.model.attention.startswith("cudnn"):
        raise ConfigError(f"model.attention={cfg.model.attention}: cuDNN's attention does not compile inside pipeline "
                          f"stages (mesh.pipeline={stages}); expected auto or xla (the stages run XLA's attention)")
    if cfg.train.microbatches < stages:
        raise ConfigError(f"train.microbatches={cfg.train.microbatches}: expected at least mesh.pipeline={stages} "
                          f"microbatches to fill the stages (e.g. train.microbatches={4 * stages}: bubble "
                          f"{bubble_fraction(stages, 4 * stages):.0%})")


@jax.custom_vjp
def _fan_out_max(scales: Any, valid_N: jax.Array) -> Any:
    """``scales`` repeated for each of N ticks; the cotangent (an amax) is the max over the ticks
    where ``valid_N`` is true."""
    return jax.tree.map(lambda s: jnp.broadcast_to(s, (valid_N.shape[0], *s.shape)), scales)


def _fan_out_max_fwd(scales, valid_N):
    return _fan_out_max(scales, valid_N), valid_N


def _fan_out_max_bwd(valid_N, ct):
    def reduce(c):
        mask = valid_N.reshape(-1, *([1] * (c.ndim - 1)))
        return jnp.max(jnp.where(mask, c, 0.0), axis=0)
    return jax.tree.map(reduce, ct), None


_fan_out_max.defvjp(_fan_out_max_fwd, _fan_out_max_bwd)


def make_pipelined_loss(cfg: Config, policy: PrecisionPolicy, runs_per_row: int | None, mesh) -> Callable:
    """``loss_fn(params, scales, batch, key, denom)`` as :func:`maxfp4.step.make_loss_fn` gives
    it, computed over ``train.microbatches`` microbatches streamed through the stages of ``mesh``
    (the concrete mesh: cuDNN attention's partitioning rule inside the stages needs its devices)."""
    stages, m = cfg.mesh.pipeline, cfg.train.microbatches
    model_cfg = stage_model(cfg.model, stages)
    s_policy = stage_policy(policy, stages)
    stage_forward = functools.partial(
        get_model(model_cfg).forward_embedded, cfg=model_cfg, policy=s_policy, remat=cfg.train.remat,
        scan_layers=cfg.train.scan_layers, logits=False, runs_per_row=runs_per_row)
    groups = tuple(dict.fromkeys(b.group for b in model_spec(cfg.model).blocks))
    chunks, ticks = cfg.train.loss_chunks, m + stages - 1

    def head_loss(params, y_BTD, targets_BT, mask_BT, scales, key):
        """Summed token loss of one microbatch on the last stage (the full model's head)."""
        if chunks == 1:
            logits = output_logits(params, y_BTD, cfg=cfg.model, policy=policy, scales=scales, key=key)
            return jnp.sum(token_losses(logits, targets_BT) * mask_BT)
        return chunked_loss_sum(params, y_BTD, targets_BT, mask_BT, chunks, cfg=cfg.model, policy=policy,
                                scales=scales, key=key)

    def per_stage(blocks, others, block_scales, head_scales, micro, key):
        p = jax.lax.axis_index(AXIS)
        params = {**others, **blocks}
        t_N = jnp.arange(ticks)
        valid_N = (t_N >= p) & (t_N - p < m)  # this stage's ticks that run a real microbatch
        scales_N = _fan_out_max({"blocks": block_scales, "head": head_scales}, valid_N)

        def tick(carry, xs):
            received_BTD, total = carry
            t, scales = xs
            i = jnp.clip(t - p, 0, m - 1)  # the microbatch this stage runs now
            # Stage 0 embeds here, so what crosses the stage boundary backwards is the FP32
            # table's gradient (XLA's CPU compiler fails on a BF16 cotangent summed over stages).
            x_BTD = jnp.where(p == 0, embed_tokens(params["embed"], micro["inputs"][i]), received_BTD)
            mb_key = jax.random.fold_in(key, i)
            y_BTD = stage_forward(params, x_BTD, micro["positions"][i], micro["segment_ids"][i],
                                  scales={"blocks": scales["blocks"]}, key=jax.random.fold_in(mb_key, p))
            last = (p == stages - 1) & (t - p >= 0) & (t - p < m)
            loss = jax.lax.cond(last, lambda: head_loss(params, y_BTD, micro["targets"][i], micro["loss_mask"][i],
                                                        scales["head"], mb_key),
                                lambda: jnp.zeros((), jnp.float32))
            handed = jax.lax.ppermute(y_BTD, AXIS, [(s, s + 1) for s in range(stages - 1)])
            return (handed, total + loss), None

        b, t = micro["inputs"].shape[1:]
        init = (jnp.zeros((b, t, cfg.model.d_model), ACT_DTYPE), jnp.zeros((), jnp.float32))
        (_, total), _ = jax.lax.scan(tick, init, (t_N, scales_N))
        return jax.lax.psum(total, AXIS)

    def loss_fn(params, scales, batch, key, denom):
        micro = split_microbatches(batch, m)
        micro["loss_mask"] = micro["loss_mask"].astype(jnp.float32)
        blocks = {g: params[g] for g in groups}
        others = {k: v for k, v in params.items() if k not in groups}
        block_scales = scales.get("blocks", {})
        head_scales = {"lm_head": scales["lm_head"]} if "lm_head" in scales else {}
        stacked, whole = PartitionSpec(AXIS), PartitionSpec()
        in_specs = (jax.tree.map(lambda _: stacked, blocks), jax.tree.map(lambda _: whole, others),
                    jax.tree.map(lambda _: stacked, block_scales), jax.tree.map(lambda _: whole, head_scales),
                    jax.tree.map(lambda _: whole, micro), whole)
        run = jax.shard_map(per_stage, mesh=mesh, in_specs=in_specs, out_specs=whole, axis_names={AXIS},
                            check_vma=False)
        return run(blocks, others, block_scales, head_scales, micro, key) / denom

    return loss_fn
