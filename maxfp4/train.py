"""``python -m maxfp4.train CONFIG [dotted.key=value ...]``: train a model from a YAML config.

Writes ``<output_dir>/<name>/{config.yaml, precision_table.txt, metrics.jsonl, tensorboard/}``.
Bad input is reported as one line and exit code 2, before anything is compiled.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from jax.sharding import NamedSharding, PartitionSpec

from maxfp4 import distributed
from maxfp4.checkpoint import Checkpointer, finalized_steps, refuse_changed_run
from maxfp4.compiler import (check_compiler_options, check_deterministic_attention, compiler_options,
                             determinism_summary, use_compile_cache)
from maxfp4.config import Config, ConfigError, add_config_arguments, config_from_arguments
from maxfp4.reliability.crash import RunFailed, disk_full_reason, quiet_disk_full_logs, write_crash_report
from maxfp4.data import make_batches, make_eval_batches
from maxfp4.errors import exit_code_of
from maxfp4.evaluate import make_eval_step, mean_eval_loss
from maxfp4.reliability.faults import hang_forever, maybe_slow_down
from maxfp4.reliability.guard import init_guard_state
from maxfp4.mesh import batch_sharding, check_model_fits_mesh, make_constrain, make_mesh, tree_shardings
from maxfp4.metrics import MetricsLogger, block_linear_params, device_peaks, flops_per_token, policy_peak_tflops
from maxfp4.model import get_model, linear_shapes
from maxfp4.optim import make_optimizer, make_schedule
from maxfp4.precision import resolve_policy
from maxfp4.precision.policy import check_block_divisibility, unmatched_rules
from maxfp4.precision.state import init_precision_state
from maxfp4.profiling import StepProfiler
from maxfp4.reliability.preflight import preflight_summary
from maxfp4.reliability.preemption import InjectedFault, Interrupted, PreemptionWatch, signal_name
from maxfp4.reliability.rollback import Diverged, Rollbacks
from maxfp4.reliability.run_lock import RunLock, RunLocked
from maxfp4.state import TrainState
from maxfp4.step import check_loss_chunks, make_train_step
from maxfp4.reliability.stragglers import StragglerMonitor
from maxfp4.reliability.watchdog import HangWatchdog


def _say(msg: str) -> None:
    prefix = f"[process {jax.process_index()}] " if jax.process_count() > 1 else ""
    print(prefix + msg, flush=True)


def _check_batch_fits_mesh(cfg: Config, mesh) -> None:
    batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.data.global_batch // cfg.train.microbatches
    if micro % batch_devices:
        raise ConfigError(
            f"data.global_batch={cfg.data.global_batch}: expected a multiple of "
            f"train.microbatches x mesh.data x mesh.fsdp = {cfg.train.microbatches * batch_devices}")


def _write_atomic(path: str, text: str) -> None:
    # A stop (signal) or full disk while writing leaves the old file, never half a new one.
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _write_run_files(cfg: Config, run_dir: str, table: str) -> None:
    _write_atomic(os.path.join(run_dir, "config.yaml"), yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    _write_atomic(os.path.join(run_dir, "precision_table.txt"), table + "\n")


def _lock_run_dir(run_dir: str) -> RunLock | None:
    """Process 0 takes ``<run_dir>/run.lock``; every process learns whether it got it, so a
    refused job stops everywhere with one line instead of hanging its other processes."""
    lock = RunLock(run_dir, say=_say) if jax.process_index() == 0 else None
    refusal = None
    if lock is not None:
        try:
            lock.acquire()
        except RunLocked as e:
            refusal = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        took = multihost_utils.broadcast_one_to_all(np.int32(refusal is None))
        if not int(took) and refusal is None:
            raise RunLocked(f"run directory {run_dir} is in use by another run (process 0 could not lock it)")
    if refusal is not None:
        raise refusal
    return lock


def _newest_checkpoint(run_dir: str) -> str | None:
    steps = finalized_steps(run_dir)
    return os.path.join(run_dir, "checkpoints", str(steps[-1])) if steps else None


def state_maker(cfg: Config, mesh, optimizer: optax.GradientTransformation, policy=None):
    """``(make, state_shardings)``: ``make(key)`` builds the train state; jitted with
    ``out_shardings=state_shardings`` it initialises each shard in place, and under
    ``jax.eval_shape`` it gives the state's shapes without allocating it."""
    policy = policy or resolve_policy(cfg.precision, cfg.model.n_layers)
    model = get_model(cfg.model)
    axes = model.param_axes(cfg.model)
    key = jax.random.key(cfg.run.seed)
    param_shapes = jax.eval_shape(lambda k: model.init_params(cfg.model, k), key)
    param_sh = tree_shardings(axes, param_shapes, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shapes = jax.eval_shape(optimizer.init, param_shapes)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_shapes, param_sh,
                                   transform_non_params=lambda _: replicated)
    prec_sh = jax.tree.map(lambda _: replicated,
                           jax.eval_shape(lambda: init_precision_state(policy, model.block_layer_classes)))
    guard_sh = jax.tree.map(lambda _: replicated, jax.eval_shape(lambda: init_guard_state(cfg.resilience.spike_window)))
    state_sh = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                          precision=prec_sh, guard=guard_sh)

    def make(k):
        params = model.init_params(cfg.model, k)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=optimizer.init(params), rng=jax.random.fold_in(k, 1),
                          precision=init_precision_state(policy, model.block_layer_classes),
                          guard=init_guard_state(cfg.resilience.spike_window))

    return make, state_sh


