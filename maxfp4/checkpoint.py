"""Orbax checkpoints of the whole training state, saved asynchronously, restored on rerun.

A checkpoint holds the FP32 parameters, the optimizer state, the precision state (FP8 amax
histories and scales), the step, the RNG key, the data iterator's position and the resolved
config, so a rerun with the same run name continues exactly where the newest complete
checkpoint left off, and can be refused when its config would change the math
(:mod:`maxfp4.config_diff`).

Completeness: Orbax (0.12) writes step N into ``N.orbax-checkpoint-tmp/`` and renames it to
``N/`` only after every item is written (plus ``commit_success.txt``); only directories named
by a bare step number count as checkpoints, so a save killed mid-write is never restored, and
the next save of that step replaces the leftover temporary directory. A complete checkpoint
that cannot be read (a lost or truncated array file), or whose data position or config does
not match the checksums saved with it (an ``integrity`` item), is moved aside to
``N.unreadable`` once an older step has restored instead, with a warning naming it.

``checkpoint.verify`` adds SHA-256 checksums of the array files: once a save has committed, each
process hashes the files it wrote, in a background thread, into ``N/checksums.process_<i>.json``;
a restore recomputes them (:mod:`maxfp4.checksums`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import threading
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from maxfp4 import checksums
from maxfp4.checkpoint_layout import conversion
from maxfp4.config import CheckpointConfig, saved_model_config
from maxfp4.errors import UserError
from maxfp4.loop import Every, Hook
from maxfp4.state import TrainState

UNREADABLE_SUFFIX = ".unreadable"


class CheckpointError(UserError):
    """No checkpoint of a run can be used; one line naming the directory."""


class CheckpointCorrupt(Exception):
    """A checkpoint's content does not match the checksums saved with it."""


