"""The mesh the planner prices, pipeline stages included.

The pipeline's schedule (ticks, bubble) and the cut of the blocks into stages are the trainer's
own, imported from :mod:`maxfp4.parallel.pipeline_schedule` and
:mod:`maxfp4.parallel.pipeline_stages`; so are the rules a stage layout must pass to run, by
which :mod:`maxfp4.plan.layout` chooses. JAX-free.
"""

from __future__ import annotations

from typing import NamedTuple

from maxfp4.parallel.pipeline_schedule import handover_lag


class PlanMesh(NamedTuple):
    """The mesh the planner prices: its axes, outermost last-but-one (``pipeline`` spans the nodes
    between data and fsdp, maxfp4.parallel.mesh), and the pipeline's repeats. A (data, fsdp, tensor)
    triple reads as it always has: no pipeline."""

    data: int
    fsdp: int
    tensor: int
    pipeline: int = 1
    repeats: int = 1
    overlap: bool = False  # mesh.pipeline_overlap: hand-overs beside the next tick's compute
    shard_optimizer: bool = False  # mesh.shard_optimizer_over_data: the moments split over data too

    @classmethod
    def of(cls, shape: tuple[int, int, int, int], mesh_cfg) -> "PlanMesh":
        """A config's mesh: its resolved (data, fsdp, tensor, pipeline) and its ``mesh`` keys."""
        return cls(*shape, repeats=mesh_cfg.pipeline_repeats, overlap=mesh_cfg.pipeline_overlap,
                   shard_optimizer=mesh_cfg.shard_optimizer_over_data)

    @property
    def lag(self) -> int:
        """Ticks from one stage computing a microbatch to the next stage computing it."""
        return handover_lag(self.overlap)

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.pipeline

    @property
    def batch_shards(self) -> int:
        """Devices the batch's rows are split over (the stages all see every row of their shard)."""
        return self.data * self.fsdp

    def as_dict(self) -> dict[str, int | bool]:
        return self._asdict()