def init_state(cfg: Config, mesh, optimizer: optax.GradientTransformation, policy=None):
    """Initialise the train state directly into its shardings (no full copy on one device)."""
    make, state_sh = state_maker(cfg, mesh, optimizer, policy)
    state = jax.jit(make, out_shardings=state_sh)(jax.random.key(cfg.run.seed))
    return state, state_sh


def jit_train_step(cfg: Config, policy, optimizer: optax.GradientTransformation, schedule, mesh,
                   state_sh, xla_options: dict, runs_per_row: int | None = None):
    """The train step jitted as the loop runs it: state and batch in their shardings, metrics
    replicated, the old state's buffers donated to the new one. ``runs_per_row``: the data's
    bound on segment runs per row (:func:`maxfp4.step.make_loss_fn`)."""
    step_fn = make_train_step(cfg, policy, optimizer, schedule, make_constrain(mesh), runs_per_row)
    return jax.jit(step_fn, in_shardings=(state_sh, batch_sharding(mesh)),
                   out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())), donate_argnums=0,
                   compiler_options=xla_options)


def train(cfg: Config, *, devices: Sequence[jax.Device] | None = None, stream=None,
          watch: PreemptionWatch | None = None) -> list[dict[str, Any]]:
    """Run the training loop described by ``cfg``; returns the logged metric records. ``watch``:
    the signal handling the command line installs at its start (else installed here)."""
    own_watch = watch is None
    watch = watch or PreemptionWatch(say=_say)
    if jax.process_count() > 1:
        watch.multiprocess()
    watch.newest_checkpoint = lambda: _newest_checkpoint(cfg.run_dir)
    try:
        return _train(cfg, devices, stream, watch)
    finally:
        if own_watch:
            watch.close()


def _train(cfg: Config, devices, stream, watch: PreemptionWatch) -> list[dict[str, Any]]:
    run_dir = cfg.run_dir
    is_writer = jax.process_index() == 0

    compile_cache = use_compile_cache(cfg.run.compile_cache_dir)  # before anything compiles
    # Everything that can be refused is checked before the run directory is touched.
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    block_classes = get_model(cfg.model).block_layer_classes
    model_classes = set(block_classes) | {"lm_head"}
    check_block_divisibility(policy, {c: s for c, s in linear_shapes(cfg.model).items() if c in model_classes})
    check_loss_chunks(cfg, policy)
    table = policy.format_table(block_classes)
    # A rule that decides nothing here (a preset shared by dense and hybrid models, or a typo) is shown, not refused.
    for line in unmatched_rules(cfg.precision, cfg.model.n_layers, [set(b) for b in block_linear_params(cfg.model)]):
        table += f"\nwarning: {line}"
        if is_writer:
            print(f"warning: {line}", file=sys.stderr, flush=True)
    mesh = make_mesh(cfg.mesh, devices)
    check_model_fits_mesh(cfg.model, mesh)
    _check_batch_fits_mesh(cfg, mesh)
    xla_options = compiler_options(mesh.devices.flat[0].platform, cfg.train.compiler_options, cfg.run.deterministic)
    check_compiler_options(xla_options, mesh.devices.flat[0])
    check_deterministic_attention(cfg, mesh.devices.flat[0].platform)
    refuse_changed_run(cfg)
    lock = _lock_run_dir(run_dir)  # before anything is written to the run directory
    if lock is not None:
        watch.add_exit_hook(lock.release)
    try:
        return _run(cfg, stream, watch, lock, policy, block_classes, table, mesh, xla_options, compile_cache)
    finally:
        if lock is not None:
            lock.release()