def json_sha256(value: Any) -> str:
    """The checksum of a JSON item as the restore reads it back (canonical: sorted keys)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _to_saveable(state: TrainState) -> dict[str, Any]:
    # Typed PRNG keys are stored as their raw uint32 data.
    return {"step": state.step, "params": state.params, "opt_state": state.opt_state,
            "rng": jax.random.key_data(state.rng), "precision": state.precision,
            "guard": state.guard}


def _from_saved(tree: dict[str, Any], impl: Any) -> TrainState:
    return TrainState(step=tree["step"], params=tree["params"], opt_state=tree["opt_state"],
                      rng=jax.random.wrap_key_data(tree["rng"], impl=impl), precision=tree["precision"],
                      guard=tree["guard"])


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def one_line_reason(error: BaseException, limit: int = 300) -> str:
    """Orbax wraps TensorStore's error (which names the file and what is wrong with it) in one
    that dumps a whole spec; the innermost cause's first line is the useful one."""
    seen = {id(error)}
    while (inner := error.__cause__ or error.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        error = inner
    lines = str(error).strip().splitlines()
    reason = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def _print_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class Checkpointer:
    """``<run_dir>/checkpoints/<step>/{state, data, config}``."""

    def __init__(self, run_dir: str, cfg: CheckpointConfig):
        self.directory = checkpoint_dir(run_dir)
        self.every = cfg.every
        self.async_ = cfg.async_
        self.verify = cfg.verify
        self.keep = cfg.keep
        # Rotation is ours (see _rotate), so Orbax keeps every step it writes.
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=cfg.async_,
                                                 create=True))
        self._hashing: threading.Thread | None = None
        self._saves_over = threading.Event()  # tells a hashing thread that its save will not commit
        self._warned_unverified = False
        self._warned_unchecked = False
        # The first step of a streak of skipped steps that may still trigger a rollback, as far
        # as the host has seen (note_seen): the newest checkpoint before it is never rotated out.
        self._streak_floor = 1

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, state: TrainState, data_state: dict[str, int], config: dict | None = None) -> None:
        """Returns once the arrays are copied off the devices; the files are written in the
        background (``wait`` blocks until they are complete). ``config`` (``Config.to_dict()``)
        is kept with the checkpoint so a rerun can be compared with the run it resumes."""
        self.wait()  # the previous save committed and hashed, then rotated (Orbax waits for it anyway)
        data = {k: int(v) for k, v in data_state.items()}
        # Checksums of the JSON items: an edited data position or config is caught on restore.
        integrity = {"step": int(step), "data_sha256": json_sha256(data)}
        items = {"state": ocp.args.StandardSave(_to_saveable(state)), "data": ocp.args.JsonSave(data)}
        if config is not None:
            config = _with_saving_mesh(config, state)
            items["config"] = ocp.args.JsonSave(config)
            integrity["config_sha256"] = json_sha256(json.loads(json.dumps(config, default=str)))
        items["integrity"] = ocp.args.JsonSave(integrity)
        self.manager.save(step, args=ocp.args.Composite(**items))
        if self.verify:
            self._saves_over.clear()
            self._hashing = threading.Thread(target=self._hash_when_committed, args=(step,),
                                             name=f"maxfp4-checksums-{step}", daemon=True)
            self._hashing.start()

    def _hash_when_committed(self, step: int) -> None:
        # Orbax renames N.orbax-checkpoint-tmp to N at commit (process 0, after every process's
        # writes); each process then hashes what it wrote, off the training loop's thread.
        final = self.step_path(step)
        while not os.path.isfile(os.path.join(final, "commit_success.txt")):
            if self._saves_over.wait(0.05) and not os.path.isdir(final):
                return
        try:
            checksums.write(final, jax.process_index())
        except OSError:
            pass  # rotated away or the disk is full: restore then reports "not verified"

    def _finish_hashing(self) -> None:
        if self._hashing is not None:
            self._hashing.join()
            self._hashing = None

    def restore(self, step: int, like: TrainState) -> tuple[TrainState, dict[str, int]]:
        """Restore onto the shardings of ``like`` (a state of the current run's mesh, which may
        differ from the mesh that saved it: Orbax reads each device's slice of the arrays)."""
        path = self.step_path(step)
        target = _abstract(_to_saveable(like))
        # An earlier layout of some arrays (maxfp4.checkpoint_layout) is read as stored, then converted.
        converting = conversion(os.path.join(path, "state"), target,
                                lambda: _saved_model(os.path.dirname(self.directory), step))
        items = {"state": ocp.args.StandardRestore(target if converting is None else converting.abstract),
                 "data": ocp.args.JsonRestore()}
        has = {name: os.path.isdir(os.path.join(path, name)) for name in ("integrity", "config")}
        if has["integrity"]:
            items["integrity"] = ocp.args.JsonRestore()
            if has["config"]:
                items["config"] = ocp.args.JsonRestore()
        else:
            self._no_integrity_record(step)
        if self.verify:
            self._verify_arrays(step)
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        data = dict(out["data"])
        if has["integrity"]:
            _check_integrity(step, dict(out["integrity"]), data, out.get("config") if has["config"] else None)
        state = out["state"]
        if converting is not None:
            state = converting.convert(state)
            if jax.process_index() == 0:
                print(converting.note, flush=True)
        return _from_saved(state, jax.random.key_impl(like.rng)), data

    def _no_integrity_record(self, step: int) -> None:
        """Checkpoints saved before the ``integrity`` item existed have none; one that lost it
        (a partial copy) cannot be told from them. ``checkpoint.verify`` refuses it (the restore
        falls back to an older one); otherwise it restores with one warning."""
        if self.verify:
            raise CheckpointCorrupt("no integrity record, so its data position and config cannot be checked "
                                    "(checkpoint.verify)")
        if not self._warned_unchecked:
            self._warned_unchecked = True
            _print_warning(f"checkpoint {self.step_path(step)} has no integrity record (saved by an older maxfp4, "
                           f"or copied without it); its data position and config are restored unchecked")

    def _verify_arrays(self, step: int) -> None:
        """``checkpoint.verify``: the array files against their saved SHA-256 (each process
        checks a share of the files; all processes agree on the outcome)."""
        problem = checksums.verify(self.step_path(step), jax.process_index(), jax.process_count())
        if jax.process_count() > 1:
            import numpy as np
            from jax.experimental import multihost_utils
            bad = multihost_utils.process_allgather(np.int32(problem not in (None, checksums.UNVERIFIED)))
            if problem in (None, checksums.UNVERIFIED) and bad.any():
                problem = "an array file failed its checksum on another process"
        if problem == checksums.UNVERIFIED:
            if not self._warned_unverified:
                self._warned_unverified = True
                _print_warning(f"checkpoint {self.step_path(step)} has no array checksums (saved with "
                               f"checkpoint.verify=false, or stopped before hashing); restored unverified")
        elif problem is not None:
            raise CheckpointCorrupt(problem)

    def restore_latest(self, like: TrainState, warn: Callable[[str], None] = _print_warning
                       ) -> tuple[int, TrainState, dict[str, int]] | None:
        """Restore the newest readable checkpoint: ``(step, state, data_state)``, or None if the
        run has no checkpoint. Newer unreadable ones are moved aside (kept for inspection, and out
        of the way of the next save of that step) with a warning, but only once an older one has
        restored: if none restores, the fault may be this process's (memory, a wrong mesh), so
        nothing is moved and :class:`CheckpointError` is raised."""
        steps = self.all_steps()
        failures: list[tuple[int, str]] = []
        for step in reversed(steps):
            try:
                state, data_state = self.restore(step, like)
            except Exception as error:  # noqa: BLE001 - any failure to read means "not usable"
                failures.append((step, one_line_reason(error)))
                continue
            for bad, reason in failures:
                aside = self._move_aside(bad)
                warn(f"checkpoint {self.step_path(bad)} is unreadable ({reason}); falling back to step {step}; "
                     f"moved to {aside}")
            return step, state, data_state
        if not steps:
            return None
        tried = ", ".join(f"{step} ({reason})" for step, reason in failures)
        raise CheckpointError(f"{self.directory}: no readable checkpoint (tried steps {tried}); "
                              f"expected at least one complete checkpoint, or move the directory away to start over")

    def _move_aside(self, step: int) -> str:
        source = self.step_path(step)
        target = source + UNREADABLE_SUFFIX
        n = 1
        while os.path.exists(target):
            n += 1
            target = f"{source}{UNREADABLE_SUFFIX}{n}"
        if jax.process_index() == 0:
            os.rename(source, target)
        if jax.process_count() > 1:
            ocp.multihost.sync_global_processes(f"maxfp4_move_aside_{step}")
        self.manager.reload()
        return target

    def delete(self, step: int) -> None:
        self.manager.delete(step)

    def note_seen(self, step: int, consecutive_skips: int) -> None:
        """The host has seen step ``step``'s metrics (or restored or rolled back to it): its guard
        counted ``consecutive_skips`` skipped steps in a row up to it. Any streak that may still
        reach a rollback either runs through ``step`` or begins after it, so it begins at
        ``step - consecutive_skips + 1`` or later (:func:`kept_steps`)."""
        self._streak_floor = streak_floor(step, consecutive_skips)

    def kept_steps(self, steps: list[int]) -> list[int]:
        return kept_steps(steps, self.keep, self._streak_floor)

    def _rotate(self) -> None:
        """Delete the complete checkpoints :meth:`kept_steps` leaves out. Runs before a save
        starts (the previous one is complete by then) and after the last, so the newest
        ``keep`` stay on disk while the next is written, as with Orbax's own rotation."""
        self.manager.wait_until_finished()
        steps = self.all_steps()
        for step in sorted(set(steps) - set(self.kept_steps(steps))):
            self.manager.delete(step)

    def wait(self) -> None:
        """Until the last save is committed (and, with ``verify``, hashed)."""
        try:
            self.manager.wait_until_finished()
        finally:
            self._saves_over.set()
            self._finish_hashing()
        self._rotate()

    def remove_partial_saves(self) -> list[str]:
        """Delete temporary directories of saves that failed (they hold space a full disk
        needs back); complete checkpoints are untouched. Returns what was removed."""
        removed = []
        if jax.process_index() == 0:
            for path in glob.glob(os.path.join(glob.escape(self.directory), "*.orbax-checkpoint-tmp*")):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        return removed

    def close(self) -> None:
        try:
            self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 - a failed save was already raised by wait()
                pass


