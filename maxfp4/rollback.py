"""Rollback after a run of skipped steps.

The guard (maxfp4.guard) skips single bad steps. Many bad steps in a row mean the parameters
themselves have gone bad (a spike that slipped under the threshold and derailed the model), so
skipping alone will not recover: the loop reloads the newest checkpoint taken before the streak
began and carries on. The data iterator is *not* rewound: it stays past the batches of the
streak, so the run trains on new data rather than replaying the window that failed. The step
counter does come back with the checkpoint (it is part of the model state, and the learning-rate
schedule follows it), so the run still ends at ``train.steps`` optimizer steps; metrics.jsonl
then shows the rolled-back step numbers a second time. Checkpoints newer than the one restored
are deleted: they belong to the abandoned branch.

After ``max_rollbacks`` rollbacks in one process lifetime the run stops with :class:`Diverged`
(exit code 3): something is wrong that retrying will not fix.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from maxfp4.checkpoint import Checkpointer
from maxfp4.state import TrainState


class Diverged(RuntimeError):
    """Training keeps producing bad steps; rolling back did not help."""

    exit_code = 3


class Rollbacks:
    def __init__(self, max_consecutive_skips: int, max_rollbacks: int):
        self.max_consecutive = max_consecutive_skips
        self.max_rollbacks = max_rollbacks
        self.count = 0

    def needed(self, consecutive_skips: int) -> bool:
        return self.max_consecutive > 0 and consecutive_skips >= self.max_consecutive

    def roll_back(self, checkpointer: Checkpointer, state: TrainState, *, step: int, consecutive: int,
                  skipped_total: int, say: Callable[[str], None]) -> TrainState:
        """``state`` is the newest state (only its shardings are used); ``step`` the last step
        whose metrics were read, ``consecutive`` of them skipped in a row."""
        first_bad = step - consecutive + 1
        if self.count >= self.max_rollbacks:
            raise Diverged(f"{consecutive} consecutive skipped steps ({first_bad}..{step}) after "
                           f"{self.count} rollback(s) (resilience.max_rollbacks={self.max_rollbacks}); "
                           f"stopping: lower optim.lr, check the data around these steps, or raise the limits")
        checkpointer.wait()  # a save of a newer step may still be in flight
        candidates = [s for s in checkpointer.all_steps() if s < first_bad]
        if not candidates:
            raise Diverged(f"{consecutive} consecutive skipped steps ({first_bad}..{step}) and no checkpoint "
                           f"before step {first_bad} to roll back to; set checkpoint.every")
        target = candidates[-1]
        for newer in checkpointer.all_steps():
            if newer > target:
                checkpointer.delete(newer)
        restored, _ = checkpointer.restore(target, state)  # the data position is deliberately not restored
        self.count += 1

        def like(old: jax.Array, value: int) -> jax.Array:
            return jax.device_put(np.asarray(value, old.dtype), old.sharding)

        # The streak is over; the lifetime count of skipped steps survives the rollback.
        guard = dict(restored.guard, consecutive=like(restored.guard["consecutive"], 0),
                     skipped=like(restored.guard["skipped"], skipped_total))
        say(f"rollback {self.count}/{self.max_rollbacks}: {consecutive} consecutive skipped steps "
            f"({first_bad}..{step}); restored checkpoint {target}, data continues past the skipped batches")
        return restored.replace(guard=guard)
