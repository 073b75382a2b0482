"""Weights & Biases through its own library (``pip install -e ".[wandb]"``).

Project from WANDB_PROJECT (default ``maxfp4``), the W&B run named after the run directory and
its files under ``<run>/wandb``; ``WANDB_MODE=offline`` writes there without a network (``wandb
sync`` uploads later). A restart resumes the stored run id. Steps are a metric of their own
(``step``), so steps logged again after a rollback or a restart are kept, not refused.
"""

from __future__ import annotations

import os


class Tracker:
    def __init__(self, run):
        self._run = run
        self.run_id = run.id

    @classmethod
    def open(cls, run_dir: str, run_name: str, run_id: str | None) -> "Tracker":
        import wandb

        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "maxfp4"), name=run_name, id=run_id,
                         resume="allow", dir=run_dir, reinit="create_new",
                         settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))
        run.define_metric("step")
        run.define_metric("*", step_metric="step")
        return cls(run)

    def log_params(self, flat: dict) -> None:
        self._run.config.update(flat, allow_val_change=True)

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log({**scalars, "step": step})

    def log_files(self, paths: list[str]) -> None:
        import wandb

        artifact = wandb.Artifact(f"run-files-{self.run_id}", type="run-files")
        for path in paths:
            artifact.add_file(path)
        self._run.log_artifact(artifact)

    def close(self) -> None:
        self._run.finish()