def streak_floor(step: int, consecutive_skips: int) -> int:
    """The earliest first step of a streak that may still trigger a rollback, once step ``step``
    ended a run of ``consecutive_skips`` skipped steps: that run's first step, or the step after."""
    return step - consecutive_skips + 1


def kept_steps(steps: list[int], keep: int, floor: int) -> list[int]:
    """The checkpoints rotation keeps, of ``steps`` (ascending): the newest ``keep``, and the
    newest one before ``floor`` (:func:`streak_floor`), which a rollback of a streak running
    from ``floor`` restores.

    Every future rollback's target is kept, as long as every checkpoint is of a step whose
    metrics the host has seen (the checkpoint hook settles the loop before it saves): a streak
    from ``floor`` goes back to the newest before it; one that begins later, after the newest
    step seen, to the newest of all. So at most ``keep + 1`` checkpoints are on disk, whatever
    ``checkpoint.every``, ``keep`` and the length of the streak."""
    kept = set(steps[-keep:])
    kept.update([s for s in steps if s < floor][-1:])
    return sorted(kept)


def _with_saving_mesh(config: dict, state: TrainState) -> dict:
    """The config as saved: its mesh axes (-1 included) as the state is sharded, so a resume on
    another device count knows the per-device batch this run trained with (maxfp4.elastic)."""
    mesh = getattr(getattr(state.step, "sharding", None), "mesh", None)
    if not isinstance(config.get("mesh"), dict) or not hasattr(mesh, "shape"):
        return config
    sizes = {axis: int(size) for axis, size in dict(mesh.shape).items() if axis in config["mesh"]}
    return {**config, "mesh": {**config["mesh"], **sizes}}


