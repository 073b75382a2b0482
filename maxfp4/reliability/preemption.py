"""Graceful preemption: SIGTERM (Slurm preemption, ``scancel``), SIGINT (Ctrl-C) or SIGHUP (the
ssh session that started the run ended; ignored under ``nohup``) at any moment ends with the
newest complete checkpoint on disk and exit code 128 + the signal number.

What a signal does depends on where the run is (:class:`PreemptionWatch` ``phase``):

- start-up (config, data, restore, compiling the first step): nothing has been trained, so the
  run stops at once with one line; the main thread unwinds (files are written under temporary
  names, so none is left half-written) and, if it is stuck in native code (compiling), a
  helper thread ends the process after ``STARTUP_EXIT_S``; either way the process ends with
  ``os._exit`` (:meth:`PreemptionWatch.end_process`), as XLA's compiler threads may still be running;
- training: the running step finishes, a checkpoint of it is written and waited for, and the
  process exits; a rerun resumes from exactly that step;
- the final save (the loop is over, the last checkpoint is being written): the save is waited
  for, then the process exits with 128 + signal.

A second signal says that the run is waiting for the step or save in flight; a third aborts
at once (``os._exit``), naming the newest complete checkpoint (a save cut short is never
restored: Orbax only renames complete checkpoints into place).

A hung run (a stuck collective or filesystem; the hang watchdog is off by default) cannot reach
the end of its step: if, after a signal, the loop makes no progress for
``max(MIN_GRACE_S, GRACE_STEPS x the longest step so far)`` and no save is running, the helper
thread exits with 128 + signal and one line. It saves nothing: the hung step's state lives on
the devices, donated to a step that never finishes; the newest complete checkpoint stays.

The helper thread learns of a signal through ``signal.set_wakeup_fd``, which the interpreter
writes from its C-level handler at once, even while the main thread is inside native code and
cannot run a Python handler.

With several processes every process must stop at the same step: JAX's coordination service
catches SIGTERM for that (its preemption notifier), and
``multihost_utils.reached_preemption_sync_point`` tells all processes together; there this
class handles SIGINT and SIGHUP only.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

from jax.experimental import multihost_utils

from maxfp4.loop import Hook
from maxfp4.reliability.signal_exit import STOP_SIGNALS, exit_now, honoured, signal_name

STARTUP, TRAINING, FINAL_SAVE = "start-up", "training", "final save"
STARTUP_EXIT_S = 5.0  # how long the main thread may take to unwind a start-up stop on its own
MIN_GRACE_S = 10.0  # a loop without progress this long after a signal counts as hung ...
GRACE_STEPS = 4  # ... or this many of its longest steps, whichever is longer


class InjectedFault(RuntimeError):
    """The failure ``resilience.fault.exception_at_step`` asked for."""


class Interrupted(BaseException):
    """A signal stopped the run; carries the exit code. A BaseException (as KeyboardInterrupt),
    so library code that catches ``Exception`` does not swallow a stop raised inside it."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(message or f"interrupted (exit code {code})")
        self.code = code
        self.message = message


def _start_up_stop(signum: int) -> str:
    return f"stopped by signal {signum} ({signal_name(signum)}) during start-up, before the first step; nothing was saved"


