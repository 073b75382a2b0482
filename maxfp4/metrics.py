"""Model FLOPs, device peaks, and the metrics sinks (JSONL, TensorBoard, progress line).

FLOPs per token (docs/METRICS.md) are :mod:`maxfp4.model_spec`'s: 6 x matmul parameters (every
linear layer, LM head included, the embedding lookup excluded) + causal attention 6 x L_attn x T
x d_attn (12 x ... for the score and value products forward and backward, halved because causal
attention skips half) + the SSD matmul FLOPs of Mamba-2 blocks.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import Any

import jax

from maxfp4.config import ModelConfig
from maxfp4.loop import Hook
from maxfp4.model_spec import model_spec
from maxfp4.precision.catalog import SPECS
from maxfp4.precision.policy import PrecisionPolicy
from maxfp4.step_clock import StepClock

# Dense datasheet peaks in TFLOP/s per device, by peak class (maxfp4.precision.catalog.PEAK_CLASSES).
DEVICE_PEAKS_TFLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989.0, "fp8": 1979.0},
    "H200": {"bf16": 989.0, "fp8": 1979.0},
    "B200": {"bf16": 2250.0, "fp8": 4500.0, "mxfp8": 4500.0, "fp4": 9000.0},
}


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs a token of training, as :mod:`maxfp4.model_spec` counts them."""
    return model_spec(cfg).flops_per_token(seq_len)


def device_peaks(device: jax.Device) -> dict[str, float] | None:
    """Peaks for a known accelerator; None on CPU and unknown devices (no MFU printed)."""
    kind = getattr(device, "device_kind", "")
    for name, peaks in DEVICE_PEAKS_TFLOPS.items():
        if name in kind:
            return peaks
    return None


def policy_peak_tflops(cfg: ModelConfig, seq_len: int, policy: PrecisionPolicy,
                       peaks: dict[str, float]) -> float:
    """The peak a perfect run of this policy could reach: each GEMM's FLOPs charged at its
    precision's peak (a precision the device lacks, such as FP4 on Hopper, at BF16); attention
    and SSD products at BF16."""
    def peak_for(recipe: str) -> float:
        return peaks.get(SPECS[recipe].peak, peaks["bf16"])

    spec = model_spec(cfg)
    unquantized = spec.attention_flops_per_token(seq_len) + spec.ssd_flops_per_token()
    total, seconds = unquantized, unquantized / peaks["bf16"]
    for layer, block in enumerate(spec.blocks):
        for lin in block.linears:
            total += 6.0 * lin.params
            seconds += 6.0 * lin.params / peak_for(policy.recipe_for(lin.layer_class, layer))
    head = 6.0 * spec.lm_head.params
    return (total + head) / (seconds + head / peak_for(policy.lm_head))


def format_duration(seconds: float) -> str:
    """``H:MM:SS``, with days in front past 24 hours (``3d 04:05:06``): plain arithmetic, as
    ``time.gmtime`` wraps at a day and raises past year 9999 (a run of 10**12 steps)."""
    if not math.isfinite(seconds):
        return "unknown"
    total = max(int(seconds), 0)
    days, rest = divmod(total, 86400)
    text = f"{rest // 3600:02d}:{rest // 60 % 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


_RECORD_STEP = re.compile(rb'\{"step": (\d+),')


def end_of_records(path: str, step: int) -> tuple[int, int]:
    """``(end, size)`` of metrics.jsonl for a run resuming at ``step``: ``end`` is the offset just
    after the newest record of a step up to ``step`` if that step is ``step`` (what follows was
    written after its checkpoint), else after the last complete line. Read from the end, so a
    long run's file costs only its tail; records start with their step (``{"step": N, ...``)."""
    with open(path, "rb") as fh:
        size = fh.seek(0, os.SEEK_END)
        span = 1 << 16
        while True:
            start = max(0, size - span)
            fh.seek(start)
            block = fh.read()
            lines = block.split(b"\n")  # the last: what follows the last newline (empty, or cut short)
            complete = offset = size - len(lines[-1])
            for line in reversed(lines[(0 if start == 0 else 1):-1]):  # a block's first line may be partial
                match = _RECORD_STEP.match(line)
                if match and int(match.group(1)) <= step:
                    return (offset if int(match.group(1)) == step else complete), size
                offset -= len(line) + 1
            if start == 0:
                return complete, size
            span *= 4