def _check_integrity(step: int, integrity: dict, data: dict, config: dict | None) -> None:
    if integrity.get("step") != step:
        raise CheckpointCorrupt(f"integrity record names step {integrity.get('step')}, not {step}")
    if integrity.get("data_sha256") != json_sha256(data):
        raise CheckpointCorrupt(f"data position {json.dumps(data)} does not match its saved checksum "
                                f"(edited or damaged)")
    if config is not None and "config_sha256" in integrity and integrity["config_sha256"] != json_sha256(config):
        raise CheckpointCorrupt("saved config does not match its checksum (edited or damaged)")


# Reading without a CheckpointManager: nothing is created, and the checks before a run starts
# (config comparison, export) stay quiet.


def checkpoint_dir(run_dir: str) -> str:
    return os.path.abspath(os.path.join(run_dir, "checkpoints"))


def finalized_steps(run_dir: str) -> list[int]:
    """Steps of the run's complete checkpoints (Orbax's committed ``<step>/`` directories),
    ascending; temporary directories of unfinished saves are not among them. Raises
    :class:`CheckpointError` if ``checkpoints`` is there but no directory (no save could commit)."""
    directory = checkpoint_dir(run_dir)
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: not a directory; expected the run's checkpoint directory "
                              f"(move it away, or choose another run.name)")
    return sorted(ocp.path.step.checkpoint_steps(directory)) if os.path.isdir(directory) else []


def unfinished_saves(run_dir: str) -> list[str]:
    """Names of the temporary directories of saves that never committed (killed mid-write)."""
    directory = checkpoint_dir(run_dir)
    pattern = os.path.join(glob.escape(directory), "*.orbax-checkpoint-tmp*")
    return sorted(os.path.basename(p) for p in glob.glob(pattern)) if os.path.isdir(directory) else []


def read_params(run_dir: str, step: int, abstract_params: Any) -> Any:
    """Only the parameters of checkpoint ``step`` (the optimizer state, twice their size, is not
    read): ``abstract_params`` gives their shapes, dtypes and shardings."""
    target = {"params": abstract_params}
    converting = conversion(_state_item(run_dir, step), target, lambda: _saved_model(run_dir, step))
    out = read_state_part(run_dir, step, target if converting is None else converting.abstract)
    return (out if converting is None else converting.convert(out))["params"]


def read_state_part(run_dir: str, step: int, target: Any) -> Any:
    """The part of checkpoint ``step``'s train state that ``target`` names (a dict keyed as the
    state is, ``params`` or ``precision``, of ShapeDtypeStructs with shardings), nothing else read."""
    target_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype), target)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as reader:
        return reader.restore(_state_item(run_dir, step), args=ocp.args.PyTreeRestore(
            item=target, restore_args=target_args, partial_restore=True))


def _state_item(run_dir: str, step: int) -> str:
    return os.path.join(checkpoint_dir(run_dir), str(step), "state")


def _saved_model(run_dir: str, step: int):
    """The model config checkpoint ``step`` was written with (its config item, or config.yaml)."""
    saved = saved_config(run_dir, step=step)
    if saved is None:
        raise CheckpointCorrupt(f"step {step}: no saved config to convert its layout by")
    return saved_model_config(saved[0].get("model", {}), saved[1])


