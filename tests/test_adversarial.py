"""benchmarks/adversarial.py kept working: its classification rules on hand-made outcomes, and two
of its cases run through its own functions with real trainer processes (a bad config refused in
one line; kill -9 mid-run, a rerun that resumes on the uninterrupted curve)."""

import importlib.util
import os
import signal
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _harness():
    spec = importlib.util.spec_from_file_location("adversarial", os.path.join(REPO, "benchmarks", "adversarial.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["adversarial"] = module  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(module)
    return module


adv = _harness()


def _ctx(tmp_path, reference=((1, 5.5), (2, 5.25))):
    shared = adv.Shared(tmp_path, tmp_path / "cache", tuple(reference), tmp_path / "seed")
    ctx = adv.Ctx(tmp_path / "case", shared)
    ctx.run_dir.mkdir(parents=True)
    return ctx


def test_each_class_follows_from_what_a_case_saw(tmp_path, monkeypatch):
    """A segfault, a traceback and a signal's default action are unclear, a bad input accepted is
    silent, a loss off the reference curve or a signal's stop without a checkpoint of the last
    logged step is data loss; a case's class is its worst finding."""
    ctx = _ctx(tmp_path)
    monkeypatch.setattr(adv, "STEPS", 2)
    segfault = adv.Ran(-11, "", "stopped by signal 15 during start-up\n", 1.0)
    assert [f.klass for f in adv.ending(segfault, {143}, "run")] == ["unclear"]
    by_its_default_action = adv.Ran(-signal.SIGTERM, "", "", 1.0)  # a shell reads 143, but no stop line
    assert adv.ending(by_its_default_action, {143}, "run") == []
    unsaid = adv.stop_line(by_its_default_action, signal.SIGTERM, "mid-run", ctx, [4], [{"step": 4}])
    assert [f.klass for f in unsaid] == ["unclear"]
    stopped = adv.Ran(143, "", "stopped by signal 15 (SIGTERM) at step 4; checkpoint saved to c/4\n", 1.0)
    assert adv.stop_line(stopped, signal.SIGTERM, "mid-run", ctx, [4], [{"step": 4}]) == []
    assert adv.stop_line(stopped, signal.SIGTERM, "mid-run", ctx, [2], [{"step": 4}])[0].klass == "data loss"
    traceback = adv.Ran(1, "", "Traceback (most recent call last):\nValueError: boom\n", 1.0)
    assert {f.klass for f in adv.ending(traceback, {2}, "run")} == {"unclear"}
    accepted = adv.Observed((adv.Ran(0, "", "", 1.0),), {"records": [{"step": 1}]})
    assert [f.klass for f in adv.expect_one_line_refusal("train.steps", ctx, accepted)] == ["silent"]
    refused = adv.Observed((adv.Ran(2, "", "error: train.steps=1:30: expected an integer\n", 1.0),), {})
    assert adv.expect_one_line_refusal("train.steps", ctx, refused) == []
    two_lines = adv.Observed((adv.Ran(2, "", "error: train.steps: bad\n  more detail\n", 1.0),), {})
    assert [f.klass for f in adv.expect_one_line_refusal("train.steps", ctx, two_lines)] == ["unclear"]
    assert adv.on_the_curve(ctx, [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 5.25}]) == []
    off = adv.on_the_curve(ctx, [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 5.250001}])
    assert [f.klass for f in off] == ["data loss"]
    assert adv.records_kept([{"step": 1}], [2])[0].klass == "data loss"
    assert adv._worst([adv.Finding("unclear", ""), adv.Finding("data loss", ""), adv.Finding("silent", "")]) \
        == "data loss"
    assert adv._worst([]) == "clean"


def test_a_bad_config_and_kill_9_mid_run_classify_clean(tmp_path):
    """The matrix's own cases on real processes: an unknown key is refused in one line (clean);
    kill -9 after three steps, then a rerun that resumes from the newest complete checkpoint and
    logs every loss of the uninterrupted reference run exactly (clean)."""
    shared = adv.prepare(tmp_path, seed=False)
    assert [step for step, _ in shared.reference] == list(range(1, adv.STEPS + 1))
    cases = {c.name: c for c in adv.all_cases()}
    bad = adv.run_case(cases["unknown-key"], shared)
    assert (bad.klass, bad.exit_codes) == ("clean", (2,)), bad
    killed = adv.run_case(cases["sigkill-mid-run"], shared)
    assert (killed.klass, killed.exit_codes) == ("clean", (-signal.SIGKILL, 0)), killed
    rerun = (tmp_path / "sigkill-mid-run" / "rerun.out").read_text()
    assert "resumed from " in rerun
