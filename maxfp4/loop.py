"""The training loop: dispatch the jitted step, and call hooks around it.

The loop owns only the order of events. Everything else (metrics, checkpoints, evaluation,
signals, the guard's rollback, the watchdog, stragglers, injected faults, the profiler) is a
:class:`Hook` registered on it. A finished step's metrics are fetched only after the next step
has been dispatched, so the host never waits for the device in steady state (nanodo's loop).

One iteration, for step ``n`` (1-based: the step that the dispatch completes)::

    before_step(n) -> next batch -> dispatch -> after_dispatch(n, metrics) [-> on_due(n) when due]
      -> after_step(n - 1, values)   (the previous step's metrics, fetched now)
      -> end_step(n)                 (unless a hook rewound the loop or a stop was requested)

then, once the last step is dispatched or a stop was requested: ``on_loop_end``, the last
step's ``after_step(..., final=True)``, ``on_finish``. Hooks run in the order they were given.

A hook may call :meth:`Loop.settle` in ``after_dispatch(n)`` or ``on_due(n)``: the metrics of every dispatched step,
``n``'s included, are fetched and handed to ``after_step`` there and then (the host waits for
step ``n``). The checkpoint hook does so before a save, so a step's metrics are written before
its checkpoint can exist.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator, Sequence

import jax


class Hook:
    """A piece of the run that acts at fixed points of the loop; every method is optional."""

    def before_step(self, loop: "Loop", step: int) -> None:
        """Before step ``step`` is dispatched (its batch is not made yet)."""

    def after_dispatch(self, loop: "Loop", step: int, metrics: dict[str, jax.Array]) -> None:
        """Step ``step`` is queued; ``loop.state`` is its output, not yet donated to the next step."""

    def after_step(self, loop: "Loop", step: int, values: dict[str, float], final: bool) -> None:
        """Step ``step``'s metrics on the host (fetched after the next step was dispatched;
        ``final``: the loop's last step, fetched after the loop)."""

    def on_due(self, loop: "Loop", step: int) -> None:
        """The hook's periodic work, on the steps its :class:`Every` names (the loop keeps the
        cadence: ``Loop(..., hooks=[every(hook, n)])``), right after its ``after_dispatch``."""

    def end_step(self, loop: "Loop", step: int) -> None:
        """Step ``step``'s iteration is over and the loop goes on."""

    def on_rewind(self, loop: "Loop", step: int) -> None:
        """A hook replaced the state with an earlier step's: the loop continues after ``step``."""

    def on_host_pause(self, loop: "Loop", step: int) -> None:
        """A hook held the host after step ``step`` was dispatched (the profiler writing its
        trace): the wall clock of steps up to ``step`` does not time the device."""

    def on_loop_end(self, loop: "Loop") -> None:
        """No more steps will be dispatched; the last one's metrics are not fetched yet."""

    def on_finish(self, loop: "Loop") -> None:
        """The loop ended (every step, or a stop) and the last step's metrics were handled."""

    def close(self) -> None:
        """Release what the hook holds; called once, also after an error."""


@dataclasses.dataclass(frozen=True)
class Every:
    """A hook's cadence, kept by the loop: every ``n``-th step (none when ``n`` is 0), the run's
    last step when ``last``, and the step a stop came at when ``stop``."""

    n: int
    last: bool = False
    stop: bool = False

    def due(self, step: int, total_steps: int, stopping: bool) -> bool:
        return (self.n > 0 and step % self.n == 0) or (self.last and step == total_steps) or (self.stop and stopping)


def every(hook: Hook, n: int, *, last: bool = False, stop: bool = False) -> tuple[Hook, Every]:
    """``hook`` with its cadence, as a ``Loop`` takes it among its hooks (Levanter's ``every=``)."""
    return hook, Every(n, last, stop)


