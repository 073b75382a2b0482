"""``python -m maxfp4.train CONFIG [dotted.key=value ...]``: train a model from a YAML config.

Writes ``<output_dir>/<name>/{config.yaml, precision_table.txt, metrics.jsonl, tensorboard/}``.
Bad input is reported as one line and exit code 2, before anything is compiled.

:func:`train` reads as the data flow: start-up checks (nothing written yet), the locked run
directory, data, state (restored if the run exists), the jitted step, and a :class:`Loop` with
hooks for everything else (metrics, checkpoints, evaluation, reliability).
"""

from __future__ import annotations

from maxfp4.reliability.signal_exit import default_actions_after_main, stop_quietly_while_importing

if __name__ == "__main__":
    stop_quietly_while_importing()  # the imports below take seconds: a Ctrl-C there is one line

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import optax
import yaml
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxfp4 import distributed, elastic
from maxfp4.checkpoint import (Checkpointer, CheckpointHook, checkpoint_dir, finalized_steps, refuse_changed_run,
                               unfinished_saves)
from maxfp4.compiler import (check_compiler_options, check_deterministic_attention, compiler_options,
                             determinism_summary, use_compile_cache)
from maxfp4.config import Config, ConfigError, add_config_arguments, config_from_arguments
from maxfp4.data import make_batches, make_eval_batches
from maxfp4.errors import exit_code_of
from maxfp4.evaluate import EvalHook, make_eval_step
from maxfp4.files import write_text_atomic
from maxfp4.goodput import Goodput, GoodputHook
from maxfp4.kernels.support import check_grouped_gemm, check_mamba_kernels
from maxfp4.lm_eval_hook import check_eval_tasks, lm_eval_hook
from maxfp4.loop import Every, Hook, Loop, close_hooks, every
from maxfp4.interop.hf import check_init_from, read_params as read_hf_params
from maxfp4.interop.hf_router_bias import with_router_bias
from maxfp4.interop.positions import positions_warning
from maxfp4.parallel.mesh import (batch_reader, batch_sharding, check_model_fits_mesh, make_mesh, spread_over,
                                 tree_shardings)
from maxfp4.metrics import MetricsHook, MetricsLogger, device_peaks, flops_per_token, policy_peak_tflops
from maxfp4.model import abstract_params, get_model
from maxfp4.model.mamba import tensor_note as mamba_tensor_note
from maxfp4.model_spec import model_spec
from maxfp4.optim import make_optimizer, make_schedule
from maxfp4.parallel.pipeline import check_stages
from maxfp4.parallel.pipeline_stages import unequal_stages_note
from maxfp4.precision import PrecisionPolicy, resolve_policy
from maxfp4.precision.policy import check_block_divisibility, unmatched_rules
from maxfp4.precision.state import init_precision_state
from maxfp4.model.router_state import init_router_state
from maxfp4.profiling import StepProfiler
from maxfp4.reliability.crash import RunFailed, crash_error, quiet_disk_full_logs
from maxfp4.reliability.faults import FaultHook
from maxfp4.reliability.guard import init_guard_state
from maxfp4.reliability.preemption import Interrupted, PreemptionHook, PreemptionWatch
from maxfp4.reliability.preflight import preflight_summary
from maxfp4.reliability.rerun import rerun_hook, reruns_of
from maxfp4.reliability.rollback import Diverged, RollbackHook, Rollbacks
from maxfp4.reliability.run_lock import run_directory
from maxfp4.reliability.stragglers import StragglerHook, StragglerMonitor
from maxfp4.reliability.watchdog import HangWatchdog
from maxfp4.state import TrainState
from maxfp4.step_memory import CheckedStep, StepDoesNotFit, device_limit_bytes, memory_remedy
from maxfp4.trackers import check_trackers_installed
from maxfp4.step import check_loss_chunks, make_train_step


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


def _newest_checkpoint(run_dir: str) -> str | None:
    steps = finalized_steps(run_dir)
    return os.path.join(checkpoint_dir(run_dir), str(steps[-1])) if steps else None


