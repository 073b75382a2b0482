"""The planner's picture of pipeline stages: the mesh shape it plans for, the schedule's ticks and
bubble, and the cut of the block stack into stages balanced by cost.

Schedules (``mesh.pipeline`` = P devices, ``mesh.pipeline_repeats`` = V, ``train.microbatches`` =
M, maxfp4.parallel.pipeline): the stack is cut into P x V chunks of consecutive blocks, chunk c on
device c mod P, and the microbatches run one tick at a time: at tick t, device p runs the chunk
of repeat r = (t - p) // M for microbatch (t - p) mod M, if 0 <= t - p < V x M. V = 1 is GPipe.
A pass takes V x M + P - 1 ticks, of which each device works V x M: the bubble is

    (P - 1) / (V x M + P - 1)

(a chunk is 1/V of a device's blocks, so the P - 1 fill and drain ticks cost 1/V of GPipe's).
Microbatch i leaves device P - 1 at repeat r at tick r M + i + P - 1 and re-enters device 0 at
tick (r + 1) M + i: in time only if M >= P, which the schedule requires. The backward pass runs
the ticks in reverse, with the same bubble.

JAX-free and config-free: it reads block costs, not models.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple, Sequence


class PlanMesh(NamedTuple):
    """The mesh the planner prices: its axes, outermost last-but-one (``pipeline`` spans the nodes
    between data and fsdp, maxfp4.parallel.mesh), and the pipeline's repeats. A (data, fsdp, tensor)
    triple reads as it always has: no pipeline."""

    data: int
    fsdp: int
    tensor: int
    pipeline: int = 1
    repeats: int = 1

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.pipeline

    @property
    def batch_shards(self) -> int:
        """Devices the batch's rows are split over (the stages all see every row of their shard)."""
        return self.data * self.fsdp

    def as_dict(self) -> dict[str, int]:
        return self._asdict()


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Share of a pass each device idles: (P - 1) / (V x M + P - 1)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def ticks(stages: int, microbatches: int, repeats: int = 1) -> int:
    return repeats * microbatches + stages - 1


def schedule(stages: int, microbatches: int, repeats: int = 1) -> tuple[tuple[tuple[int, int] | None, ...], ...]:
    """The forward pass, one row a tick: for each device the (microbatch, repeat) it runs, or None."""
    rows = []
    for t in range(ticks(stages, microbatches, repeats)):
        rows.append(tuple(((t - p) % microbatches, (t - p) // microbatches)
                          if 0 <= t - p < repeats * microbatches else None for p in range(stages)))
    return tuple(rows)


def block_flops(spec, seq_len: int) -> tuple[float, ...]:
    """Training FLOPs a token of each block (model_spec's count: 6 x its matmul parameters, plus
    attention's score and value products or the SSD's products)."""
    scores = 6.0 * seq_len * spec.n_heads * spec.head_dim  # causal: half of 12 x T x d_attn
    ssd = 3.0 * spec.ssd_forward_flops
    return tuple(6.0 * b.matmul_params + scores * ("attention" in b.mixers) + ssd * ("mamba" in b.mixers)
                 for b in spec.blocks)


@functools.lru_cache(maxsize=256)
def balanced_cut(costs: tuple[float, ...], parts: int) -> tuple[int, ...]:
    """Boundaries (parts + 1 block indices, from 0 to len(costs)) of ``parts`` runs of consecutive
    blocks, each at least one block, whose largest cost is the least possible: the smallest cap
    under which a greedy cut needs at most ``parts`` runs, found by bisection."""
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
    for _ in range(60):
        mid = (lo + hi) / 2
        if greedy(mid) is None:
            lo = mid
        else:
            hi = mid
    return tuple(greedy(hi))


@dataclasses.dataclass(frozen=True)
class StageSplit:
    """Where the blocks go: ``chunks[c]`` the block indices of chunk c, run by device c mod P."""

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
    """The stack cut into stages x repeats chunks of consecutive blocks balanced by ``costs``."""
    bounds = balanced_cut(tuple(costs), stages * repeats)
    return StageSplit(stages, repeats, tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:])))