def _print(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class PreemptionWatch:
    """Remembers a stop request and acts on repeated signals and hangs; restores the previous
    handlers on ``close``. ``newest_checkpoint()`` names the newest complete checkpoint for the
    lines printed when the process is ended from the helper thread."""

    SIGNALS = STOP_SIGNALS

    def __init__(self, say: Callable[[str], None] = _print):
        self.signum: int | None = None
        self.phase = STARTUP
        self._say = say
        self.newest_checkpoint: Callable[[], str | None] = lambda: None
        self._exit_hooks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._count = 0
        self._signal_time: float | None = None
        self._last_beat = time.monotonic()
        self._longest_step = 0.0
        self._saving = 0  # saves or waits in progress on the main thread
        self._reported = False  # the main thread has printed its line about the stop
        self._closing = False
        self._previous: dict[int, object] = {}
        self._previous_wakeup: int | None = None
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._multi = False  # set by multiprocess(), once jax.distributed has started
        # Handlers can only be installed from the main thread (an embedding program may not be).
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self.SIGNALS:
            if honoured(s):
                self._previous[s] = signal.signal(s, self._handle)
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous_wakeup = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="maxfp4-signal-watch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the main thread's side

    def add_exit_hook(self, hook: Callable[[], None]) -> None:
        """Run before the helper thread ends the process (release the run-directory lock)."""
        self._exit_hooks.append(hook)

    def multiprocess(self) -> None:
        """Several processes: the coordination service's preemption notifier owns SIGTERM (it
        replaced our handler when jax.distributed started); leave it alone from now on."""
        self._multi = True
        self._previous.pop(signal.SIGTERM, None)

    def check_start_up(self) -> None:
        """Raise the start-up stop again if a signal came during start-up but its
        :class:`Interrupted` never reached :func:`run`: raised while the main thread was inside
        a finaliser or a generator's close, Python prints it as "ignored" and goes on."""
        with self._lock:
            signum = self.signum if self.phase == STARTUP else None
        if signum is not None:
            raise Interrupted(128 + signum, _start_up_stop(signum))

    def start_training(self) -> None:
        """The first step is compiled and dispatched: from now on a signal checkpoints."""
        self.check_start_up()
        with self._lock:
            self.phase = TRAINING
            self._last_beat = time.monotonic()

    def beat(self) -> None:
        """The loop made progress (a step was dispatched)."""
        with self._lock:
            now = time.monotonic()
            if self.phase == TRAINING:
                self._longest_step = max(self._longest_step, now - self._last_beat)
            self._last_beat = now

    @contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint save or wait: never cut short by the hang grace period."""
        with self._lock:
            self._saving += 1
        try:
            yield
        finally:
            with self._lock:
                self._saving -= 1
                self._last_beat = time.monotonic()

    def final_save(self) -> None:
        """The loop is over; what follows waits for the last checkpoint."""
        with self._lock:
            self.phase = FINAL_SAVE

    def reported(self) -> None:
        """The main thread printed its line about the stop: the helper thread stays quiet."""
        with self._lock:
            self._reported = True

    def should_stop(self, step: int) -> bool:
        if self._multi:
            if multihost_utils.reached_preemption_sync_point(step):
                self.signum = self.signum or signal.SIGTERM
                return True
            return False
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 0 if self.signum is None else 128 + int(self.signum)

    def _handle(self, signum, frame) -> None:
        del frame
        first = self.signum is None
        if first:
            self.signum = signum
        if self.phase == STARTUP and first:
            # Nothing trained yet: unwind now rather than finish starting up. Only once: a
            # second signal must not cut the unwinding short (the lock's release).
            raise Interrupted(128 + signum, _start_up_stop(signum))

    # ------------------------------------------------------------------ the helper thread

    def _watch(self) -> None:
        while True:
            try:
                self._reader.settimeout(1.0)
                data = self._reader.recv(64)
            except socket.timeout:
                self._check_hang()
                continue
            except OSError:
                return  # closed
            if not data or self._closing:
                return
            for signum in data:
                if signum in self._previous:
                    self._on_signal(signum)

    def _on_signal(self, signum: int) -> None:
        with self._lock:
            self._count += 1
            count, phase = self._count, self.phase
            if self._signal_time is None:
                self._signal_time = time.monotonic()
        name = f"signal {signum} ({signal_name(signum)})"
        if phase == STARTUP:
            if count == 1:
                threading.Thread(target=self._exit_if_still_starting, args=(signum,), daemon=True).start()
            return
        if count == 1:
            if phase == FINAL_SAVE:
                self._say(f"{name} during the final save: waiting for it to complete")
            return
        if count == 2:
            what = "the final save" if phase == FINAL_SAVE else "the running step and its checkpoint"
            self._say(f"{name} again: still waiting for {what}; a third signal aborts it")
            return
        self._abort(signum, f"{name} a third time: aborting without waiting; "
                            f"{self._describe_newest()}")

    def _exit_if_still_starting(self, signum: int) -> None:
        time.sleep(STARTUP_EXIT_S)
        with self._lock:
            quiet = self._reported
        if quiet:
            self._abort(signum, None)
        self._abort(signum, f"stopped by signal {signum} ({signal_name(signum)}) during start-up "
                            f"(while compiling or initialising), before the first step; nothing was saved")

    def _check_hang(self) -> None:
        with self._lock:
            if self._signal_time is None or self._saving or self.phase != TRAINING:
                return
            grace = max(MIN_GRACE_S, GRACE_STEPS * self._longest_step)
            idle = time.monotonic() - max(self._signal_time, self._last_beat)
            signum = self.signum or signal.SIGTERM
        if idle > grace:
            self._abort(signum, f"signal {signum} ({signal_name(signum)}): the loop made no progress for "
                                f"{idle:.0f} s (hung?); a hung step cannot be checkpointed; "
                                f"{self._describe_newest()}")

    def _describe_newest(self) -> str:
        try:
            newest = self.newest_checkpoint()
        except Exception:  # noqa: BLE001 - only for the message
            newest = None
        return (f"the newest complete checkpoint is {newest}" if newest else "there is no complete checkpoint")

    def _abort(self, signum: int, message: str | None) -> None:
        code = 128 + int(signum)
        if message:
            self._say(f"{message}; exiting with code {code}")
        self.end_process(code)

    def end_process(self, code: int) -> None:
        """Run the exit hooks (release the run lock), flush, and ``os._exit(code)``: no
        interpreter shutdown under native threads (a compile a signal interrupted)."""
        for hook in self._exit_hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        exit_now(code)

    def close(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self._writer is None:
            return
        signal.set_wakeup_fd(self._previous_wakeup if self._previous_wakeup is not None else -1)
        self._closing = True
        self._writer.send(b"\0")  # wakes the helper thread, which then returns
        self._thread.join(timeout=5)
        self._writer.close()
        self._reader.close()
        self._writer = self._reader = self._thread = None

    def __enter__(self) -> "PreemptionWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PreemptionHook(Hook):
    """Tells the watch where the loop is (compiled, stepping, saving for the last time), and
    after the loop reports a stop by signal: one line, then :class:`Interrupted` with 128 + signal.
    The loop itself asks ``watch.should_stop`` after each dispatch."""

    def __init__(self, watch: PreemptionWatch, *, checkpoints: bool, say: Callable[[str], None]):
        self.watch, self.checkpoints, self.say = watch, checkpoints, say

    def before_step(self, loop, step: int) -> None:
        if step == loop.start_step + 1:
            self.watch.check_start_up()  # before the first step compiles

    def after_dispatch(self, loop, step: int, metrics) -> None:
        if step == loop.start_step + 1:
            self.watch.start_training()  # compiled: from now on a signal checkpoints
        self.watch.beat()

    def on_loop_end(self, loop) -> None:
        self.watch.final_save()  # signals from here on wait for the last save (never cut it short)

    def on_finish(self, loop) -> None:
        if self.watch.signum is None:
            return
        saved = ("checkpoint saved, rerun to resume" if self.checkpoints else
                 "checkpointing is off (checkpoint.enabled=false): nothing was saved")
        self.say(f"stopped by signal {self.watch.signum} ({signal_name(self.watch.signum)}) after step "
                 f"{loop.last_step}; {saved}")
        self.watch.reported()
        raise Interrupted(self.watch.exit_code)
