"""MLflow through its own client (``pip install -e ".[mlflow]"``: mlflow-skinny, no server needed).

The tracking store is MLFLOW_TRACKING_URI when set (a server, a database), else a file store in
``<output_dir>/mlruns`` beside the runs (``mlflow ui --backend-store-uri runs/mlruns`` shows it);
the experiment is MLFLOW_EXPERIMENT_NAME (default ``maxfp4``). A restart logs into the stored run.
"""

from __future__ import annotations

import os
import time

_BATCH = 100  # MLflow's limit of parameters per log_batch call
_VALUE_CHARS = 6000  # and of characters per parameter value


def tracking_uri(run_dir: str) -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    # MLflow 3 refuses a file store unless asked for; a local store beside the runs is the point here.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return "file://" + os.path.join(os.path.dirname(os.path.abspath(run_dir)), "mlruns")


class Tracker:
    def __init__(self, client, run_id: str):
        self._client, self.run_id = client, run_id

    @classmethod
    def open(cls, run_dir: str, run_name: str, run_id: str | None) -> "Tracker":
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=tracking_uri(run_dir))
        if run_id is not None:
            client.update_run(run_id, status="RUNNING")
            return cls(client, run_id)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "maxfp4")
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        return cls(client, client.create_run(experiment_id, run_name=run_name).info.run_id)

    def log_params(self, flat: dict) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)[:_VALUE_CHARS]) for key, value in flat.items()]
        for start in range(0, len(params), _BATCH):
            self._client.log_batch(self.run_id, params=params[start:start + _BATCH])

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in scalars.items()])

    def log_files(self, paths: list[str]) -> None:
        for path in paths:
            self._client.log_artifact(self.run_id, path)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
