"""The mesh the planner prices, pipeline stages included.

The pipeline's schedule (ticks, bubble) and the cut of the blocks into stages are the trainer's
own, imported from :mod:`maxfp4.parallel.pipeline_schedule` and
:mod:`maxfp4.parallel.pipeline_stages`; so are the rules a stage layout must pass to run, by
which :mod:`maxfp4.plan.layout` chooses. JAX-free.
"""

from __future__ import annotations

from typing import NamedTuple


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
