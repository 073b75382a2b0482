"""goodput.json: a run's wall time split into where it went, accumulated over a crash and its resume."""

import io
import json
import time

import jax
import pytest

from maxfp4.goodput import BUCKETS
from maxfp4.plan.command import _goodput
from maxfp4.reliability.preemption import InjectedFault
from maxfp4.train import train


def test_a_crash_and_its_resume_are_accounted_for_and_the_planner_takes_the_measured_goodput(tiny_cfg, tmp_path, capsys):
    # optim.schedule_steps=8 as in test_trackers.py: one compiled step for both.
    common = ["run.name=gp", "train.steps=8", "optim.schedule_steps=8", "checkpoint.every=4", "checkpoint.async=false"]
    with pytest.raises(InjectedFault):  # after step 7: steps 1-6 fetched, the newest checkpoint is step 4's
        train(tiny_cfg(*common, "resilience.fault.exception_at_step=7"), devices=jax.devices()[:1], stream=io.StringIO())
    crashed = json.loads((tmp_path / "gp" / "goodput.json").read_text())
    assert crashed["runs"][0]["ended"] == "crashed" and crashed["runs"][0]["last_step"] == 6
    time.sleep(0.3)  # the time between the crash and the resume
    capsys.readouterr()
    train(tiny_cfg(*common), devices=jax.devices()[:1], stream=io.StringIO())
    said = capsys.readouterr().out
    record = json.loads((tmp_path / "gp" / "goodput.json").read_text())
    first, second = record["runs"]
    assert second["ended"] == "finished" and second["start_step"] == 4
    # The crash-to-resume gap is read from the run's own records: last sign of life -> next start.
    assert second["crash_to_resume_s"] == pytest.approx(second["started_at"] - first["last_alive"], abs=1e-9)
    assert second["crash_to_resume_s"] >= 0.3
    # Steps the crashed attempt finished past step 4's checkpoint are charged to it as lost.
    assert first["lost_steps"] == 2 and first["lost_s"] > 0
    # Every step after the compiled first one is productive or lost.
    assert first["productive_steps"] + first["lost_steps"] == first["last_step"] - 1
    assert second["productive_steps"] == 8 - 4 - 1 and second["lost_steps"] == 0
    for run in record["runs"]:
        # The buckets and the rest ("other") make up each attempt's wall time, none negative.
        assert all(run[b] >= 0 for b in BUCKETS)
        assert sum(run[b] for b in BUCKETS if b != "crash_to_resume_s") == pytest.approx(run["wall_s"], rel=1e-9)
        assert run["compile_s"] > 0 and run["productive_s"] > 0
    assert first["checkpoint_save_s"] > 0 and second["checkpoint_restore_s"] > 0
    # Totals over attempts; goodput = productive / wall, the gap included in the wall.
    for b in BUCKETS:
        assert record[b] == pytest.approx(first[b] + second[b], abs=1e-9)
    assert record["wall_s"] == pytest.approx(first["wall_s"] + second["wall_s"] + second["crash_to_resume_s"])
    assert record["goodput"] == pytest.approx(record["productive_s"] / record["wall_s"]) and 0 < record["goodput"] < 1
    assert f"goodput {100 * record['goodput']:.1f}% of" in said and "over 2 attempt(s)" in said
    assert _goodput(str(tmp_path / "gp")) == record["goodput"]
    assert _goodput("0.8") == 0.8
