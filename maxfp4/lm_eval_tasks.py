"""Tasks for lm-evaluation-harness: checked before anything runs, evaluated, and their scores.

A task is named as lm-eval names it (``hellaswag``, a group such as ``mmlu``) or given as a task
YAML file. A file's relative ``data_files`` are read beside the file (lm-eval itself reads them
from the working directory), so a task shipped with its JSON lines works from anywhere and
offline (``dataset_path: json``). An unknown name or a file that does not parse is one line
(:class:`TaskError`) before any model is loaded or anything is written.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
from typing import Any, Sequence

from maxfp4.errors import UserError

YAML_SUFFIXES = (".yaml", ".yml")


class TaskError(UserError):
    """A task lm-eval cannot run: one line naming it and what would work."""


@dataclasses.dataclass
class TaskSet:
    """The tasks as lm-eval loads them (names, or configs read from files) and the manager that
    knows the names; ``labels`` are what the user wrote, for messages."""

    specs: list
    labels: list[str]
    manager: Any  # lm_eval.tasks.TaskManager


def split_tasks(text: str | Sequence[str]) -> list[str]:
    """``a,b.yaml`` or a list of them -> the task names and files, in order."""
    items = text.split(",") if isinstance(text, str) else list(text)
    return [item.strip() for item in items if item and item.strip()]


def _read_task_file(path: str) -> dict:
    from lm_eval.tasks._yaml_loader import load_yaml

    try:
        cfg = load_yaml(path, resolve_func=True)
    except Exception as error:  # noqa: BLE001 - YAML, include or !function errors: one line each
        reason = " ".join(str(error).split())[:200]
        raise TaskError(f"task file {path}: does not parse ({type(error).__name__}: {reason}); expected an "
                        f"lm-eval task YAML (task:, dataset_path:, doc_to_text: ...)") from None
    if not (isinstance(cfg.get("task"), str) or isinstance(cfg.get("group"), str)):
        raise TaskError(f"task file {path}: no 'task:' (or 'group:') name; expected an lm-eval task YAML "
                        f"such as tests/data/lm_eval/tiny_cloze.yaml")
    kwargs = cfg.get("dataset_kwargs") or {}
    files = kwargs.get("data_files")
    if files is not None:
        here = os.path.dirname(os.path.abspath(path))

        def beside(name: Any) -> Any:
            if isinstance(name, str) and not os.path.isabs(name) and "://" not in name:
                return os.path.join(here, name)
            return name

        if isinstance(files, dict):
            files = {split: ([beside(f) for f in v] if isinstance(v, list) else beside(v)) for split, v in files.items()}
        else:
            files = [beside(f) for f in files] if isinstance(files, list) else beside(files)
        cfg["dataset_kwargs"] = dict(kwargs, data_files=files)
    return cfg


def load_tasks(text: str | Sequence[str]) -> TaskSet:
    """Check and read every task: files parsed, names looked up in lm-eval's index (built only
    when a name is given: it reads lm-eval's thousands of task files, a few seconds)."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise TaskError(f"tasks {text!r}: lm-evaluation-harness is not installed; expected "
                        f"`pip install -e \".[eval]\"` (or `pip install lm-eval`)") from None

    labels = split_tasks(text)
    if not labels:
        raise TaskError(f"--tasks {text!r}: no task; expected lm-eval task names or task YAML files, "
                        f"e.g. --tasks hellaswag or --tasks tests/data/lm_eval/tiny_cloze.yaml")
    specs: list = []
    names = [label for label in labels if not (label.endswith(YAML_SUFFIXES) or os.path.isfile(label))]
    manager = TaskManager(include_defaults=bool(names))
    known = set(manager.all_tasks) if names else set()
    for label in labels:
        if label not in names:
            if not os.path.isfile(label):
                raise TaskError(f"task file {label}: not found; expected an lm-eval task YAML file")
            specs.append(_read_task_file(label))
        elif label in known:
            specs.append(label)
        else:
            close = difflib.get_close_matches(label, known, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise TaskError(f"task {label}: not an lm-eval task, group or tag; {hint}expected a name that "
                            f"`lm-eval ls tasks` lists, or a task YAML file")
    return TaskSet(specs, labels, manager)


def quiet_lm_eval_logs() -> None:
    """lm-eval logs every request batch and task detail at INFO: keep its warnings only."""
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    import datasets

    datasets.disable_progress_bars()  # a bar per split read, even for eight lines of JSON


def evaluate(lm, tasks: TaskSet, *, limit: int | None = None, bootstrap_iters: int = 0) -> dict:
    """lm-eval's results dict of ``lm`` on ``tasks`` (``results``, ``versions``, ``n-shot``,
    ``configs``, ...; no per-sample log). ``bootstrap_iters`` 0: no standard errors (lm-eval's
    100,000 resamples cost more than a small task's forward passes)."""
    from lm_eval import simple_evaluate

    quiet_lm_eval_logs()
    try:
        results = simple_evaluate(model=lm, tasks=list(tasks.specs), limit=limit, task_manager=tasks.manager,
                                  log_samples=False, bootstrap_iters=bootstrap_iters)
    except (FileNotFoundError, ConnectionError) as error:  # a dataset that cannot be read here
        raise TaskError(f"tasks {','.join(tasks.labels)}: the data cannot be read ({type(error).__name__}: "
                        f"{' '.join(str(error).split())[:200]}); expected a dataset lm-eval can reach, or "
                        f"a task YAML with local data_files") from None
    return results


def results_json(results: dict) -> str:
    """The results dict as JSON (lm-eval's own fallback for values JSON cannot hold)."""
    from lm_eval.utils import handle_non_serializable

    return json.dumps(results, indent=2, default=handle_non_serializable, sort_keys=True)


def task_scores(results: dict) -> dict[str, float]:
    """``{"lm_eval/<task>/<metric>": value}`` of every numeric metric (standard errors left
    out); lm-eval's filter suffix is kept only where it is not the default ``none``."""
    scores: dict[str, float] = {}
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            metric, comma, filter_name = key.partition(",")
            # lm-eval keys its metrics "metric,filter"; alias and sample_len are not scores.
            if not comma or metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            name = metric if filter_name in ("", "none") else f"{metric}_{filter_name}"
            scores[f"lm_eval/{task}/{name}"] = float(value)
    return scores


def results_table(results: dict) -> str:
    """lm-eval's own table of the results (and of groups, when a group was run)."""
    from lm_eval.utils import make_table

    table = make_table(results)
    if results.get("groups"):
        table += "\n" + make_table(results, "groups")
    return table
