"""The training loop's order of events, with a real (tiny, jitted) step: a finished step's
metrics reach the hooks only after the next step is dispatched, a stop ends the loop after the
step it was asked at, and a rewind abandons the queued step."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from maxfp4.loop import Hook, Loop, every


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Counter:
    step: jax.Array
    total: jax.Array


@jax.jit
def add_step(state: Counter, batch: jax.Array) -> tuple[Counter, dict[str, jax.Array]]:
    total = state.total + batch
    return Counter(state.step + 1, total), {"loss": total.astype(jnp.float32)}


class Recorder(Hook):
    def __init__(self, events: list):
        self.events = events

    def after_dispatch(self, loop, step, metrics):
        self.events.append(("dispatched", step))

    def after_step(self, loop, step, values, final):
        self.events.append(("finished", step, values["loss"], final))

    def end_step(self, loop, step):
        self.events.append(("end", step))

    def on_rewind(self, loop, step):
        self.events.append(("rewind", step))

    def on_loop_end(self, loop):
        self.events.append(("loop_end",))

    def on_finish(self, loop):
        self.events.append(("finish",))


def _batches():
    i = 0
    while True:
        i += 1
        yield jnp.int32(i)


def _start():
    return Counter(jnp.int32(0), jnp.int32(0))


def test_metrics_of_a_step_are_fetched_after_the_next_dispatch():
    events = []
    loop = Loop(add_step, _start(), _batches(), total_steps=3, hooks=[Recorder(events)])
    loop.run()
    assert events == [("dispatched", 1), ("end", 1),
                      ("dispatched", 2), ("finished", 1, 1.0, False), ("end", 2),
                      ("dispatched", 3), ("finished", 2, 3.0, False), ("end", 3),
                      ("loop_end",), ("finished", 3, 6.0, True), ("finish",)]
    assert int(loop.state.step) == 3 and loop.last_step == 3


def test_a_stop_ends_after_the_step_it_was_asked_at_and_a_rewind_drops_the_queued_step():
    events = []
    loop = Loop(add_step, _start(), _batches(), total_steps=10, hooks=[Recorder(events)],
                should_stop=lambda step: step == 2)
    loop.run()
    assert events[-4:] == [("finished", 1, 1.0, False), ("loop_end",), ("finished", 2, 3.0, True), ("finish",)]

    class RewindOnce(Hook):
        def after_step(self, loop, step, values, final):
            if step == 2 and not final and not hasattr(self, "done"):
                self.done = True
                loop.rewind(_start())  # back to step 0: step 3, already queued, is abandoned

    events = []
    loop = Loop(add_step, _start(), _batches(), total_steps=3, hooks=[RewindOnce(), Recorder(events)])
    loop.run()
    finished = [e[1] for e in events if e[0] == "finished"]
    assert ("rewind", 0) in events and ("finished", 2, 3.0, False) not in events  # the rewinding hook came first
    assert finished == [1, 1, 2, 3] and int(loop.state.step) == 3
    # After the rewind the data moved on: batches 4, 5, 6 summed from zero.
    assert events[-2] == ("finished", 3, 15.0, True)


def test_an_error_in_a_hook_reaches_the_caller():
    class Boom(Hook):
        def end_step(self, loop, step):
            if step == 2:
                raise RuntimeError("boom at 2")

    loop = Loop(add_step, _start(), _batches(), total_steps=5, hooks=[Boom()])
    with pytest.raises(RuntimeError, match="boom at 2"):
        loop.run()
    assert loop.last_step == 2


class Due(Hook):
    def __init__(self, events: list, name: str):
        self.events, self.name = events, name

    def on_due(self, loop, step):
        self.events.append((self.name, step))


def test_the_loop_keeps_each_hooks_cadence_the_last_step_and_a_stop():
    """``every(hook, n, last=, stop=)``: ``on_due`` on the multiples of n, the last step when asked
    and the step a stop came at when asked; a cadence of 0 only at those; a hook without one never."""
    events = []
    hooks = [every(Due(events, "three"), 3), every(Due(events, "three+last"), 3, last=True),
             every(Due(events, "last+stop"), 0, last=True, stop=True), Due(events, "none")]
    Loop(add_step, _start(), _batches(), total_steps=7, hooks=hooks).run()
    assert [s for name, s in events if name == "three"] == [3, 6]
    assert [s for name, s in events if name == "three+last"] == [3, 6, 7]
    assert [s for name, s in events if name == "last+stop"] == [7]
    assert not [e for e in events if e[0] == "none"]
    events.clear()
    Loop(add_step, _start(), _batches(), total_steps=7, hooks=hooks, should_stop=lambda step: step == 4).run()
    assert events == [("three", 3), ("three+last", 3), ("last+stop", 4)]