class Loop:
    """``Loop(step_fn, state, batches, ...).run()``: steps from ``state.step`` to ``total_steps``.

    ``step_fn(state, batch) -> (state, metrics)`` is the jitted step; ``should_stop(step)`` is
    asked after each dispatch (a signal or a preemption notice ends the loop after that step).
    ``hooks``: hooks, or hooks with a cadence (:func:`every`) whose ``on_due`` the loop calls.
    """

    def __init__(self, step_fn: Callable, state: Any, batches: Iterator[Any], *, total_steps: int,
                 hooks: Sequence[Hook | tuple[Hook, Every]], should_stop: Callable[[int], bool] = lambda step: False):
        self.step_fn = step_fn
        self.state = state
        self.batches = batches
        self.total_steps = total_steps
        scheduled = [h if isinstance(h, tuple) else (h, None) for h in hooks]
        self.hooks = [hook for hook, _ in scheduled]
        self._cadences = [cadence for _, cadence in scheduled]
        self.should_stop = should_stop
        self.start_step = int(state.step)
        self.step = self.start_step  # the last step dispatched
        self.stopping = False  # set after a dispatch when should_stop said so
        self.dispatch_s = 0.0  # host time of the last dispatch (the first one traces and compiles)
        self._unfetched: list[tuple[int, dict[str, jax.Array]]] = []  # dispatched, not yet handed to after_step
        self._fetched = self.start_step  # the newest step handed to after_step
        self._rewound = False

    @property
    def last_step(self) -> int:
        """The newest step dispatched whose metrics were not abandoned (for crash reports)."""
        return self._unfetched[-1][0] if self._unfetched else self._fetched

    def rewind(self, state: Any) -> None:
        """Continue from ``state`` (an earlier step's): the queued step is abandoned."""
        self.state, self.step, self._rewound = state, int(state.step), True
        self._unfetched, self._fetched = [], self.step
        for hook in self.hooks:
            hook.on_rewind(self, self.step)

    def settle(self) -> bool:
        """Fetch the metrics of every dispatched step now, the newest included, and hand them to
        ``after_step``; False if a hook rewound the loop meanwhile."""
        self._fetch_unfetched(leave=0)
        return not self._rewound

    def host_paused(self, step: int) -> None:
        """Tell every hook that the host was held after step ``step`` was dispatched."""
        for hook in self.hooks:
            hook.on_host_pause(self, step)

    def run(self) -> None:
        while self.step < self.total_steps:
            n = self.step + 1
            for hook in self.hooks:
                hook.before_step(self, n)
            batch = next(self.batches)
            start = time.perf_counter()
            self.state, metrics = self.step_fn(self.state, batch)
            self.dispatch_s = time.perf_counter() - start
            self.stopping = self.should_stop(n)
            self._unfetched.append((n, metrics))
            self._rewound = False
            for hook, cadence in zip(self.hooks, self._cadences):
                hook.after_dispatch(self, n, metrics)
                if cadence is not None and not self._rewound and cadence.due(n, self.total_steps, self.stopping):
                    hook.on_due(self, n)
                if self._rewound:  # a hook settled the loop and a rollback followed
                    break
            if not self._rewound:
                self._fetch_unfetched(leave=1)  # the previous step's, unless a hook settled it
            if self._rewound:
                continue
            if self.stopping:
                break
            for hook in self.hooks:
                hook.end_step(self, n)
            self.step = n
        for hook in self.hooks:
            hook.on_loop_end(self)
        self._fetch_unfetched(leave=0)
        for hook in self.hooks:
            hook.on_finish(self)

    def _fetch_unfetched(self, leave: int) -> None:
        """Hand the oldest unfetched steps to ``after_step``, all but the newest ``leave``. The
        newest is ``final`` when no step follows it: the last step, or the one a stop came at."""
        while len(self._unfetched) > leave and not self._rewound:
            step, metrics = self._unfetched.pop(0)
            final = not self._unfetched and (step >= self.total_steps or self.stopping)
            self._fetch(step, metrics, final)

    def _fetch(self, step: int, metrics: dict[str, jax.Array], final: bool) -> None:
        self._fetched = step
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        for hook in self.hooks:
            hook.after_step(self, step, values, final)
            if self._rewound:  # the rest of this step's hooks belong to the abandoned branch
                return


def close_hooks(hooks: Sequence[Hook], quietly: bool) -> None:
    """Close every hook even if one fails; while an error is already on its way out, a second
    one (a full disk fails every writer) is not raised over it."""
    first: Exception | None = None
    for hook in hooks:
        try:
            hook.close()
        except Exception as e:  # noqa: BLE001 - raised below unless another error is leaving
            first = first or e
    if first is not None and not quietly:
        raise first