def saved_config(run_dir: str, step: int | None = None, require_integrity: bool = False) -> tuple[dict, str] | None:
    """The config saved with the newest checkpoint (or ``step``) that has one readable and
    matching the checksums of its ``integrity`` item (an edited checkpoint is skipped, as the
    restore skips it), and where it came from; None if the run has no checkpoint. Reads only.
    ``require_integrity`` (``checkpoint.verify``): checkpoints without that item are skipped too.

    Checkpoints written before configs were kept with them fall back to ``<run_dir>/config.yaml``
    (the config of the last start)."""
    steps = finalized_steps(run_dir)
    if not steps:
        return None
    with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as reader:
        for candidate in reversed(steps) if step is None else [step]:
            step_dir = os.path.join(checkpoint_dir(run_dir), str(candidate))
            if not os.path.isdir(os.path.join(step_dir, "config")):
                continue
            try:
                config = dict(reader.restore(os.path.join(step_dir, "config")))
                if os.path.isdir(os.path.join(step_dir, "integrity")):
                    _check_integrity(candidate, dict(reader.restore(os.path.join(step_dir, "integrity"))),
                                     dict(reader.restore(os.path.join(step_dir, "data"))), config)
                elif require_integrity:
                    continue
            except Exception:  # noqa: BLE001 - a damaged or edited checkpoint: try the previous one
                continue
            return config, step_dir
    path = os.path.join(run_dir, "config.yaml")
    if os.path.isfile(path):
        import yaml
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh) or {}, path
    return None


def refuse_changed_run(cfg) -> None:
    """Raise a ConfigError if ``cfg`` would resume a run (same run directory, with checkpoints)
    with different math; see :mod:`maxfp4.config_diff`. The comparison is with the checkpoint
    the restore will use: the newest whose saved config passes its checksum."""
    from maxfp4.config_diff import refuse_changed_math

    saved = saved_config(cfg.run_dir, require_integrity=cfg.checkpoint.verify)
    if saved is not None:
        refuse_changed_math(saved[0], cfg, saved[1])


class CheckpointHook(Hook):
    """Saves on the steps its cadence names (:meth:`cadence`: ``checkpoint.every``, the last step
    and a stop; the state is saved before the next step's dispatch donates it); waits for the
    last save when the loop ends. ``saving()``: a context the preemption watch uses to never cut a save short.

    Before a save the loop is settled (:meth:`Loop.settle`): every step up to the one saved has
    its metrics written, and its streak of skipped steps seen, before its checkpoint can exist.
    A kill after the commit loses no record, and rotation knows every streak a rollback may
    still need the checkpoint before (:func:`kept_steps`). It costs no wait of its own: the save
    copies the step's state off the devices, which waits for the step anyway. The hook acts
    after the others' ``after_dispatch`` (evaluation, metrics), so the record is complete."""

    def __init__(self, checkpointer: Checkpointer, *, enabled: bool, data, config: dict, saving):
        self.checkpointer, self.enabled, self.data, self.config = checkpointer, enabled, data, config
        self.saving = saving
        self._started = False

    def before_step(self, loop, step: int) -> None:
        if not self._started:  # a resumed state may be inside a streak
            self._started = True
            self._note_state(loop, loop.start_step)

    def cadence(self) -> Every:
        """``checkpoint.every``, the last step and a stop; never with checkpoints off."""
        return Every(self.checkpointer.every, last=True, stop=True) if self.enabled else Every(0)

    def on_due(self, loop, step: int) -> None:
        if not loop.settle():
            return  # a rollback replaced the state this save was for
        with self.saving():
            self.checkpointer.save(step, loop.state, self.data.get_state(), self.config)

    def after_step(self, loop, step: int, values: dict[str, float], final: bool) -> None:
        self.checkpointer.note_seen(step, int(values["consecutive_skips"]))

    def on_rewind(self, loop, step: int) -> None:
        self._note_state(loop, step)

    def _note_state(self, loop, step: int) -> None:
        # Replicated: the local copy is the value (a restored state, so this waits for nothing).
        value = loop.state.guard["consecutive"]
        self.checkpointer.note_seen(step, int(value.addressable_data(0) if isinstance(value, jax.Array) else value))

    def on_loop_end(self, loop) -> None:
        with self.saving():
            self.checkpointer.wait()

    def close(self) -> None:
        self.checkpointer.close()