def state_maker(cfg: Config, mesh, optimizer: optax.GradientTransformation, policy=None):
    """``(make, state_shardings)``: ``make(key)`` builds the train state; jitted with
    ``out_shardings=state_shardings`` it initialises each shard in place, and under
    ``jax.eval_shape`` it gives the state's shapes without allocating it."""
    policy = policy or resolve_policy(cfg.precision, cfg.model.n_layers)
    model = get_model(cfg.model)
    axes = model.param_axes(cfg.model)
    param_shapes = abstract_params(cfg.model)
    param_sh = tree_shardings(axes, param_shapes, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shapes = jax.eval_shape(optimizer.init, param_shapes)
    moment_sh = param_sh
    if cfg.mesh.shard_optimizer_over_data:  # ZeRO-1: each data replica keeps and updates a share
        moment_sh = jax.tree.map(lambda s, x: NamedSharding(mesh, spread_over(s.spec, x.shape, mesh, "data")),
                                 param_sh, param_shapes)
    opt_sh = optax.tree_map_params(optimizer, lambda _, s: s, opt_shapes, moment_sh,
                                   transform_non_params=lambda _: replicated)
    prec_sh = jax.tree.map(lambda _: replicated,
                           jax.eval_shape(lambda: init_precision_state(policy, model.block_layer_classes, init_router_state(cfg.model))))
    guard_sh = jax.tree.map(lambda _: replicated, jax.eval_shape(lambda: init_guard_state(cfg.resilience.spike_window)))
    state_sh = TrainState(step=replicated, params=param_sh, opt_state=opt_sh, rng=replicated,
                          precision=prec_sh, guard=guard_sh)

    def make(k):
        params = model.init_params(cfg.model, k)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                          opt_state=optimizer.init(params), rng=jax.random.fold_in(k, 1),
                          precision=init_precision_state(policy, model.block_layer_classes, init_router_state(cfg.model)),
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
    step_fn = make_train_step(cfg, policy, optimizer, schedule, mesh, runs_per_row)
    return jax.jit(step_fn, in_shardings=(state_sh, batch_sharding(mesh)),
                   out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())), donate_argnums=0,
                   compiler_options=xla_options)


# ----------------------------------------------------------------------------- the run


def train(cfg: Config, *, devices: Sequence[jax.Device] | None = None, stream=None,
          watch: PreemptionWatch | None = None) -> list[dict[str, Any]]:
    """Run the training loop described by ``cfg``; returns the logged metric records. ``watch``:
    the signal handling the command line installs at its start (else installed here)."""
    started_at = time.time()
    own_watch = watch is None
    watch = watch or PreemptionWatch(say=_say)
    if jax.process_count() > 1:
        watch.multiprocess()
    watch.newest_checkpoint = lambda: _newest_checkpoint(cfg.run_dir)
    try:
        start = start_up(cfg, devices)  # everything that can be refused, before the run directory is touched
        cfg = start.cfg
        with run_directory(cfg.run_dir, say=_say, on_exit_hooks=watch.add_exit_hook,
                           stale_s=cfg.run.lock_stale_s) as lock:
            goodput = Goodput(cfg.run_dir, started_at=started_at, enabled=jax.process_index() == 0, say=_say)
            data, eval_batches, to_global = open_data(start)
            optimizer = make_optimizer(cfg)
            state, state_sh = init_state(cfg, start.mesh, optimizer, start.policy)
            checkpointer = Checkpointer(cfg.run_dir, cfg.checkpoint)
            with goodput.timing("checkpoint_restore_s"):
                state = restore(cfg, checkpointer, state, state_sh, data)
            # The data's bound on documents per row is the same on every process (the packing
            # layout is global), so every process compiles the same attention kernel.
            step_fn = jit_train_step(cfg, start.policy, optimizer, make_schedule(cfg), start.mesh, state_sh,
                                     start.xla_options, data.max_runs_per_row)
            # Compiled at its first call as jit would, and its plan held to the device's memory.
            local = next(d for d in start.mesh.devices.flat if d.process_index == jax.process_index())
            limit = device_limit_bytes(local) if cfg.resilience.preflight else None
            step_fn = CheckedStep(step_fn, limit, say=_say if jax.process_index() == 0 else lambda m: None,
                                  remedy=memory_remedy(cfg.train.remat))
            hooks, metrics = make_hooks(start, watch, lock, checkpointer, data, eval_batches, state_sh, stream, goodput)
            batches = goodput.timed_batches(to_global(batch) for batch in data)
            loop = Loop(step_fn, state, batches, total_steps=cfg.train.steps, hooks=hooks,
                        should_stop=watch.should_stop)
            if loop.start_step >= cfg.train.steps and jax.process_index() == 0:
                _say(f"nothing to train: the run finished at step {loop.start_step} (train.steps={cfg.train.steps}); "
                     "raise train.steps to train on, or set run.name for a new run")
            failing = False
            try:
                loop.run()
            except Interrupted:
                raise
            except StepDoesNotFit:  # bad input that only the compile shows: one line, no crash report
                failing = True
                raise
            except Exception as error:
                failing = True
                last = metrics.records[-1] if metrics.records else None
                raise crash_error(cfg.run_dir, error, step=loop.last_step, config=cfg.to_dict(), last_metrics=last,
                                  newest_checkpoint=lambda: _newest_checkpoint(cfg.run_dir),
                                  remove_partial_saves=checkpointer.remove_partial_saves, say=_say,
                                  reruns=reruns_of(loop.hooks)) from None
            finally:
                close_hooks(loop.hooks, quietly=failing)
            return metrics.records
    finally:
        if own_watch:
            watch.close()


