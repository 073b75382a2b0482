"""TensorBoard event files in ``<run>/tensorboard`` through tensorboardX (no TensorFlow)."""

from __future__ import annotations

import os


class Tracker:
    """Scalars as TensorBoard scalars; the config and the files stay in the run directory, which
    is where TensorBoard users read them (nothing to upload, no run id)."""

    run_id = None

    def __init__(self, writer):
        self._writer = writer

    @classmethod
    def open(cls, run_dir: str, run_name: str, run_id: str | None) -> "Tracker":
        from tensorboardX import SummaryWriter

        return cls(SummaryWriter(os.path.join(run_dir, "tensorboard")))

    def log_params(self, flat: dict) -> None:
        pass

    def log_scalars(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_files(self, paths: list[str]) -> None:
        pass

    def close(self) -> None:
        self._writer.close()