class MetricsLogger:
    """Writes metrics.jsonl and the trackers' records (when ``enabled``: process 0), and a
    progress line. ``trackers``: ``run.trackers`` (:mod:`maxfp4.trackers`); ``config``: the
    resolved config, the trackers' run parameters."""

    def __init__(self, run_dir: str, *, total_steps: int, enabled: bool = True, stream=None,
                 trackers=("tensorboard",), config: dict[str, Any] | None = None):
        self.enabled = enabled
        self.total_steps = total_steps
        self.stream = stream or sys.stdout
        self.run_dir = run_dir
        self._jsonl = None
        self._trackers = None
        if enabled:
            self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")
            from maxfp4.trackers import Trackers

            self._trackers = Trackers(trackers, run_dir, config=config or {}, say=self.say)
            self._trackers.log_files([os.path.join(run_dir, name) for name in ("config.yaml", "precision_table.txt")])

    def resume_at(self, step: int) -> None:
        """Before a run that starts at ``step`` (its checkpoint's) writes anything: the records
        after the newest one of ``step`` were written by a process stopped after that checkpoint
        (kill -9), and this run writes those steps again, so they move to
        metrics.superseded.jsonl, as does a line cut short; each step keeps one record."""
        if not self.enabled:
            return
        path = self._jsonl.name
        end, size = end_of_records(path, step)
        if end == size:
            return
        with open(path, "rb") as fh:
            fh.seek(end)
            tail = fh.read()
        aside = os.path.join(os.path.dirname(path), "metrics.superseded.jsonl")
        with open(aside, "ab") as out:  # kept before the file is cut: nothing written is lost
            out.write(tail if tail.endswith(b"\n") else tail + b"\n")
            out.flush()
            os.fsync(out.fileno())
        os.truncate(path, end)  # the append handle writes at the new end
        what = (f"the records after step {step}'s, written after its checkpoint by the process that stopped "
                f"(those steps run again)" if b"\n" in tail else "a line cut short")
        self.say(f"{path}: moved {what} to {aside}")

    def log(self, record: dict[str, Any]) -> None:
        self.write(record)
        self.say(self.progress_line(record))

    def write(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl and the trackers' scalars of one step."""
        if not self.enabled:
            return
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        self._trackers.log_scalars(record["step"], {k: v for k, v in record.items()
                                                    if k != "step" and isinstance(v, (int, float))})

    def say(self, line: str) -> None:
        if self.enabled:
            self.stream.write(line + "\n")
            self.stream.flush()

    def progress_line(self, r: dict[str, Any]) -> str:
        parts = [f"step {r['step']:>6d}/{self.total_steps}", f"loss {r['loss']:.4f}"]
        if "eval_loss" in r:
            parts.append(f"eval {r['eval_loss']:.4f}")
        if "compile_s" in r:  # the first step of this process: said once, never counted in tok/s
            split = (f" (lowering {r['lower_s']:.1f} s, XLA {r['xla_compile_s']:.1f} s)"
                     if "xla_compile_s" in r else "")
            parts.append(f"first step {r['first_step_s']:.1f} s, {r['compile_s']:.1f} s of it tracing and "
                         f"compiling{split} (not counted in tok/s)")
        if r.get("step_time_s") is None:
            return " | ".join(parts)
        parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
        if r.get("mfu") is not None:  # a known accelerator; a CPU has no stated peak, so neither is shown
            parts.append(f"{r['tflops_per_device']:.1f} TFLOP/s/dev")
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        eta = r.get("eta_s")
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._trackers:
            if set(self._trackers.names) - {"tensorboard"}:  # a tracker that keeps files gets the loss plot
                self._trackers.log_files([self._plot()])
            self._trackers.close()

    def _plot(self) -> str:
        from maxfp4.plot import plot_runs

        try:
            return plot_runs([self.run_dir], os.path.join(self.run_dir, "loss.png"))
        except Exception as error:  # noqa: BLE001 - a plot that cannot be drawn costs only the plot
            self.say(f"warning: no loss plot for the trackers ({type(error).__name__}: {error})")
            return ""


class MetricsHook(Hook):
    """Writes each finished step's metrics to metrics.jsonl and TensorBoard, and a progress line
    with rates every ``train.log_every`` steps (and on the first, the last and every evaluated step).

    Rates are measured from the moment the first step of this process has finished: that step
    traces and compiles the program, so it is waited for once (the only time the host waits for
    the device on purpose) and left out of tokens/s. A logged rate covers the steps since the
    previous logged line; the last line is followed by the rate over every measured step.
    """

    def __init__(self, logger: MetricsLogger, *, tokens_per_step: int, flops_per_step: float, n_devices: int,
                 peaks: dict[str, float] | None, policy_peak: float | None, log_every: int,
                 eval_losses: dict[int, float], stragglers=None, task_scores: dict[int, dict[str, float]] | None = None):
        self.logger = logger
        self.task_scores = task_scores if task_scores is not None else {}  # lm-eval metrics by step
        self.tokens_per_step, self.flops_per_step, self.n_devices = tokens_per_step, flops_per_step, n_devices
        self.peaks, self.policy_peak, self.log_every = peaks, policy_peak, log_every
        self.eval_losses, self.stragglers = eval_losses, stragglers
        self.records: list[dict[str, Any]] = []
        self._losses: list[tuple[float, bool]] = []  # (loss, skipped by the guard) since the last record
        self._first_step: int | None = None  # the first step this process ran (it compiled the program)
        self._first: dict[str, float] | None = None  # its timings, until its record takes them
        self._mark: tuple[int, float] | None = None  # (step, time) the current rate window starts at
        self._measured_steps, self._measured_s = 0, 0.0
        self._last: tuple[int, float] | None = None  # (step, time) the previous step finished
        self._untimed_through = 0  # steps up to this one finished before a host pause ended
        # A step's time runs from the previous step's end to its own, as the devices finished them
        # (maxfp4.step_clock), not from one read of the metrics to the next.
        self.clock = StepClock()
        self._tickets: dict[int, int] = {}  # step -> its StepClock ticket, until its metrics are read
        self._ends: dict[int, float] = {}  # step -> end time already waited for (the first step)

    def before_step(self, loop, step: int) -> None:
        if self._first_step is None and step == loop.start_step + 1:
            self.logger.resume_at(loop.start_step)

    def after_dispatch(self, loop, step: int, metrics) -> None:
        self._tickets[step] = self.clock.watch(metrics)
        if self._first_step is None:
            self._first_step = step
            dispatched = time.perf_counter()
            done = self._ends[step] = self.clock.ended_at(self._tickets.pop(step))
            self._first = {"compile_s": loop.dispatch_s, "first_step_s": loop.dispatch_s + done - dispatched,
                           **getattr(loop.step_fn, "phases", {})}
            self._mark = (step, done)

    def on_rewind(self, loop, step: int) -> None:
        self.clock.abandon(self._tickets.values())
        self._tickets.clear()
        self._losses.clear()
        self._last = None
        self._mark = None  # restarts at the next finished step

    def on_host_pause(self, loop, step: int) -> None:
        self._untimed_through = max(self._untimed_through, step)

    def _end_of(self, step: int) -> float:
        if step in self._ends:
            return self._ends.pop(step)
        ticket = self._tickets.pop(step, None)
        return self.clock.ended_at(ticket) if ticket is not None else time.perf_counter()

    def after_step(self, loop, step: int, values: dict[str, float], final: bool) -> None:
        now = self._end_of(step)
        if step <= self._untimed_through:  # fetched after a host pause: no step time, a new window
            self._last = self._mark = None
        previous, self._last = self._last, (step, now)
        self._losses.append((values["loss"], bool(values["skipped"])))
        if self._mark is None:
            self._mark = (step, now)
        # Every step goes to metrics.jsonl and TensorBoard with its own loss (the plot's curves);
        # the terminal line, and the records the run returns, come every train.log_every steps.
        if not (step % self.log_every == 0 or final or step == loop.start_step + 1 or step in self.eval_losses
                or step in self.task_scores):
            # Timed from the previous step's end, so never the compile.
            step_time = now - previous[1] if previous is not None and previous[0] == step - 1 else None
            self.logger.write(self._fields(step, values["loss"], values, step_time, loop.total_steps))
            return
        record = self._record(step, values, now, loop.total_steps)
        self.records.append(record)
        self.logger.write(dict(record, loss=values["loss"]))
        self.logger.say(self.logger.progress_line(record))
        if final and self._measured_steps:
            self.logger.say(self.summary())

    def _record(self, step: int, values: dict[str, float], now: float, total_steps: int) -> dict[str, Any]:
        # The logged loss is the mean since the last record: one step's loss is too noisy.
        # Skipped steps' losses are left out (they may be NaN) unless every step was skipped.
        kept = [loss for loss, skipped in self._losses if not skipped] or [l for l, _ in self._losses]
        self._losses.clear()
        mark_step, mark_time = self._mark
        step_time = (now - mark_time) / (step - mark_step) if step > mark_step else None
        if step_time is not None:
            self._measured_steps += step - mark_step
            self._measured_s += now - mark_time
            self._mark = (step, now)
        record = self._fields(step, sum(kept) / len(kept), values, step_time, total_steps)
        if self._first is not None and step == self._first_step:
            record.update(self._first)
            self._first = None
        if step in self.eval_losses:
            record["eval_loss"] = self.eval_losses.pop(step)
        record.update(self.task_scores.pop(step, {}))
        report = self.stragglers.take_report(step) if self.stragglers is not None else None
        if report is not None:
            record["straggler_processes"] = report["slow"]
        return record

    def _fields(self, step: int, loss: float, values: dict[str, float], step_time: float | None,
                total_steps: int) -> dict[str, Any]:
        """A record's fields: the step's values, and what ``step_time`` gives: tokens/s, TFLOP/s per
        device, MFU (None without a stated peak), ETA."""
        tflops = self.flops_per_step / step_time / self.n_devices / 1e12 if step_time else None
        return {
            "step": step,
            "loss": loss,
            "grad_norm": values["grad_norm"],
            "lr": values["lr"],
            "tokens_per_s": self.tokens_per_step / step_time if step_time else None,
            "tflops_per_device": tflops,
            "mfu": tflops / self.peaks["bf16"] if self.peaks and tflops else None,
            "mfu_policy_peak": tflops / self.policy_peak if self.policy_peak and tflops else None,
            "step_time_s": step_time,
            "eta_s": (total_steps - step) * step_time if step_time else None,
            "skipped_steps": int(values["skipped_steps"]),
            **({"rerun_verdict": int(values["rerun_verdict"])} if "rerun_verdict" in values else {}),
            **{k: v for k, v in values.items() if k.startswith("moe_")},  # router statistics (docs/MOE.md)
        }

    def summary(self) -> str:
        rate = self.tokens_per_step * self._measured_steps / self._measured_s
        return (f"measured {self._measured_steps} step(s) in {self._measured_s:.1f} s: {rate:,.0f} tok/s "
                f"(the first step, compilation included, not counted)")

    def close(self) -> None:
        self.clock.close()
        self.logger.close()
