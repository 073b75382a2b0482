"""What the loop does about a streak of ``max_consecutive_skips`` skipped steps in a row.

The guard (maxfp4.reliability.guard) skips single bad steps, and accepts a lasting level shift of the loss
after at most ``spike_window // 2 + 1`` skips, fewer than ``max_consecutive_skips``. A longer streak
means the parameters themselves have gone bad (a spike that slipped under the threshold and
derailed the model), so skipping alone will not recover: the loop reloads the newest checkpoint
taken before the streak began (the checkpointer keeps it out of rotation while the streak runs)
and carries on. The data iterator is *not* rewound: it stays past the batches of the streak, so
the run trains on new data rather than replaying the window that failed. The step counter does
come back with the checkpoint (it is part of the model state, and the learning-rate schedule
follows it), so the run still ends at ``train.steps`` optimizer steps; metrics.jsonl then shows
the rolled-back step numbers a second time. Checkpoints newer than the one restored are deleted:
they belong to the abandoned branch.

With no checkpoint to go back to, or after ``max_rollbacks`` rollbacks in one process lifetime:
a streak with finite losses says so and suspends spike judgement for ``spike_window`` steps (the
host sets the guard state's ``suspend``, as a rollback sets ``consecutive``), so the loss window
refills with what the run produces now and training goes on; a streak of non-finite steps stops
the run with :class:`Diverged` (exit code 3), since no judgement of the loss can change it.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from maxfp4.checkpoint import Checkpointer
from maxfp4.loop import Hook
from maxfp4.config import CheckpointConfig
from maxfp4.state import TrainState


class Diverged(RuntimeError):
    """Training keeps producing bad steps; rolling back did not help or was not possible."""

    exit_code = 3


def _like(old: jax.Array, value: int) -> jax.Array:
    return jax.device_put(np.asarray(value, old.dtype), old.sharding)


class Rollbacks:
    def __init__(self, max_consecutive_skips: int, max_rollbacks: int, *, suspend_steps: int,
                 checkpoint: CheckpointConfig):
        self.max_consecutive = max_consecutive_skips
        self.max_rollbacks = max_rollbacks
        self.suspend_steps = suspend_steps
        self.checkpoint = checkpoint
        self.count = 0
        # Metrics of steps queued before a suspension still carry the old streak: not a new one.
        self._quiet_through = -1

    def needed(self, consecutive_skips: int, step: int) -> bool:
        return self.max_consecutive > 0 and consecutive_skips >= self.max_consecutive and step > self._quiet_through

    def _no_checkpoint_reason(self, first_bad: int) -> str:
        if not self.checkpoint.enabled:
            return "no checkpoint to roll back to (checkpoint.enabled=false)"
        if self.checkpoint.every == 0:
            return (f"no checkpoint before step {first_bad} to roll back to (checkpoint.every=0 saves only the "
                    f"last step; set checkpoint.every to roll back)")
        return f"no checkpoint before step {first_bad} to roll back to (checkpoint.every={self.checkpoint.every})"

    def recover(self, checkpointer: Checkpointer, state: TrainState, *, step: int, consecutive: int,
                nonfinite: int, skipped_total: int, say: Callable[[str], None]) -> tuple[TrainState, bool]:
        """``state`` is the newest state; ``step`` the last step whose metrics were read,
        ``consecutive`` of them skipped in a row, ``nonfinite`` of those with a non-finite loss or
        gradient. Returns ``(state, rolled_back)``: the restored state, or ``state`` with spike
        judgement suspended (the queued step then goes on as usual)."""
        first_bad = step - consecutive + 1
        streak = f"{consecutive} consecutive skipped steps ({first_bad}..{step})"
        checkpointer.wait()  # a save of a newer step may still be in flight
        candidates = [s for s in checkpointer.all_steps() if s < first_bad]
        if candidates and self.count < self.max_rollbacks:
            return self._roll_back(checkpointer, state, candidates[-1], streak, skipped_total, say), True
        reason = (self._no_checkpoint_reason(first_bad) if not candidates else
                  f"{self.count} rollback(s) done (resilience.max_rollbacks={self.max_rollbacks})")
        if nonfinite >= consecutive:
            raise Diverged(f"{streak}, all non-finite, and {reason}; stopping: lower optim.lr, check the data "
                           f"around these steps, or raise the limits")
        guard = dict(state.guard, consecutive=_like(state.guard["consecutive"], 0),
                     streak_nonfinite=_like(state.guard["streak_nonfinite"], 0),
                     suspend=_like(state.guard["suspend"], self.suspend_steps))
        self._quiet_through = step + 1
        say(f"guard: {streak}, {consecutive - nonfinite} with a finite loss, and {reason}; spike judgement "
            f"suspended for {self.suspend_steps} steps while the loss window refills, training goes on")
        return state.replace(guard=guard), False

    def _roll_back(self, checkpointer: Checkpointer, state: TrainState, target: int, streak: str,
                   skipped_total: int, say: Callable[[str], None]) -> TrainState:
        for newer in checkpointer.all_steps():
            if newer > target:
                checkpointer.delete(newer)
        restored, _ = checkpointer.restore(target, state)  # the data position is deliberately not restored
        self.count += 1
        # The streak is over; the lifetime count of skipped steps survives the rollback.
        g = restored.guard
        guard = dict(g, consecutive=_like(g["consecutive"], 0), streak_nonfinite=_like(g["streak_nonfinite"], 0),
                     skipped=_like(g["skipped"], skipped_total))
        say(f"rollback {self.count}/{self.max_rollbacks}: {streak}; restored checkpoint {target}, "
            f"data continues past the skipped batches")
        return restored.replace(guard=guard)


class RollbackHook(Hook):
    """After a streak of skipped steps, reload the checkpoint from before it (the loop rewinds)
    or suspend spike judgement; see :meth:`Rollbacks.recover`. Not on the last step or a stop."""

    def __init__(self, rollbacks: Rollbacks, checkpointer: Checkpointer, say: Callable[[str], None]):
        self.rollbacks, self.checkpointer, self.say = rollbacks, checkpointer, say

    def after_step(self, loop, step: int, values: dict[str, float], final: bool) -> None:
        consecutive = int(values["consecutive_skips"])
        if final or loop.stopping or not self.rollbacks.needed(consecutive, step):
            return
        state, rolled_back = self.rollbacks.recover(
            self.checkpointer, loop.state, step=step, consecutive=consecutive,
            nonfinite=int(values["streak_nonfinite"]), skipped_total=int(values["skipped_steps"]), say=self.say)
        if rolled_back:  # the queued step is abandoned with the rest of the streak's branch
            loop.rewind(state)
        else:
            loop.state = state
