"""Where the block stack is cut into pipeline stages, what each stage costs, the one program
every stage runs, and the rules a stage layout (``mesh.pipeline``, ``mesh.pipeline_repeats``,
``train.microbatches``) must follow. One home for both users: the trainer's start-up check
(:func:`check_stages`) and the planner's choice of layouts (:mod:`maxfp4.plan.layout` offers only
layouts these rules pass). JAX-free: the planner imports it without JAX.

The stages are one SPMD program (:mod:`maxfp4.parallel.pipeline`): every device runs the same
stage model at every tick, on that stage's weights. The stack is cut into P x V chunks of
consecutive blocks balanced by training FLOPs (:func:`balanced_cut`, by :func:`block_flops`).

* Alike stages: a dense stack and a hybrid pattern made of P x V equal parts with the same
  recipes (``M*-M*-`` at P = 2) cut into chunks that are the same blocks; the stage model is one
  chunk (:func:`stage_model`), and the equal cut is also the cost-balanced one.
* Unequal stages: any other stack (``M*-MM-`` at P = 2, Nemotron-H 56B's 118 blocks, 126 dense
  blocks at P = 8) runs a :class:`StageProgram`: a sequence of slots, each a block type with its
  recipes, that holds every chunk as a subsequence (a common supersequence of the chunks). Each
  stage runs its own blocks in their slots and skips the others (a conditional: no FLOPs, no
  backward pass). What it costs: a skipped slot's weights are a padded row of the stage's
  stacks, and its input is kept for the backward pass like a run block's. The alternative, a
  ``lax.switch`` over distinct stage programs, keeps every branch's residuals, pads every
  branch's weights too, and compiles each distinct stage.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from maxfp4.config import Config, ConfigError, ModelConfig
from maxfp4.model_spec import ModelSpec, model_spec
from maxfp4.parallel.pipeline_schedule import bubble_fraction, group_size, handover_lag, ticks
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

    def step_factor(self, costs: Sequence[float], microbatches: int, lag: int = 1) -> float:
        """The device step over one device running every block for every microbatch: V M + L (P - 1)
        ticks, each as long as the costliest chunk on one microbatch."""
        return ticks(self.stages, microbatches, self.repeats, lag) * self.chunk_share(costs) / microbatches


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


def alike_blocks(model: ModelConfig, n_stages: int) -> bool:
    """Whether the equal cut gives ``n_stages`` chunks of the same block types."""
    return _alike(_block_types(model), n_stages)


def alike_stages(model: ModelConfig, policy: PrecisionPolicy, n_stages: int) -> bool:
    """Whether the equal cut gives ``n_stages`` chunks of the same block types and recipes (each
    stage runs one chunk's model), rather than a :class:`StageProgram` of slots."""
    return alike_blocks(model, n_stages) and _alike(policy.recipe_rows, n_stages)


@functools.lru_cache(maxsize=4096)  # the planner asks for every mesh it considers
def stages_problem(model: ModelConfig, stages: int, repeats: int = 1) -> str | None:
    """Why the trainer refuses to run ``model`` in ``stages`` (``mesh.pipeline``) x ``repeats``
    (``mesh.pipeline_repeats``) stages, as one line naming the keys, or None: a stage holds at
    least one block. (Stages of unequal blocks or recipes run as a :class:`StageProgram`.)"""
    n = len(_block_types(model))
    if stages == 1:
        if repeats == 1:
            return None
        return (f"mesh.pipeline_repeats={repeats}: repeats the stages of mesh.pipeline, which is 1; "
                f"expected mesh.pipeline_repeats=1 (or mesh.pipeline=2 and more)")
    if stages * repeats <= n:
        return None
    if repeats > 1 and stages <= n:
        return (f"mesh.pipeline_repeats={repeats}: mesh.pipeline={stages} x {repeats} stages for the model's {n} "
                f"blocks; expected at most {n // stages} (a stage holds at least one block)")
    return f"mesh.pipeline={stages}: {stages} stages for the model's {n} blocks; expected at most {n}"


def microbatches_problem(stages: int, repeats: int, microbatches: int, overlap: bool = False) -> str | None:
    """Why ``microbatches`` cannot go through the stages, as one line naming the key, or None:
    at least one a stage, and with repeats whole groups of ``stages`` (twice that with
    overlapped hand-overs; :func:`maxfp4.parallel.pipeline_schedule.device_order`)."""
    if stages == 1:
        return None
    lag = handover_lag(overlap)
    if microbatches < stages:
        return (f"train.microbatches={microbatches}: expected at least mesh.pipeline={stages} "
                f"microbatches to fill the stages (e.g. train.microbatches={4 * stages}: bubble "
                f"{bubble_fraction(stages, 4 * stages, repeats, lag):.0%})")
    group = group_size(stages, repeats, lag)
    if microbatches % group:
        works = group * -(-microbatches // group)
        what = f"2 x mesh.pipeline={stages}" if overlap else f"mesh.pipeline={stages}"
        why = " and mesh.pipeline_overlap=true" if overlap else ""
        return (f"train.microbatches={microbatches}: expected a multiple of {what} with "
                f"mesh.pipeline_repeats={repeats}{why} (the microbatches go round the stages in groups of "
                f"{group}), e.g. train.microbatches={works}")
    return None


def check_stages(cfg: Config) -> None:
    """Every start-up check of ``mesh.pipeline``, ``mesh.pipeline_repeats`` and
    ``mesh.pipeline_overlap``: blocks and microbatches (the rules the planner chooses by)."""
    stages, repeats = cfg.mesh.pipeline, cfg.mesh.pipeline_repeats
    if cfg.mesh.pipeline_overlap and stages == 1:
        raise ConfigError("mesh.pipeline_overlap=true: overlaps the hand-overs between pipeline stages, and "
                          "mesh.pipeline is 1; expected mesh.pipeline_overlap=false (or mesh.pipeline=2 and more)")
    problem = (stages_problem(cfg.model, stages, repeats)
               or microbatches_problem(stages, repeats, cfg.train.microbatches, cfg.mesh.pipeline_overlap))
    if problem:
        raise ConfigError(problem)


def unequal_stages_note(cfg: Config, policy: PrecisionPolicy, tensor: int) -> str | None:
    """The start-up line for unequal stages under a tensor axis without sequence parallelism:
    inside the conditionals that skip a stage's slots, XLA's partitioner gathers the activations
    of the tensor-split GEMMs and computes them whole on every tensor rank (seen on the CPU's
    compiled step: an MLP's hidden activations gathered over tensor). With the residual stream
    split over tensor (``mesh.sequence_parallel``) the slots keep the split
    (tests/test_pipeline.py)."""
    stages = cfg.mesh.pipeline * cfg.mesh.pipeline_repeats
    if (cfg.mesh.pipeline == 1 or tensor == 1 or cfg.mesh.sequence_parallel
            or alike_stages(cfg.model, policy, stages)):
        return None
    return (f"note: unequal pipeline stages compute their slots' tensor-split layers whole on each of "
            f"mesh.tensor={tensor} devices; mesh.sequence_parallel=true keeps them split")


# ----------------------------------------------------------------------------- unequal stages


def _supersequence_of_two(a: tuple, b: tuple) -> tuple:
    """A shortest common supersequence of ``a`` and ``b`` (the textbook dynamic program)."""
    n, m = len(a), len(b)
    length = [[0] * (m + 1) for _ in range(n + 1)]  # of a[i:], b[j:]
    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i == n or j == m:
                length[i][j] = (n - i) + (m - j)
            elif a[i] == b[j]:
                length[i][j] = 1 + length[i + 1][j + 1]
            else:
                length[i][j] = 1 + min(length[i + 1][j], length[i][j + 1])
    out, i, j = [], 0, 0
    while i < n or j < m:
        if i < n and j < m and a[i] == b[j]:
            out.append(a[i])
            i, j = i + 1, j + 1
        elif j == m or (i < n and length[i + 1][j] <= length[i][j + 1]):
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    return tuple(out)


def _embed(sub: tuple, sup: tuple) -> tuple[int, ...]:
    """The leftmost positions of ``sub`` as a subsequence of ``sup``."""
    at, out = 0, []
    for x in sub:
        while sup[at] != x:
            at += 1
        out.append(at)
        at += 1
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class StageProgram:
    """Unequal stages as one program: ``slots[l]`` (a block type, its recipes) is the l-th block
    every stage runs or skips; ``blocks_CL[c][l]`` the block of the stack stage c runs in slot l,
    or -1 where it skips the slot. Stage c is device c mod P's (c // P)-th
    (:mod:`maxfp4.parallel.pipeline_schedule`)."""

    stages: int
    repeats: int
    slots: tuple[tuple[str, tuple[str, ...]], ...]
    blocks_CL: tuple[tuple[int, ...], ...]

    def slot_block(self, slot: int) -> int:
        """A block that runs in ``slot`` (its type and recipes are the slot's)."""
        return next(chunk[slot] for chunk in self.blocks_CL if chunk[slot] >= 0)

    def device_blocks_VL(self, device: int) -> np.ndarray:
        """[V, L] the blocks device ``device`` runs in each slot of each of its stages (-1: skips)."""
        return np.array([self.blocks_CL[v * self.stages + device] for v in range(self.repeats)], np.int32)

    def stage_model(self, model: ModelConfig) -> ModelConfig:
        """The model of the slots: every slot a block of its type. Its attention runs on XLA: a
        cuDNN attention kernel (even the causal one, which alike stages run) inside a skipped
        slot's conditional makes XLA's compiler segfault (jax 0.11.2, two H200s; Shardy's
        ManualComputationUnusedInputsPattern)."""
        if model.kind == "hybrid":
            pattern = "".join(model.pattern[self.slot_block(l)] for l in range(len(self.slots)))
            return dataclasses.replace(model, pattern=pattern, n_layers=len(pattern), attention="xla")
        return dataclasses.replace(model, n_layers=len(self.slots), attention="xla")

    def stage_policy(self, policy: PrecisionPolicy) -> PrecisionPolicy:
        """The slots' recipes, from a block that runs in each."""
        reps = [self.slot_block(l) for l in range(len(self.slots))]
        return dataclasses.replace(policy, n_layers=len(reps), block_table=tuple(policy.block_table[b] for b in reps),
                                   router_table=tuple(policy.router_table[b] for b in reps) if policy.router_table else ())

    def group_rows(self, model: ModelConfig, group: str) -> np.ndarray:
        """[P, V x L_g]: the rows of parameter group ``group``'s stack (the checkpoint's, in block
        order) that each device's slots of that group read, stage by stage (-1: a skipped slot)."""
        blocks = model_spec(model).blocks
        index_in_group = {}
        for i, b in enumerate(blocks):
            index_in_group[i] = sum(1 for j in range(i) if blocks[j].group == b.group)
        slots = [l for l in range(len(self.slots)) if blocks[self.slot_block(l)].group == group]
        rows = np.full((self.stages, self.repeats * len(slots)), -1, np.int32)
        for p in range(self.stages):
            blocks_VL = self.device_blocks_VL(p)
            rows[p] = [index_in_group[b] if b >= 0 else -1 for v in range(self.repeats) for b in blocks_VL[v, slots]]
        return rows

    def padding(self) -> float:
        """Skipped slots over run ones: the extra weight rows and kept inputs the slots cost."""
        run = sum(b >= 0 for chunk in self.blocks_CL for b in chunk)
        return len(self.slots) * len(self.blocks_CL) / run - 1


def stage_program(model: ModelConfig, policy: PrecisionPolicy | None, seq_len: int, stages: int,
                  repeats: int = 1) -> StageProgram:
    """The slots of unequal stages: the stack cut into stages x repeats chunks balanced by
    training FLOPs, and a common supersequence of the chunks' (type, recipes) sequences (merged
    pairwise, each pair's shortest). ``policy`` None: by type alone (the planner's estimate)."""
    return _stage_program(model, policy, seq_len, stages, repeats)


@functools.lru_cache(maxsize=256)
def _stage_program(model, policy, seq_len, stages, repeats):
    split = split_stages(block_flops(model, seq_len), stages, repeats)
    types = _block_types(model)
    tokens = tuple(zip(types, policy.recipe_rows if policy is not None else ((),) * len(types)))
    chunks = [tuple(tokens[b] for b in chunk) for chunk in split.chunks]
    slots = chunks[0]
    for chunk in chunks[1:]:
        slots = _supersequence_of_two(slots, chunk)
    blocks_CL = []
    for blocks, chunk in zip(split.chunks, chunks):
        row = [-1] * len(slots)
        for b, at in zip(blocks, _embed(chunk, slots)):
            row[at] = b
        blocks_CL.append(tuple(row))
    return StageProgram(stages, repeats, slots, tuple(blocks_CL))


# ----------------------------------------------------------------------------- one stage's program


def held_rows(model: ModelConfig, stages: int) -> dict[str, float]:
    """Rows of each parameter group's stack a device keeps state for (master weights, moments,
    gradients): 1/``stages`` of them, its contiguous part over the pipeline axis, or, where the
    axis does not divide the stack, 1/``stages`` of every row (maxfp4.parallel.mesh.logical_to_spec
    splits a weight dim over it instead; a stack no weight dim of which it divides is not
    modelled)."""
    counts: dict[str, int] = {}
    for b in model_spec(model).blocks:
        counts[b.group] = counts.get(b.group, 0) + 1
    return {g: n / stages for g, n in counts.items()}


def stage_model(model: ModelConfig, stages: int, repeats: int = 1) -> ModelConfig:
    """The model one of alike stages runs: ``n_layers / (stages x repeats)`` blocks (a hybrid:
    the first of that many equal parts of the pattern)."""
    n_stages = stages * repeats
    if not _alike(_block_types(model), n_stages):
        raise ValueError(f"{len(_block_types(model))} blocks do not cut into {n_stages} alike stages")
    part = len(_block_types(model)) // n_stages
    if model.kind == "hybrid":
        return dataclasses.replace(model, pattern=model.pattern[:part], n_layers=part)
    return dataclasses.replace(model, n_layers=part)


def stage_policy(policy: PrecisionPolicy, n_stages: int) -> PrecisionPolicy:
    """The policy of one of alike stages' blocks: the first stage's rows."""
    if not _alike(policy.recipe_rows, n_stages):
        raise ValueError(f"the recipes of {policy.n_layers} blocks differ between {n_stages} stages")
    part = policy.n_layers // n_stages
    return dataclasses.replace(policy, n_layers=part, block_table=policy.block_table[:part],
                               router_table=policy.router_table[:part])
