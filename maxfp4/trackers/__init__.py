"""Experiment trackers behind one interface: TensorBoard, Weights & Biases, MLflow (``run.trackers``).

A tracker receives every scalar that goes to metrics.jsonl, the resolved config as its run's
parameters, and the run's files (precision table, config, loss plot) as artifacts. Only process
0 opens trackers. The id of each tracker's run is kept in ``<run>/trackers.json``, so a restart
of the run logs into the same tracker run. A tracker that fails (its library raises on start or
later, a lost connection) is reported once and dropped: a tracker never stops training.

Each tracker module holds one class with ``open(run_dir, run_name, run_id)`` (a class method;
``run_id``: the stored id, or None for a new run), ``run_id``, ``log_params(flat)``,
``log_scalars(step, scalars)``, ``log_files(paths)`` and ``close()``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
from typing import Any, Callable

from maxfp4.errors import ConfigError
from maxfp4.files import write_text_atomic

# tracker name -> (module holding it, the library it needs, the pip extra that installs it)
_REGISTRY = {
    "tensorboard": ("maxfp4.trackers.tensorboard_tracker", "tensorboardX", None),
    "wandb": ("maxfp4.trackers.wandb_tracker", "wandb", "wandb"),
    "mlflow": ("maxfp4.trackers.mlflow_tracker", "mlflow", "mlflow"),
}
IDS_FILE = "trackers.json"


def check_trackers_installed(names) -> None:
    """Before anything is written: each tracker's library can be imported, else one line."""
    for name in names:
        _, library, extra = _REGISTRY[name]
        if importlib.util.find_spec(library) is None:
            install = f"pip install -e \".[{extra}]\"" if extra else f"pip install {library}"
            raise ConfigError(f"run.trackers={list(names)}: the {name} tracker needs the {library} package, which is "
                              f"not installed; {install} or drop {name} from run.trackers")


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: the config's dotted keys, as overrides spell them."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _read_ids(run_dir: str) -> dict[str, str]:
    try:
        with open(os.path.join(run_dir, IDS_FILE), encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


class Trackers:
    """The run's trackers as one: each call goes to every tracker still working."""

    def __init__(self, names, run_dir: str, *, config: dict[str, Any], say: Callable[[str], None]):
        self._say, self._live = say, {}
        ids = _read_ids(run_dir)
        run_name = os.path.basename(os.path.normpath(run_dir))
        for name in names:
            cls = getattr(importlib.import_module(_REGISTRY[name][0]), "Tracker")
            tracker = self._attempt(name, lambda: cls.open(run_dir, run_name, ids.get(name)))
            if tracker is None:
                continue
            self._live[name] = tracker
            if ids.get(name) != tracker.run_id:  # a new tracker run: its parameters are the config
                self._attempt(name, lambda: tracker.log_params(flatten(config)))
                ids[name] = tracker.run_id
        if any(tracker.run_id for tracker in self._live.values()):
            write_text_atomic(os.path.join(run_dir, IDS_FILE), json.dumps(ids, indent=1) + "\n")

    @property
    def names(self) -> list[str]:
        return list(self._live)

    def _attempt(self, name: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - any failure of a tracker: warn once, train on
            first_line = str(error).splitlines()[0] if str(error) else ""
            self._say(f"warning: tracker {name} failed ({type(error).__name__}: {first_line}); training goes on without it")
            self._live.pop(name, None)
            return None

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for name, tracker in list(self._live.items()):
            self._attempt(name, lambda: tracker.log_scalars(step, scalars))

    def log_files(self, paths: list[str]) -> None:
        paths = [p for p in paths if os.path.isfile(p)]
        for name, tracker in list(self._live.items()):
            self._attempt(name, lambda: tracker.log_files(paths))

    def close(self) -> None:
        for name, tracker in list(self._live.items()):
            self._attempt(name, tracker.close)
        self._live.clear()
