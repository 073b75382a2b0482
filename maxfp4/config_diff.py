"""Which config changes a resumed run may make: those that leave the math of training unchanged.

A rerun with the same run name continues from the newest checkpoint. Changing the model, the
precision policy, the optimizer or its schedule, what the data is or how it is batched, or the
seed would silently splice two different runs into one loss curve, so :func:`refuse_changed_math`
refuses it. Where a run executes (mesh, processes), how often it logs or checkpoints and how it
recovers are free to change.

Keys are compared as dotted paths of ``Config.to_dict()`` (``precision.recipes.nvfp4.rht``).
A key that neither list below names counts as math-changing (the safe side); a unit test makes
every key of :class:`maxfp4.config.Config` appear in exactly one list.
"""

from __future__ import annotations

import os
from typing import Any

from maxfp4.config import Config, ConfigError
from maxfp4.data.tokenizer import TOKENIZER_FILENAME

# Prefixes (a key equal to one, or starting with it plus '.') that change what is computed.
MATH_KEYS = (
    "model", "precision", "optim",
    "data.seq_len", "data.global_batch", "data.source", "data.paths", "data.tokenizer",
    "data.jsonl_field", "data.tfds_name", "data.tfds_split", "data.tfds_data_dir", "data.tfds_field",
    "data.mixture", "data.eval_fraction",  # the held-out documents leave the training data
    "run.seed", "train.microbatches",
    "train.steps",  # only through the schedule length (optim.schedule_steps=0): see _schedule_length
)
# Checked before MATH_KEYS, so e.g. model.attention (an implementation choice) wins over model.
HARMLESS_KEYS = (
    "model.attention", "model.attention_max_segments", "model.mamba.kernels", "model.moe.exchange_slack",
    "train.log_every", "train.elastic", "train.remat", "train.scan_layers", "train.loss_chunks", "run.name", "run.output_dir",
    "run.compile_cache_dir", "run.deterministic", "run.lock_stale_s", "run.gpu_memory_fraction", "run.trackers",
    "train.eval_every", "train.eval_tasks", "train.compiler_options", "train.profile_steps",
    "data.workers", "data.read_threads", "data.prefetch", "data.eval_paths", "data.eval_batches",
    "checkpoint", "mesh", "distributed", "resilience",
)
# Harmless in themselves but shaping arrays the checkpoint holds: a resume that changes them
# could not read its own checkpoint, so they are refused like the math (checked first).
STATE_SHAPE_KEYS = ("resilience.spike_window",)  # the guard's window of losses
# Compared through the schedule length they imply, not one by one.
_SCHEDULE_KEYS = ("optim.schedule_steps", "train.steps")


def flatten(tree: dict, sections: dict | None = None, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"d_model": 1}}`` -> ``{"model.d_model": 1}``, descending only into config
    sections (the nested dicts of ``sections``, default: ``Config().to_dict()``). Free-form values
    (``precision.rules``, ``precision.recipes``) stay whole, so adding or removing an entry shows."""
    sections = Config().to_dict() if sections is None else sections
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        section = sections.get(key)
        if isinstance(value, dict) and isinstance(section, dict) and section:
            out.update(flatten(value, section, path + "."))
        else:
            out[path] = value
    return out


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def changes_math(key: str) -> bool:
    return _matches(key, STATE_SHAPE_KEYS) or not _matches(key, HARMLESS_KEYS)


def _schedule_length(flat: dict[str, Any]) -> Any:
    return flat.get("optim.schedule_steps") or flat.get("train.steps")


def _normalise(flat: dict[str, Any], run_dir: str) -> dict[str, Any]:
    # An empty data.tokenizer means "the one trained into the run directory": naming that file
    # explicitly on a rerun is the same tokenizer.
    out = dict(flat)
    if not out.get("data.tokenizer"):
        out["data.tokenizer"] = os.path.join(run_dir, TOKENIZER_FILENAME)
    if isinstance(out.get("data.tokenizer"), str):
        out["data.tokenizer"] = os.path.abspath(out["data.tokenizer"])
    return out


def math_differences(old: dict, new: dict, run_dir: str = "") -> list[str]:
    """``key: old -> new`` for every math-changing difference between two ``Config.to_dict()``s.

    ``old`` may come from an older maxfp4: keys it lacks take today's defaults, keys it has that
    no longer exist are ignored (they cannot be set any more)."""
    base = flatten(Config().to_dict())  # every key today's config has
    before = _normalise({**base, **flatten(old)}, run_dir)
    after = _normalise({**base, **flatten(new)}, run_dir)
    lines = []
    for key in sorted(base):
        if key in _SCHEDULE_KEYS or not changes_math(key):
            continue
        if key == "train.microbatches" and before["train.elastic"] and after["train.elastic"]:
            continue  # chosen per device count (maxfp4.elastic); the update is the same up to summation order
        if before[key] != after[key]:
            lines.append(f"{key}: {before[key]!r} -> {after[key]!r}")
    if _schedule_length(before) != _schedule_length(after):
        for key in _SCHEDULE_KEYS:
            if before[key] != after[key]:
                lines.append(f"{key}: {before[key]!r} -> {after[key]!r}")
        lines[-1] += (f" (the learning-rate schedule length, {_schedule_length(before)} -> "
                      f"{_schedule_length(after)}; pin it with optim.schedule_steps)")
    return lines


def refuse_changed_math(saved: dict | None, cfg: Config, where: str) -> None:
    """Raise a one-line ConfigError if ``cfg`` would resume ``saved``'s run with different math."""
    if saved is None:
        return
    diffs = math_differences(saved, cfg.to_dict(), cfg.run_dir)
    if diffs:
        raise ConfigError(
            f"run {cfg.run_dir} would resume {where} with a config that changes the math: "
            f"{'; '.join(diffs)}; expected the saved values to resume (or a new run.name)")
