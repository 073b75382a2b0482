"""Elastic restarts: a run resumed on another device count keeps its global batch.

A checkpoint restores onto any mesh (Orbax reads each device's slice), the data iterator's
position counts global batches (maxfp4.data.pipeline), and the learning-rate schedule depends on
the step only. What a new device count can break is the per-device batch: with fewer devices
each one gets more rows (more activation memory than the run ever needed), with more it may get
a fraction of one. With ``train.elastic`` (the default) the start-up picks ``train.microbatches``
so that every device's microbatch is a whole number of rows and no larger than the one the
checkpoint trained with; ``data.global_batch`` never changes, so the update is the same up to
summation order (maxfp4.step: microbatch losses are divided by the whole batch's token count).

The reference is the checkpoint's saved config: it records the microbatches and the mesh, its
axes resolved to the sizes the state was sharded over (maxfp4.checkpoint), that the run that
saved it trained with.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from maxfp4.config import Config, ConfigError

def saved_rows_per_device(saved: dict | None) -> int | None:
    """Rows per data x fsdp device per microbatch of the run that saved ``saved`` (a checkpoint's
    ``Config.to_dict()``); None when it does not say (a mesh axis left at -1: older checkpoints)."""
    if not saved:
        return None
    mesh, train, data = saved.get("mesh") or {}, saved.get("train") or {}, saved.get("data") or {}
    try:
        devices = int(mesh["data"]) * int(mesh["fsdp"])
        rows, micro = int(data["global_batch"]), int(train.get("microbatches", 1))
    except (KeyError, TypeError, ValueError):
        return None
    if devices <= 0 or micro <= 0 or rows % (micro * devices):
        return None
    return rows // (micro * devices)


def fit_to_mesh(cfg: Config, mesh_shape: dict[str, int], saved: dict | None,
                say: Callable[[str], None] = print) -> Config:
    """``cfg`` with, under ``train.elastic``, the fewest microbatches that split the global batch into whole rows on each of the mesh's data x fsdp
    devices, no more rows a device than the saved run had (``saved``: its config dict, None on a
    first start). Says in one line what it changed; raises a one-line ConfigError when no count of
    microbatches can split the batch."""
    reference = saved_rows_per_device(saved)
    if not cfg.train.elastic or reference is None:
        return cfg
    g, micro = cfg.data.global_batch, cfg.train.microbatches
    devices = mesh_shape["data"] * mesh_shape["fsdp"]
    if g % devices:
        raise ConfigError(
            f"data.global_batch={g}: the checkpoint's batch cannot split over the {devices} data x fsdp devices "
            f"of this start (train.elastic keeps the global batch); expected a device count whose data x fsdp "
            f"divides {g}")
    # The config's own microbatches bound the share too, where they split the batch here: a user
    # who raised them for memory keeps them.
    limit = min(reference, g // (micro * devices)) if g % (micro * devices) == 0 else reference
    # Fewest microbatches (fastest) whose per-device share is within the limit; one row a device
    # a microbatch always qualifies.
    chosen = next(m for m in range(1, g // devices + 1) if (g // devices) % m == 0 and g // (m * devices) <= limit)
    saved_micro = int(saved["train"].get("microbatches", 1))
    if chosen == micro and chosen == saved_micro:
        return cfg
    # Said against the checkpoint's run, the run this start continues.
    say(f"elastic: {devices} data x fsdp devices, the checkpoint trained with {reference} row(s) a device a "
        f"microbatch: train.microbatches {saved_micro} -> {chosen} ({g // (chosen * devices)} row(s) a device a "
        f"microbatch), data.global_batch={g} kept")
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=chosen))


def start_up(cfg: Config, mesh, say: Callable[[str], None] = print) -> Config:
    """:func:`fit_to_mesh` against the newest checkpoint's saved config of ``cfg.run_dir``
    (reads only; before anything in the run directory is written)."""
    from maxfp4.checkpoint import saved_config
    saved = saved_config(cfg.run_dir)
    return fit_to_mesh(cfg, dict(mesh.shape), saved[0] if saved else None, say)
