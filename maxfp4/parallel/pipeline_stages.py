"""Where the block stack is cut into pipeline stages, what each stage costs, and the rules a
stage layout (``mesh.pipeline``, ``mesh.pipeline_repeats``, ``train.microbatches``) must follow
to run. One home for both users: the trainer's start-up check (:func:`check_stages`) and the
planner's choice of layouts (:mod:`maxfp4.plan.layout` offers only layouts these rules pass).
JAX-free: the planner imports it without JAX.

The stages are one SPMD program (:mod:`maxfp4.parallel.pipeline`): every device runs the same
stage model at every tick, on that stage's slice of the stacked blocks. So the P x V stages must
be alike: the same block types in the same order and the same recipes. A dense stack and a hybrid
pattern made of P x V equal parts cut so; the cut is then also the cost-balanced one
(:func:`balanced_cut`, by :func:`block_flops`).

A hybrid pattern whose equal-count parts differ (``M*-MM-`` at P = 2) could run each stage's
own blocks under a ``lax.switch`` on the stage index, cut where :func:`balanced_cut` says. It is
refused instead, because that program costs what the one-program form does not: JAX's
conditional keeps every branch's residuals for the backward pass (activation memory grows with
the number of distinct stages), each block type's weights are padded to the largest stage's
count, and every distinct stage compiles on its own. Padding stages with identity blocks would
cost FLOPs on every stage that runs them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from maxfp4.config import Config, ConfigError, ModelConfig
from maxfp4.model_spec import ModelSpec, model_spec
from maxfp4.parallel.pipeline_schedule import bubble_fraction, ticks
from maxfp4.precision import PrecisionPolicy

# ----------------------------------------------------------------------------- cost and cut


def block_flop_parts(spec: ModelSpec, seq_len: int) -> tuple[tuple[float, float, float], ...]:
    """Training FLOPs a token of each block as (GEMMs: 6 x its matmul parameters, attention's
    score and value products, the SSD's products): :meth:`ModelSpec.flops_per_token` by block,
    less the LM head. The planner times each part at its own rate."""
    scores = 6.0 * seq_len * spec.n_heads * spec.head_dim  # causal: half of 12 x T x d_attn
    ssd = 3.0 * spec.ssd_forward_flops
    return tuple((6.0 * b.matmul_params, scores * ("attention" in b.mixers), ssd * ("mamba" in b.mixers))
                 for b in spec.blocks)


def block_flops(model: ModelConfig, seq_len: int) -> tuple[float, ...]:
    """Training FLOPs a token of each block (the cost the stages are balanced by)."""
    return tuple(sum(parts) for parts in block_flop_parts(model_spec(model), seq_len))


def balanced_cut(costs: Sequence[float], parts: int) -> tuple[int, ...]:
    """Boundaries (parts + 1 block indices, from 0 to len(costs)) of ``parts`` runs of consecutive
    blocks, each at least one block, whose largest cost is the least possible: the smallest cap
    under which a greedy cut needs at most ``parts`` runs, found by bisection."""
    return _balanced_cut(tuple(costs), parts)


@functools.lru_cache(maxsize=256)  # the planner's layout search asks again for every microbatch count
def _balanced_cut(costs: tuple[float, ...], parts: int) -> tuple[int, ...]:
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} stages for {n} blocks")

    def greedy(cap: float) -> list[int] | None:
        bounds, total = [0], 0.0
        for i, c in enumerate(costs):
            if total + c > cap and i > bounds[-1]:
                bounds.append(i)
                total = 0.0
            total += c
        if len(bounds) > parts:
            return None
        bounds.append(n)
        # fewer runs than parts: split off the last block of a run of several (no run grows)
        while len(bounds) - 1 < parts:
            i = max(j for j in range(len(bounds) - 1) if bounds[j + 1] - bounds[j] > 1)
            bounds.insert(i + 1, bounds[i + 1] - 1)
        return bounds

    lo, hi = max(costs), sum(costs)
    for _ in range(60):  # 2^-60 of the range: below a float's resolution, so the cap is the least
        mid = (lo + hi) / 2
        if greedy(mid) is None:
            lo = mid
        else:
            hi = mid
    return tuple(greedy(hi))


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """Where the blocks go: ``chunks[c]`` the block indices of stage c, run by device c mod P
    (:mod:`maxfp4.parallel.pipeline_schedule`)."""

    stages: int
    repeats: int
    chunks: tuple[tuple[int, ...], ...]

    def device_blocks(self, device: int) -> tuple[int, ...]:
        return tuple(b for c in range(device, len(self.chunks), self.stages) for b in self.chunks[c])

    def chunk_share(self, costs: Sequence[float]) -> float:
        """The largest chunk's share of the total cost (it sets every tick's length)."""
        return max(sum(costs[b] for b in chunk) for chunk in self.chunks) / sum(costs)

    def step_factor(self, costs: Sequence[float], microbatches: int) -> float:
        """The device step over one device running every block for every microbatch: (V M + P - 1)
        ticks, each as long as the costliest chunk on one microbatch."""
        return ticks(self.stages, microbatches, self.repeats) * self.chunk_share(costs) / microbatches


def split_stages(costs: Sequence[float], stages: int, repeats: int = 1) -> StageSplit:
    """The stack cut into stages x repeats chunks of consecutive blocks balanced by ``costs``: on
    every layout :func:`stages_problem` passes, the trainer's equal cut."""
    bounds = balanced_cut(costs, stages * repeats)
    return StageSplit(stages, repeats, tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:])))


