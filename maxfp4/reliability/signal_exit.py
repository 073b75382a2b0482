"""Ending the process on a stop signal without the interpreter's shutdown. Imports nothing
heavy, so the command line can use it before its own imports (which take seconds) run.

Why ``os._exit``: a signal that arrives while XLA compiles is raised out of the compile call
(jaxlib polls for signals there) while XLA's compiler threads keep running; a normal exit then
runs C++ static destructors under those threads and segfaults (exit 139 instead of 143). A
start-up stop has nothing to save, so nothing is lost by skipping the finalizers once the
standard streams are flushed and the run lock released.
"""

from __future__ import annotations

import os
import signal
import sys

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
