"""Process start-up: an explicit coordinator, else a single process."""

from __future__ import annotations

import jax

from maxfp4.config import DistributedConfig


def initialize(cfg: DistributedConfig) -> None:
    """Join the multi-process runtime when a coordinator is configured; one process otherwise."""
    if cfg.coordinator:
        jax.distributed.initialize(coordinator_address=cfg.coordinator,
                                   num_processes=cfg.num_processes, process_id=cfg.process_id)