# ----------------------------------------------------------------------------- the rules


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


def _cut_problem(model: ModelConfig, stages: int, repeats: int) -> str | None:
    """Why the blocks do not cut into stages x repeats alike stages, or None."""
    types = _block_types(model)
    n, n_stages = len(types), stages * repeats
    if _alike(types, n_stages):
        return None
    what = f"model.pattern={model.pattern}" if model.kind == "hybrid" else f"the {n} blocks"
    works = _working(n // stages, lambda v: _alike(types, stages * v))
    if repeats == 1 or not works:  # no repeats help: another pipeline degree does
        works = _working(n, lambda p: _alike(types, p))
        keys = f"mesh.pipeline={stages}" + (f" mesh.pipeline_repeats={repeats}" if repeats > 1 else "")
        with_one = " with mesh.pipeline_repeats=1" if repeats > 1 else ""
        return (f"{keys}: cannot cut {what} into {n_stages} stages of the same block types; "
                f"expected mesh.pipeline one of {works}{with_one}")
    return (f"mesh.pipeline_repeats={repeats}: cannot cut {what} into mesh.pipeline={stages} x "
            f"{repeats} stages of the same block types; expected mesh.pipeline_repeats one of {works}")


def _policy_problem(policy: PrecisionPolicy, n_stages: int) -> str | None:
    """Why the stages' recipes differ (the stages are one program), naming the first block that
    differs, or None."""
    part = policy.n_layers // n_stages
    rows = policy.block_table[:part]
    for i, row in enumerate(policy.block_table):
        if row != rows[i % part]:
            return (f"mesh.pipeline x mesh.pipeline_repeats={n_stages}: precision gives block {i} the recipes "
                    f"{'/'.join(sorted(set(row)))} and block {i % part} (the same place in the first stage) "
                    f"{'/'.join(sorted(set(rows[i % part])))}; expected the same recipes at the same place of every "
                    f"stage (precision.rules without 'layers', or layers that repeat every {part} blocks)")
    return None


@functools.lru_cache(maxsize=4096)  # the planner asks for every mesh it considers
def stages_problem(model: ModelConfig, policy: PrecisionPolicy, stages: int, repeats: int = 1) -> str | None:
    """Why the trainer refuses to run ``model`` under ``policy`` in ``stages`` (``mesh.pipeline``)
    x ``repeats`` (``mesh.pipeline_repeats``) stages, as one line naming the keys, or None:
    the blocks must cut into alike stages, with the same recipes."""
    if stages == 1:
        if repeats == 1:
            return None
        return (f"mesh.pipeline_repeats={repeats}: repeats the stages of mesh.pipeline, which is 1; "
                f"expected mesh.pipeline_repeats=1 (or mesh.pipeline=2 and more)")
    return _cut_problem(model, stages, repeats) or _policy_problem(policy, stages * repeats)


def microbatches_problem(stages: int, repeats: int, microbatches: int) -> str | None:
    """Why ``microbatches`` cannot go through the stages, as one line naming the key, or None:
    at least one a stage, and with repeats whole groups of ``stages``
    (:func:`maxfp4.parallel.pipeline_schedule.device_order`)."""
    if stages == 1:
        return None
    if microbatches < stages:
        return (f"train.microbatches={microbatches}: expected at least mesh.pipeline={stages} "
                f"microbatches to fill the stages (e.g. train.microbatches={4 * stages}: bubble "
                f"{bubble_fraction(stages, 4 * stages, repeats):.0%})")
    if repeats > 1 and microbatches % stages:
        works = stages * -(-microbatches // stages)
        return (f"train.microbatches={microbatches}: expected a multiple of mesh.pipeline={stages} with "
                f"mesh.pipeline_repeats={repeats} (the microbatches go round the stages in groups of "
                f"{stages}), e.g. train.microbatches={works}")
    return None


def check_stages(cfg: Config, policy: PrecisionPolicy) -> None:
    """Every start-up check of ``mesh.pipeline`` and ``mesh.pipeline_repeats``: blocks, recipes,
    attention and microbatches (the rules the planner chooses by)."""
    stages, repeats = cfg.mesh.pipeline, cfg.mesh.pipeline_repeats
    problem = (stages_problem(cfg.model, policy, stages, repeats)
               or microbatches_problem(stages, repeats, cfg.train.microbatches))
    if problem:
        raise ConfigError(problem)


# ----------------------------------------------------------------------------- one stage's program


def stage_model(model: ModelConfig, stages: int, repeats: int = 1) -> ModelConfig:
    """The model one stage runs: ``n_layers / (stages x repeats)`` blocks (a hybrid: one of that
    many equal parts of the pattern). One line naming the keys when the stack does not cut so."""
    problem = _cut_problem(model, stages, repeats)
    if problem:
        raise ConfigError(problem)
    part = len(_block_types(model)) // (stages * repeats)
    if model.kind == "hybrid":
        return dataclasses.replace(model, pattern=model.pattern[:part], n_layers=part)
    return dataclasses.replace(model, n_layers=part)


def stage_policy(policy: PrecisionPolicy, n_stages: int) -> PrecisionPolicy:
    """The policy of one stage's blocks: every stage's rows must be the first stage's (the stages
    are one program); one line naming the first block that differs."""
    problem = _policy_problem(policy, n_stages)
    if problem:
        raise ConfigError(problem)
    part = policy.n_layers // n_stages
    return dataclasses.replace(policy, n_layers=part, block_table=policy.block_table[:part])