@dataclasses.dataclass(frozen=True)
class StartUp:
    """What start-up decided before anything was written: the config as it will run (adjusted
    to the devices), the precision policy and its printed table, the mesh and the XLA options."""

    cfg: Config
    policy: PrecisionPolicy
    table: str
    mesh: Mesh
    xla_options: dict
    compile_cache: str | None
    eval_tasks: Any = None  # train.eval_tasks as lm-eval loaded them (maxfp4.lm_eval_hook)


def start_up(cfg: Config, devices: Sequence[jax.Device] | None) -> StartUp:
    """Every check that needs the devices or the run directory's history, before it is touched."""
    compile_cache = use_compile_cache(cfg.run.compile_cache_dir)  # before anything compiles
    mesh = make_mesh(cfg.mesh, devices)
    # Elastic restarts: train.microbatches for this device count, before anything is checked
    # against the mesh, so config.yaml and the checks see the config as it will run.
    cfg = elastic.start_up(cfg, mesh, say=_say if jax.process_index() == 0 else lambda _: None)
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    spec = model_spec(cfg.model)
    check_block_divisibility(policy, spec.linear_shapes())
    check_loss_chunks(cfg, policy)
    check_stages(cfg)
    check_mamba_kernels(cfg.model, cfg.data.seq_len)
    check_grouped_gemm(cfg.model, mesh.shape["tensor"])
    table = policy.format_table(spec.block_classes)
    # A rule that decides nothing here (a preset shared by dense and hybrid models, or a typo) is shown, not refused.
    for line in unmatched_rules(cfg.precision, cfg.model.n_layers, [set(b.classes) for b in spec.blocks]):
        table += f"\nwarning: {line}"
        if jax.process_index() == 0:
            print(f"warning: {line}", file=sys.stderr, flush=True)
    check_model_fits_mesh(cfg.model, mesh)
    for note in (mamba_tensor_note(cfg.model, mesh.shape["tensor"]),
                 unequal_stages_note(cfg, policy, mesh.shape["tensor"])):
        if note and jax.process_index() == 0:
            _say(note)
    _check_batch_fits_mesh(cfg, mesh)
    platform = mesh.devices.flat[0].platform
    xla_options = compiler_options(platform, cfg.train.compiler_options, cfg.run.deterministic)
    check_compiler_options(xla_options, mesh.devices.flat[0])
    check_deterministic_attention(cfg, platform)
    refuse_changed_run(cfg)
    check_init_from(cfg)
    if jax.process_index() == 0 and (note := positions_warning(cfg)) and not finalized_steps(cfg.run_dir):
        print(note, file=sys.stderr, flush=True)
    check_trackers_installed(cfg.run.trackers)
    eval_tasks = check_eval_tasks(cfg)
    return StartUp(cfg, policy, table, mesh, xla_options,
                   compile_cache, eval_tasks)


