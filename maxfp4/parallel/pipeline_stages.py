"""Where the block stack is cut into pipeline stages, and the start-up checks of ``mesh.pipeline``
and ``mesh.pipeline_repeats``.

The stages are one SPMD program (:mod:`maxfp4.parallel.pipeline`): every device runs the same
stage model at every tick, on that stage's slice of the stacked blocks. So the P x V stages must
be alike: the same block types in the same order and the same recipes. A dense stack and a hybrid
pattern made of P x V equal parts cut so; the cut is then also the cost-balanced one.

A hybrid pattern whose equal-count parts differ (``M*-MM-`` at P = 2) could run each stage's
own blocks under a ``lax.switch`` on the stage index, cut where :func:`balanced_cuts` says. It is
refused instead, because that program costs what the one-program form does not: JAX's
conditional keeps every branch's residuals for the backward pass (activation memory grows with
the number of distinct stages), each block type's weights are padded to the largest stage's
count, and every distinct stage compiles on its own. Padding stages with identity blocks would
cost FLOPs on every stage that runs them. :func:`balanced_cuts` and :func:`stage_costs` give
the cut such a program would take, and the imbalance of a cut, from the model's FLOPs.
"""

from __future__ import annotations

import dataclasses

from maxfp4.config import Config, ConfigError, ModelConfig
from maxfp4.model_spec import model_spec
from maxfp4.parallel.pipeline_schedule import bubble_fraction
from maxfp4.precision import PrecisionPolicy


def block_flops(model: ModelConfig, seq_len: int) -> list[float]:
    """Training FLOPs a token of each block (:meth:`maxfp4.model_spec.ModelSpec.flops_per_token`
    split by block: 6 x its matmul parameters, plus attention's or the SSD's products)."""
    spec = model_spec(model)
    attention = 6.0 * seq_len * spec.n_heads * spec.head_dim
    ssd = 3.0 * spec.ssd_forward_flops
    return [6.0 * b.matmul_params + attention * ("attention" in b.mixers) + ssd * ("mamba" in b.mixers)
            for b in spec.blocks]


def balanced_cuts(costs: list[float], n_stages: int) -> tuple[int, ...]:
    """The first block of each stage (n_stages starts, the first 0) for consecutive stages of
    at least one block whose largest cost is the least possible (dynamic programming over cuts)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the least largest stage cost of the first i blocks in k stages; cut[k][i] its last start
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    starts, i = [], n
    for k in range(n_stages, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return tuple(reversed(starts))


def stage_costs(costs: list[float], starts: tuple[int, ...]) -> list[float]:
    """Each stage's summed cost for stages beginning at ``starts``."""
    ends = starts[1:] + (len(costs),)
    return [sum(costs[a:b]) for a, b in zip(starts, ends)]


def _block_types(model: ModelConfig) -> tuple[str, ...]:
    return tuple(b.type for b in model_spec(model).blocks)


def _alike(types: tuple, n_stages: int) -> bool:
    """Whether ``types`` cuts into ``n_stages`` equal parts, each the first."""
    n = len(types)
    if n % n_stages:
        return False
    part = n // n_stages
    return all(types[i] == types[i % part] for i in range(n))


def _working(n: int, ok) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if ok(k))


def stage_model(model: ModelConfig, stages: int, repeats: int = 1) -> ModelConfig:
    """The model one stage runs: ``n_layers / (stages x repeats)`` blocks (a hybrid: one of that
    many equal parts of the pattern). One line naming the keys when the stack does not cut so."""
    types = _block_types(model)
    n, n_stages = len(types), stages * repeats
    if not _alike(types, n_stages):
        what = f"model.pattern={model.pattern}" if model.kind == "hybrid" else f"the {n} blocks"
        works = _working(n // stages, lambda v: _alike(types, stages * v))
        if repeats == 1 or not works:  # no repeats help: another pipeline degree does
            works = _working(n, lambda p: _alike(types, p))
            keys = f"mesh.pipeline={stages}" + (f" mesh.pipeline_repeats={repeats}" if repeats > 1 else "")
            with_one = " with mesh.pipeline_repeats=1" if repeats > 1 else ""
            raise ConfigError(f"{keys}: cannot cut {what} into {n_stages} stages of the same block types; "
                              f"expected mesh.pipeline one of {works}{with_one}")
        raise ConfigError(f"mesh.pipeline_repeats={repeats}: cannot cut {what} into mesh.pipeline={stages} x "
                          f"{repeats} stages of the same block types; expected mesh.pipeline_repeats one of {works}")
    part = n // n_stages
    # cuDNN's fused attention does not compile inside the stages' shard_map (XLA segfaults, H200,
    # jax 0.11.2, 2026-11-28): the stages take XLA's attention (check_stages refuses cudnn).
    model = dataclasses.replace(model, attention="xla")
    if model.kind == "hybrid":
        return dataclasses.replace(model, pattern=model.pattern[:part], n_layers=part)
    return dataclasses.replace(model, n_layers=part)


def stage_policy(policy: PrecisionPolicy, n_stages: int) -> PrecisionPolicy:
    """The policy of one stage's blocks: every stage's rows must be the first stage's (the stages
    are one program); one line naming the first block that differs."""
    part = policy.n_layers // n_stages
    rows = policy.block_table[:part]
    for i, row in enumerate(policy.block_table):
        if row != rows[i % part]:
            raise ConfigError(
                f"mesh.pipeline x mesh.pipeline_repeats={n_stages}: precision gives block {i} the recipes "
                f"{'/'.join(sorted(set(row)))} and block {i % part} (the same place in the first stage) "
                f"{'/'.join(sorted(set(rows[i % part])))}; expected the same recipes at the same place of every "
                f"stage (precision.rules without 'layers', or layers that repeat every {part} blocks)")
    return dataclasses.replace(policy, n_layers=part, block_table=rows)


def check_stages(cfg: Config, policy: PrecisionPolicy) -> None:
    """Every start-up check of ``mesh.pipeline`` and ``mesh.pipeline_repeats``: blocks, recipes
    and microbatches."""
    stages, repeats, m = cfg.mesh.pipeline, cfg.mesh.pipeline_repeats, cfg.train.microbatches
    if stages == 1:
        if repeats != 1:
            raise ConfigError(f"mesh.pipeline_repeats={repeats}: repeats the stages of mesh.pipeline, which is 1; "
                              f"expected mesh.pipeline_repeats=1 (or mesh.pipeline=2 and more)")
        return
    stage_model(cfg.model, stages, repeats)
    stage_policy(policy, stages * repeats)
    if cfg.model.attention.startswith("cudnn"):
        raise ConfigError(f"model.attention={cfg.model.attention}: cuDNN's attention does not compile inside pipeline "
                          f"stages (mesh.pipeline={stages}); expected auto or xla (the stages run XLA's attention)")
    if m < stages:
        raise ConfigError(f"train.microbatches={m}: expected at least mesh.pipeline={stages} "
                          f"microbatches to fill the stages (e.g. train.microbatches={4 * stages}: bubble "
                          f"{bubble_fraction(stages, 4 * stages, repeats):.0%})")
    if repeats > 1 and m % stages:
        works = stages * -(-m // stages)
        raise ConfigError(f"train.microbatches={m}: expected a multiple of mesh.pipeline={stages} with "
                          f"mesh.pipeline_repeats={repeats} (the microbatches go round the stages in groups of "
                          f"{stages}), e.g. train.microbatches={works}")