def _run(cfg: Config, stream, watch: PreemptionWatch, lock: RunLock | None, policy, block_classes,
         table: str, mesh, xla_options: dict, compile_cache) -> list[dict[str, Any]]:
    run_dir = cfg.run_dir
    is_writer = jax.process_index() == 0
    if cfg.resilience.preflight:
        summary = preflight_summary(cfg, list(mesh.devices.flat))
        if is_writer:
            _say(summary)
    data = make_batches(cfg, run_dir, process_index=jax.process_index(),
                        process_count=jax.process_count())
    # Held-out batches are built now so bad eval data is refused before anything compiles.
    eval_local = (make_eval_batches(cfg, run_dir, process_index=jax.process_index(),
                                    process_count=jax.process_count(), corpus=data.corpus)
                  if cfg.train.eval_every else [])
    if is_writer:
        _write_run_files(cfg, run_dir, table)
        _say(f"run directory {run_dir}")
        _say("precision policy:\n" + table)
        _say(f"mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} device(s)")
        _say(f"compilation cache {compile_cache or 'off'}; {determinism_summary(xla_options)}")

    optimizer = make_optimizer(cfg)
    schedule = make_schedule(cfg)
    state, state_sh = init_state(cfg, mesh, optimizer, policy)
    checkpointer = Checkpointer(run_dir, cfg.checkpoint)
    resumed = checkpointer.restore_latest(state, warn=lambda m: _say(f"warning: {m}"))
    if resumed is not None:
        resume_step, state, data_state = resumed
        data.set_state(data_state)
        if is_writer:
            _say(f"resumed from {checkpointer.directory}/{resume_step}")
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    if is_writer:
        from maxfp4.model.attention import resolve_implementation
        _say(f"model: {n_params / 1e6:.1f}M parameters, {cfg.model.n_layers} blocks, "
             f"attention {resolve_implementation(cfg.model.attention)}, remat {cfg.train.remat}")

    constrain = make_constrain(mesh)
    b_sh = batch_sharding(mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    # The data's bound on documents per row is the same on every process (the packing layout
    # is global), so every process compiles the same attention kernel.
    jitted = jit_train_step(cfg, policy, optimizer, schedule, mesh, state_sh, xla_options, data.max_runs_per_row)

    eval_fn = jax.jit(make_eval_step(cfg, policy, constrain), in_shardings=(state_sh, b_sh),
                      out_shardings=(replicated, replicated))
    eval_losses: dict[int, float] = {}  # step -> held-out loss, added to that step's metrics record

    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    step_flops = flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step
    n_devices = mesh.devices.size
    peaks = device_peaks(mesh.devices.flat[0])
    policy_peak = policy_peak_tflops(cfg.model, cfg.data.seq_len, policy, peaks) if peaks else None
    logger = MetricsLogger(run_dir, total_steps=cfg.train.steps, enabled=is_writer, stream=stream)

    def to_global(local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        return {k: jax.make_array_from_process_local_data(b_sh, v) for k, v in local.items()}

    eval_global = [to_global(b) for b in eval_local]
    records: list[dict[str, Any]] = []
    failing = False
    start_step = int(state.step)
    pending: tuple[int, dict[str, jax.Array]] | None = None
    last_time: float | None = None
    step_times: list[float] = []
    losses_since_log: list[tuple[float, bool]] = []  # (loss, skipped by the guard)

    def flush(step: int, metrics: dict[str, jax.Array], final: bool) -> dict[str, float]:
        """Fetch a finished step's metrics (the next step is already queued) and log them."""
        nonlocal last_time, straggler_report
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        if last_time is not None:
            step_times.append(now - last_time)
        last_time = now
        watchdog.beat(step, values)
        if stragglers and step % res.straggler_every == 0:  # a collective: same steps everywhere
            straggler_report = stragglers.report()
            if is_writer:
                _say(stragglers.describe(straggler_report))
        losses_since_log.append((values["loss"], bool(values["skipped"])))
        if not (step % cfg.train.log_every == 0 or final or step == start_step + 1 or step in eval_losses):
            return values
        recent = step_times[-cfg.train.log_every:]
        # The logged loss is the mean since the last log line: one step's loss is too noisy.
        # Skipped steps' losses are left out (they may be NaN) unless every step was skipped.
        kept = [loss for loss, skipped in losses_since_log if not skipped] or [l for l, _ in losses_since_log]
        mean_loss = sum(kept) / len(kept)
        losses_since_log.clear()
        step_time = sum(recent) / len(recent) if recent else math.nan  # first step: compile
        tflops = step_flops / step_time / n_devices / 1e12 if recent else 0.0
        record = {
            "step": step,
            "loss": mean_loss,
            "grad_norm": values["grad_norm"],
            "lr": values["lr"],
            "tokens_per_s": tokens_per_step / step_time if recent else 0.0,
            "tflops_per_device": tflops,
            "mfu": tflops / peaks["bf16"] if peaks and recent else None,
            "mfu_policy_peak": tflops / policy_peak if policy_peak and recent else None,
            "step_time_s": step_time if recent else None,
            "eta_s": (cfg.train.steps - step) * step_time if recent else None,
            "skipped_steps": int(values["skipped_steps"]),
        }
        if step in eval_losses:
            record["eval_loss"] = eval_losses.pop(step)
        if straggler_report is not None:
            record["straggler_processes"] = straggler_report["slow"]
            straggler_report = None
        records.append(record)
        logger.log(record)
        return values

    profiler = StepProfiler(cfg.train.profile_steps, os.path.join(run_dir, "profile"), enabled=is_writer)
    res, fault = cfg.resilience, cfg.resilience.fault
    watchdog = HangWatchdog(run_dir, res.hang_timeout_s, jax.process_index(),
                            on_exit=lock.release if lock is not None else lambda: None)
    stragglers = StragglerMonitor(res.straggler_threshold) if res.straggler_every else None
    straggler_report: dict[str, Any] | None = None
    rollbacks = Rollbacks(res.max_consecutive_skips, res.max_rollbacks, suspend_steps=res.spike_window,
                          checkpoint=cfg.checkpoint)
    try:
        step = start_step
        while step < cfg.train.steps:
            if step + 1 == fault.hang_at_step:
                hang_forever()
            host_start = time.perf_counter()
            maybe_slow_down(jax.process_index(), fault.slow_process, fault.slow_seconds)
            batch = to_global(next(data))
            profiler.before_dispatch(step + 1)
            state, metrics = jitted(state, batch)
            if step == start_step:
                watch.start_training()  # compiled: from now on a signal checkpoints
            watch.beat()
            profiler.after_dispatch(step + 1, metrics)
            if stragglers and step > start_step:  # host time: making and dispatching a step (not compiling it)
                stragglers.add(time.perf_counter() - host_start)
            stop = watch.should_stop(step + 1)
            if cfg.checkpoint.enabled and (stop or checkpointer.due(step + 1, cfg.train.steps)):
                with watch.saving():
                    checkpointer.save(step + 1, state, data.get_state(), cfg.to_dict())  # before the state is donated
            if eval_global and ((step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps):
                eval_losses[step + 1] = mean_eval_loss(eval_fn, state, eval_global)
            done = flush(*pending, final=False) if pending is not None else None
            pending = (step + 1, metrics)
            if not stop and done is not None and rollbacks.needed(int(done["consecutive_skips"]), step):
                state, rolled_back = rollbacks.recover(
                    checkpointer, state, step=step, consecutive=int(done["consecutive_skips"]),
                    nonfinite=int(done["streak_nonfinite"]), skipped_total=int(done["skipped_steps"]), say=_say)
                if rolled_back:  # the queued step is abandoned with the rest of the streak's branch
                    step, pending, last_time = int(state.step), None, None
                    losses_since_log.clear()
                    watchdog.beat(step)
                    continue
            if stop:
                break
            if step + 1 == fault.exception_at_step:
                raise InjectedFault(f"resilience.fault.exception_at_step={fault.exception_at_step}")
            step += 1
        # The loop is over; signals from here on wait for the last save (never cut it short).
        watch.final_save()
        if pending is not None:
            flush(*pending, final=True)
        with watch.saving():
            checkpointer.wait()
        if watch.signum is not None:
            last = pending[0] if pending else start_step
            saved = ("checkpoint saved, rerun to resume" if cfg.checkpoint.enabled else
                     "checkpointing is off (checkpoint.enabled=false): nothing was saved")
            _say(f"stopped by signal {watch.signum} ({signal_name(watch.signum)}) after step {last}; {saved}")
            watch.reported()
            raise Interrupted(watch.exit_code)
    except Interrupted:
        raise
    except Exception as error:
        failing = True
        raise _crashed(cfg, error, checkpointer, step=pending[0] if pending else start_step,
                       last_metrics=records[-1] if records else None) from None
    finally:
        _close_all([profiler.close, watchdog.close, logger.close, checkpointer.close], quietly=failing)
    return records


def _crashed(cfg: Config, error: Exception, checkpointer: Checkpointer, *, step: int,
             last_metrics: dict | None) -> BaseException:
    """Report a crash (crash.json, one line) and return what to raise. A full disk is no bug:
    one line naming the directory and the newest complete checkpoint, no traceback; the
    temporary directory of the save it cut short is removed to give the space back."""
    full = disk_full_reason(error)
    if full:
        checkpointer.remove_partial_saves()
    report = None
    if jax.process_index() == 0:
        try:
            report = write_crash_report(cfg.run_dir, error, step=step, config=cfg.to_dict(), last_metrics=last_metrics)
        except OSError as e:
            report = f"not written ({e.strerror or e})"
    if full:
        newest = _newest_checkpoint(cfg.run_dir)
        return RunFailed(f"{cfg.run_dir}: {full} at step {step}; the newest complete checkpoint is "
                         f"{newest or 'none'}, intact; free space and rerun to resume; crash report {report}")
    if report is not None:
        _say(f"crashed: {type(error).__name__}: {error}; report {report}")
    return error


def _close_all(closers, quietly: bool) -> None:
    """Close everything even if one fails; while an error is already on its way out, a second
    one (a full disk fails every writer) is not raised over it."""
    first: Exception | None = None
    for close in closers:
        try:
            close()
        except Exception as e:  # noqa: BLE001 - raised below unless another error is leaving
            first = first or e
    if first is not None and not quietly:
        raise first


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m maxfp4.train", description="Train a language model from a YAML config.")
    add_config_arguments(parser)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    distributed.set_gpu_environment_defaults()  # before anything starts the GPU backend

    # Signals are handled from here on: a stop during start-up is one line, not a traceback.
    watch = PreemptionWatch(say=lambda m: print(m, file=sys.stderr, flush=True))
    quiet_disk_full_logs()  # a full disk is reported in one line, not Orbax's tracebacks

    def run() -> None:
        cfg = config_from_arguments(args)
        how = distributed.initialize(cfg.distributed)
        _say(f"{how}; {jax.local_device_count()} local of {jax.device_count()} devices")
        train(cfg, watch=watch)

    try:
        return exit_code_of(run)
    except Interrupted as stop:
        if stop.message:  # a stop during start-up; later stops were reported by train()
            watch.reported()
            print(stop.message, file=sys.stderr, flush=True)
        return stop.code
    except Diverged as stop:  # already explained in the log and crash.json
        return stop.exit_code
    except RunFailed as failed:
        print(f"error: {failed}", file=sys.stderr, flush=True)
        return failed.exit_code
    finally:
        watch.close()


if __name__ == "__main__":
    sys.exit(main())
