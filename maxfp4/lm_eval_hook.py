"""``train.eval_tasks``: lm-evaluation-harness tasks scored during training, beside the held-out loss.

On the steps its cadence names (``train.eval_every`` and the last), the hook scores the state
just dispatched with the run's own precision policy and FP8 scales, exactly what
``python -m maxfp4.evaluate RUN`` reads from that step's checkpoint, writes lm-eval's results
dict to ``<run>/evals/step_<N>.json`` and hands the scalar metrics
(``lm_eval/<task>/<metric>``) to the metrics hook, which logs them with that step's record
(metrics.jsonl, TensorBoard and every tracker that takes TensorBoard's scalars). The tasks are
checked at start-up (:func:`check_eval_tasks`), before the run directory is touched; the forward
pass is compiled at the first evaluation and reused by the later ones.
"""

from __future__ import annotations

import os
from typing import Callable

import jax

from maxfp4.config import Config
from maxfp4.loop import Hook
from maxfp4.precision.state import scales_of


def check_eval_tasks(cfg: Config):
    """The run's :class:`maxfp4.lm_eval_tasks.TaskSet`, or None without ``train.eval_tasks``;
    an unknown task or a task file that does not parse is one line here."""
    if not cfg.train.eval_tasks:
        return None
    from maxfp4.lm_eval_tasks import load_tasks

    return load_tasks(cfg.train.eval_tasks)


class LmEvalHook(Hook):
    """Scores ``tasks`` on ``on_due``; ``scores`` (step -> {metric: value}) is read by the metrics."""

    def __init__(self, tasks, make_lm: Callable, run_dir: str, *, precision: str, is_writer: bool,
                 say: Callable[[str], None]):
        self.tasks, self.make_lm, self.run_dir, self.precision = tasks, make_lm, run_dir, precision
        self.is_writer, self.say = is_writer, say
        self.scores: dict[int, dict[str, float]] = {}
        self._lm = None

    def on_due(self, loop, step: int) -> None:
        from maxfp4.files import write_text_atomic
        from maxfp4.lm_eval_tasks import evaluate, results_json, task_scores

        if self._lm is None:
            self._lm = self.make_lm()
        self._lm.params, self._lm.scales = loop.state.params, scales_of(loop.state.precision)
        results = evaluate(self._lm, self.tasks)
        results["maxfp4"] = {"source": os.path.abspath(self.run_dir), "step": step, "precision": self.precision}
        self._lm.params = self._lm.scales = None  # the next step donates these buffers
        self.scores[step] = task_scores(results)
        if self.is_writer:
            target = os.path.join(self.run_dir, "evals", f"step_{step}.json")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            write_text_atomic(target, results_json(results) + "\n")
            self.say(f"step {step} lm-eval: " + ", ".join(f"{k.removeprefix('lm_eval/')} {v:.4g}"
                                                          for k, v in self.scores[step].items()))
        # The wall clock of this step includes the evaluation: the metrics start a new window.
        loop.host_paused(step)


def lm_eval_hook(cfg: Config, tasks, tokenizer, policy, mesh, *, say: Callable[[str], None]) -> LmEvalHook | None:
    """The hook for ``tasks`` (None when there are none): rows per forward pass a multiple of the
    devices the batch axes split them over."""
    if tasks is None:
        return None
    from maxfp4.lm_eval_adapter import MaxFP4LM
    from maxfp4.lm_eval_cli import precision_label

    batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
    rows = batch_devices * -(-8 // batch_devices)

    def make_lm():
        return MaxFP4LM(None, cfg.model, tokenizer, policy=policy, max_length=cfg.data.seq_len, rows=rows, mesh=mesh)

    return LmEvalHook(tasks, make_lm, cfg.run_dir, precision=precision_label(cfg.precision),
                      is_writer=jax.process_index() == 0, say=say)
