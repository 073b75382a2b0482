"""Ending the process on a stop signal without the interpreter's shutdown. Imports nothing
heavy, so the command line can use it before its own imports (which take seconds) run.

Why ``os._exit``: a signal that arrives while XLA compiles is raised out of the compile call
(jaxlib polls for signals there) while XLA's compiler threads keep running; a normal exit then
runs C++ static destructors under those threads and segfaults (exit 139 instead of 143). A
start-up stop has nothing to save, so nothing is lost by skipping the finalizers once the
standard streams are flushed and the run lock released.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from typing import Iterator

# SIGHUP: an ssh session that started the run ended; treated as SIGTERM.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def honoured(signum: int) -> bool:
    """A SIGHUP the run was started to ignore (``nohup``) stays ignored; SIGTERM and SIGINT are
    always handled."""
    return signum != signal.SIGHUP or signal.getsignal(signum) is not signal.SIG_IGN


def exit_now(code: int) -> None:
    """Flush stdout and stderr, then end the process with ``code`` and no finalizers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed terminal or stream: exiting anyway
            pass
    os._exit(code)


def _stop_while_importing(signum, frame) -> None:
    del frame
    try:
        print(f"stopped by signal {signum} ({signal_name(signum)}) while starting, before the config was read; "
              f"nothing was saved", file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass
    exit_now(128 + signum)


def stop_quietly_while_importing() -> None:
    """Until ``main()`` installs its own handlers: a stop signal prints one line and exits with
    128 + signal (not a ``KeyboardInterrupt`` traceback from somewhere inside an import)."""
    for signum in STOP_SIGNALS:
        if honoured(signum):
            signal.signal(signum, _stop_while_importing)


def default_actions_after_main() -> None:
    """After ``main()`` returns: a signal during the interpreter's shutdown takes its default
    action (the line above would misreport it)."""
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is _stop_while_importing:
            signal.signal(signum, signal.SIG_DFL)


# Larger than any C library's struct sigaction (152 bytes with x86-64 glibc): the bytes are
# copied back whole, never parsed, so no layout is assumed.
_SIGACTION_BYTES = 512


def _disposition(libc: ctypes.CDLL, signum: int) -> bytes | None:
    """The signal's handler, mask and flags as sigaction(2) reports them (opaque bytes)."""
    current = ctypes.create_string_buffer(_SIGACTION_BYTES)
    return current.raw if libc.sigaction(signum, None, current) == 0 else None


@contextlib.contextmanager
def stop_handlers_kept() -> Iterator[None]:
    """Native code run inside (an import) may not take the stop signals over: a stop signal
    whose handler, as the C library reports it, changed is given its handler back afterwards.

    Why: ``jax._src.test_util``, which jax's Pallas GPU example kernels import, installs absl's
    failure signal handler as it is imported. On SIGTERM that handler prints a stack trace, calls
    the handler it replaced and arms an alarm that aborts the process 3 s later (exit 134 / -6):
    a graceful stop then loses whatever its checkpoint had not written by then (an MoE run on
    an H200 was aborted while deleting its rotated-out checkpoint). Whoever owns a signal before
    (this process's Python handlers, or JAX's preemption notifier with several processes)
    still owns it after."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        saved = {signum: _disposition(libc, signum) for signum in STOP_SIGNALS}
    except (OSError, AttributeError):  # no C library to ask (not a POSIX system): nothing to keep
        libc, saved = None, {}
    try:
        yield
    finally:
        for signum, before in saved.items():
            if before is not None and _disposition(libc, signum) != before:
                libc.sigaction(signum, ctypes.create_string_buffer(before, _SIGACTION_BYTES), None)
