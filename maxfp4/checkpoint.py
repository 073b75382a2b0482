"""Orbax checkpoints of the whole training state, saved asynchronously, restored on rerun.

A checkpoint holds the FP32 parameters, the optimizer state, the precision state (FP8 amax
histories and scales), the step, the RNG key and the data iterator's position, so a rerun
with the same run name continues exactly where the last complete checkpoint left off. Orbax
writes each checkpoint into a temporary directory and renames it when complete, so a crash or
kill mid-save leaves the previous checkpoint intact; every process writes its own shards.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from maxfp4.config import CheckpointConfig
from maxfp4.state import TrainState


def _to_saveable(state: TrainState) -> dict[str, Any]:
    # Typed PRNG keys are stored as their raw uint32 data.
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "rng": jax.random.key_data(state.rng), "precision": state.precision,
            "guard": state.guard}


def _from_saved(tree: dict[str, Any], impl: Any) -> TrainState:
    return TrainState(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"],
                      rng=jax.random.wrap_key_data(tree["rng"], impl=impl), precision=tree["precision"],
                      guard=tree["guard"])


class Checkpointer:
    """``<run_dir>/checkpoints/<step>/{state, data}``."""

    def __init__(self, run_dir: str, cfg: CheckpointConfig):
        self.directory = os.path.abspath(os.path.join(run_dir, "checkpoints"))
        self.every = cfg.every
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_,
                                                 create=True))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def due(self, step: int, last_step: int) -> bool:
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def save(self, step: int, state: TrainState, data_state: dict[str, int]) -> None:
        """Returns once the arrays are copied off the devices; the files are written in the
        background (``wait`` blocks until they are complete)."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_to_saveable(state)),
            data=ocp.args.JsonSave({k: int(v) for k, v in data_state.items()})))

    def restore(self, step: int, like: TrainState) -> tuple[TrainState, dict[str, int]]:
        """Restore onto the shardings of ``like`` (a state of the current run's mesh)."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                _to_saveable(like))
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        return _from_saved(out["state"], jax.random.key_impl(like.rng)), dict(out["data"])

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def delete(self, step: int) -> None:
        self.manager.delete(step)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