def open_data(start: StartUp):
    """Preflight, the training batches and the held-out ones (bad data is refused here, before
    anything compiles), then the run's files and its start-up lines; and the function that
    makes a process's rows of a batch global arrays."""
    cfg, mesh, is_writer = start.cfg, start.mesh, jax.process_index() == 0
    if cfg.resilience.preflight:
        summary = preflight_summary(cfg, list(mesh.devices.flat))
        if is_writer:
            _say(summary)
    reader, readers = batch_reader(mesh, cfg.data.global_batch)
    where = dict(process_index=reader, process_count=readers)
    data = make_batches(cfg, cfg.run_dir, **where)
    eval_local = make_eval_batches(cfg, cfg.run_dir, **where, corpus=data.corpus) if cfg.train.eval_every else []
    if is_writer:
        write_text_atomic(os.path.join(cfg.run_dir, "config.yaml"), yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        write_text_atomic(os.path.join(cfg.run_dir, "precision_table.txt"), start.table + "\n")
        _say(f"run directory {cfg.run_dir}")
        for note in data.notes:
            _say(note)
        _say("precision policy:\n" + start.table)
        _say(f"mesh {dict(mesh.shape)} on {mesh.devices.size} {mesh.devices.flat[0].platform} device(s)")
        _say(f"compilation cache {start.compile_cache or 'off'}; {determinism_summary(start.xla_options)}")
    to_global = _globalizer(mesh, readers)
    return data, [to_global(b) for b in eval_local], to_global


def restore(cfg: Config, checkpointer: Checkpointer, state: TrainState, state_sh, data) -> TrainState:
    """The newest readable checkpoint's state and data position, if the run has one; else the
    weights of ``model.init_from`` when set (a resume never reads that directory again)."""
    resumed = checkpointer.restore_latest(state, warn=lambda m: _say(f"warning: {m}"))
    if resumed is not None:
        resume_step, state, data_state = resumed
        data.set_state(data_state)
        if jax.process_index() == 0:
            _say(f"resumed from {checkpointer.directory}/{resume_step}")
    elif jax.process_index() == 0:
        _fresh_start(cfg.run_dir)
    if resumed is None and cfg.model.init_from:
        state = state.replace(params=read_hf_params(cfg.model, cfg.model.init_from, state_sh.params, state.params,
                                                    replacing=True),
                              precision=with_router_bias(cfg.model, cfg.model.init_from, state.precision,
                                                         state_sh.precision))
        if jax.process_index() == 0:
            _say(f"initialized from {cfg.model.init_from}")
    if jax.process_index() == 0:
        from maxfp4.model.attention import resolve_implementation
        n_params = sum(x.size for x in jax.tree.leaves(state.params))
        _say(f"model: {n_params / 1e6:.1f}M parameters, {cfg.model.n_layers} blocks, "
             f"attention {resolve_implementation(cfg.model.attention)}, remat {cfg.train.remat}")
    return state


def _fresh_start(run_dir: str) -> None:
    """A run that restores nothing starts at step 1, saying so when the directory holds an
    earlier attempt: saves that never committed (a kill during the first save) are named, and
    that attempt's metrics.jsonl is kept as metrics.jsonl.<n>, so the file never holds two runs."""
    unfinished = unfinished_saves(run_dir)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    kept = None
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        n = 1
        while os.path.lexists(f"{metrics}.{n}"):
            n += 1
        kept = f"{metrics}.{n}"
        os.rename(metrics, kept)
    if unfinished or kept:
        only = f" (only unfinished saves, never restored: {', '.join(unfinished)})" if unfinished else ""
        moved = f"; the earlier attempt's metrics moved to {kept}" if kept else ""
        _say(f"warning: no complete checkpoint in {checkpoint_dir(run_dir)}{only}; starting from step 1{moved}")


def _globalizer(mesh: Mesh, readers: int):
    """Each process's rows of a batch -> global arrays in the batch sharding. The global shape is
    stated: processes holding the same rows (``batch_reader``) each pass them, and JAX would
    otherwise count them twice."""
    sharding = batch_sharding(mesh)
    return lambda local: {k: jax.make_array_from_process_local_data(sharding, v, (v.shape[0] * readers, *v.shape[1:]))
                          for k, v in local.items()}


def make_metrics(start: StartUp, stream, eval_losses: dict[int, float], stragglers) -> MetricsHook:
    cfg, mesh = start.cfg, start.mesh
    peaks = device_peaks(mesh.devices.flat[0])
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    logger = MetricsLogger(cfg.run_dir, total_steps=cfg.train.steps, enabled=jax.process_index() == 0, stream=stream,
                           trackers=cfg.run.trackers, config=cfg.to_dict())
    return MetricsHook(logger, tokens_per_step=tokens_per_step, n_devices=mesh.devices.size, peaks=peaks,
                       flops_per_step=flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step,
                       policy_peak=policy_peak_tflops(cfg.model, cfg.data.seq_len, start.policy, peaks) if peaks else None,
                       log_every=cfg.train.log_every, eval_losses=eval_losses, stragglers=stragglers)


def make_hooks(start: StartUp, watch: PreemptionWatch, lock, checkpointer: Checkpointer, data, eval_batches: list,
               state_sh, stream, goodput: Goodput) -> tuple[list[Hook | tuple[Hook, Every]], MetricsHook]:
    """The hooks in the order they act at each point of the loop (maxfp4.loop): the watchdog and
    stragglers see a finished step before it is logged; the metrics start timing a step as soon as
    it is dispatched, before an evaluation holds the host; the checkpoint comes after evaluation and
    metrics (a save first settles the loop, writing the step's whole record); the rollback acts on
    a step last; the periodic ones with their cadence (maxfp4.loop.every); evaluation, saves and
    rollbacks timed for goodput.json. Also returns the metrics hook, whose records the run returns."""
    cfg, mesh, res = start.cfg, start.mesh, start.cfg.resilience
    is_writer = jax.process_index() == 0
    replicated = NamedSharding(mesh, PartitionSpec())
    eval_step = jax.jit(make_eval_step(cfg, start.policy, mesh),
                        in_shardings=(state_sh, batch_sharding(mesh)), out_shardings=(replicated, replicated))
    evaluation = EvalHook(eval_step, eval_batches)
    stragglers = (StragglerHook(StragglerMonitor(res.straggler_threshold), _say, is_writer=is_writer)
                  if res.straggler_every else None)
    tasks = lm_eval_hook(cfg, start.eval_tasks, data.tokenizer, start.policy, mesh, say=_say)
    metrics = make_metrics(start, stream, evaluation.losses, stragglers)
    metrics.task_scores = tasks.scores if tasks else {}
    watchdog = HangWatchdog(cfg.run_dir, res.hang_timeout_s, jax.process_index(),
                            on_exit=lock.release if lock is not None else lambda: None)
    rollbacks = Rollbacks(res.max_consecutive_skips, res.max_rollbacks, suspend_steps=res.spike_window,
                          checkpoint=cfg.checkpoint)
    checkpoints = CheckpointHook(checkpointer, enabled=cfg.checkpoint.enabled, data=data, config=cfg.to_dict(),
                                 saving=watch.saving)
    hooks = [
        watchdog, stragglers and every(stragglers, res.straggler_every), FaultHook(res.fault, jax.process_index()),
        PreemptionHook(watch, checkpoints=cfg.checkpoint.enabled, say=_say),
        StepProfiler(cfg.train.profile_steps, os.path.join(cfg.run_dir, "profile"), enabled=is_writer),
        metrics, GoodputHook(goodput),
        goodput.timed(every(evaluation, cfg.train.eval_every, last=True), "evaluation_s"),
        tasks and goodput.timed(every(tasks, cfg.train.eval_every, last=True), "evaluation_s"),
        goodput.timed((checkpoints, checkpoints.cadence()), "checkpoint_save_s"),
        rerun_hook(res, mesh, _say, is_writer=is_writer),
        goodput.timed(RollbackHook(rollbacks, checkpointer, _say), "lost_s"),
    ]
    return [hook for hook in hooks if hook is not None], metrics


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m maxfp4.train", description="Train a language model from a YAML config.",
        epilog="example: python -m maxfp4.train configs/quickstart.yaml train.steps=50")
    add_config_arguments(parser)
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:  # argparse would name the missing arguments; a first try wants the usage
        _parser().print_help(sys.stderr)
        return 2
    args = parse_args(argv)
    distributed.set_gpu_environment_defaults()  # before anything starts the GPU backend

    # Signals are handled from here on: a stop during start-up is one line, not a traceback.
    watch = PreemptionWatch(say=lambda m: print(m, file=sys.stderr, flush=True))
    quiet_disk_full_logs()  # a full disk is reported in one line, not Orbax's tracebacks

    def run() -> None:
        cfg = config_from_arguments(args)
        fraction = distributed.set_gpu_memory_fraction(cfg.run.gpu_memory_fraction)  # before the backend starts
        how = distributed.initialize(cfg.distributed)
        _say(f"{how}; {jax.local_device_count()} local of {jax.device_count()} devices"
             + distributed.memory_note(jax.local_devices()[0], fraction))
        train(cfg, watch=watch)

    try:
        return exit_code_of(run)
    except Interrupted as stop:
        if stop.message:  # a stop during start-up; later stops were reported by train()
            watch.reported()
            print(stop.message, file=sys.stderr, flush=True)
            # Maybe raised out of a compile whose threads still run: no interpreter shutdown.
            watch.end_process(stop.code)
        return stop.code
    except Diverged as stop:  # already explained in the log and crash.json
        return stop.exit_code
    except RunFailed as failed:
        print(f"error: {failed}", file=sys.stderr, flush=True)
        return failed.exit_code
    finally:
        watch.close()


if __name__ == "__main__":
    code = main()
    default_actions_after_main()
    sys.exit(code)

