"""What a crashed run leaves behind: ``<run_dir>/crash.json`` and one line.

A crash report must not become a second failure: on a full disk (the likeliest reason a run
cannot write) the temporary file is removed and the caller says so on stderr instead.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys
import time
import traceback
from typing import Any

from maxfp4.files import atomic_file

# errno values that mean "the storage is full", not "this path is wrong".
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
DISK_FULL_TEXTS = ("No space left on device", "Disk quota exceeded", "File too large")
# EFBIG is a limit on one file (ulimit -f, or the file system's largest file), not on space.
FILE_TOO_LARGE = os.strerror(errno.EFBIG)


class RunFailed(Exception):
    """The run cannot go on for a reason outside the program (a full disk): one line on stderr,
    exit code 1, no traceback (the traceback is in ``crash.json`` when it could be written)."""

    exit_code = 1


def disk_full_reason(error: BaseException) -> str | None:
    """``"No space left on device"`` (or quota, file size) if ``error`` or any error it wraps
    (TensorStore's and Orbax's included, which keep only the text) says the storage is full."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL_ERRNOS:
            return os.strerror(current.errno)
        text = str(current)
        for phrase in DISK_FULL_TEXTS:
            if phrase in text:
                return phrase
        current = current.__cause__ or current.__context__
    return None


class DropDiskFullErrors(logging.Filter):
    """Orbax logs a full disk from its background threads with whole tracebacks (hundreds of
    lines) before the error reaches the loop; the loop reports it in one line (and the traceback
    in crash.json), so those records are dropped. Other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        error = record.exc_info[1] if record.exc_info else None
        return not ((error is not None and disk_full_reason(error)) or disk_full_reason(Exception(record.getMessage())))


def _is_closed_loop_callback(error: BaseException | None) -> bool:
    # TensorStore completes the writes of a failed save after Orbax closed the asyncio loop
    # that awaited them; their callbacks then fail in loop.call_soon_threadsafe. Nothing is lost.
    if not isinstance(error, RuntimeError) or str(error) != "Event loop is closed":
        return False
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.endswith(os.path.join("asyncio", "base_events.py"))


def quiet_disk_full_logs() -> None:
    """For the command line: Orbax's records of a full disk (absl's logger, which Orbax logs
    to, and asyncio's for the tasks it abandons) and the callbacks of TensorStore writes it abandoned are not printed; the loop reports
    the failure in one line."""
    for name in ("absl", "asyncio"):  # Orbax's own records; its abandoned tasks' errors
        logging.getLogger(name).addFilter(DropDiskFullErrors())
    excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

    def on_exception(kind, error, tb):
        if not _is_closed_loop_callback(error):
            excepthook(kind, error, tb)

    def on_unraisable(info):
        if not _is_closed_loop_callback(info.exc_value):
            unraisablehook(info)

    sys.excepthook, sys.unraisablehook = on_exception, on_unraisable


def write_crash_report(run_dir: str, error: BaseException, *, step: int | None, config: dict[str, Any],
                       last_metrics: dict[str, Any] | None, reruns: list[dict[str, Any]] | None = None) -> str:
    """``<run_dir>/crash.json`` next to the metrics: what failed, where, at which step, with
    which config and the last metrics, so the operator need not dig through scheduler logs.
    ``reruns``: each skipped step's re-run (maxfp4.reliability.rerun), when they are on, which
    tells a divergence from a faulty device.
    Written under a temporary name and renamed; raises OSError (the temporary file removed)
    if it cannot be written."""
    path = os.path.join(run_dir, "crash.json")
    report = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "error": f"{type(error).__name__}: {error}",
        "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__)),
        "step": step,
        "last_metrics": last_metrics,
        "config": config,
    }
    if reruns is not None:
        report["reruns"] = reruns
    os.makedirs(run_dir, exist_ok=True)
    with atomic_file(path) as fh:
        json.dump(report, fh, indent=1, default=str)
    return path


def crash_error(run_dir: str, error: Exception, *, step: int, config: dict[str, Any],
                last_metrics: dict | None, newest_checkpoint, remove_partial_saves, say,
                reruns: list[dict[str, Any]] | None = None) -> BaseException:
    """Report a crash (crash.json, one line) and return what to raise. A full disk is no bug:
    one line naming the directory and the newest complete checkpoint, no traceback; the
    temporary directory of the save it cut short is removed to give the space back."""
    import jax

    full = disk_full_reason(error)
    if full:
        remove_partial_saves()
    report = None
    if jax.process_index() == 0:
        try:
            report = write_crash_report(run_dir, error, step=step, config=config, last_metrics=last_metrics,
                                        reruns=reruns)
        except OSError as e:
            report = f"not written ({e.strerror or e})"
    if full:
        remedy = ("raise the file size limit (ulimit -f) or use a file system that holds larger files"
                  if full == FILE_TOO_LARGE else "free space")
        return RunFailed(f"{run_dir}: {full} at step {step}; the newest complete checkpoint is "
                         f"{newest_checkpoint() or 'none'}, intact; {remedy} and rerun to resume; crash report {report}")
    if report is not None:
        say(f"crashed: {type(error).__name__}: {error}; report {report}")
    return error
