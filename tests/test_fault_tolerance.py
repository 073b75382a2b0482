"""The resilience machinery end to end, through the command line, with real processes, signals and
injected faults: kill -9 (mid-run, during an async save) and resume; NaN steps skipped, a streak
rolled back, a persistent fault stopped; re-runs of skipped steps telling a transient fault from a
divergence; a hang ended by the watchdog; a slow process named in
the straggler report of a two-process run; preflight's failure lines."""

import json
import math
import os
import signal
import subprocess
import sys
import time

from maxfp4.reliability.stragglers import host_name
from tests.conftest import cpu_env
from tests.test_multiprocess import _free_port
from tests.test_preemption import ARGS, REPO

CONFIG = os.path.join(REPO, "configs", "quickstart.yaml")


def _cmd(tmp_path, name, *extra):
    return [sys.executable, "-m", "maxfp4.train", CONFIG, *ARGS, f"run.output_dir={tmp_path}", f"run.name={name}",
            *extra]


def _run(tmp_path, name, *extra, timeout=300):
    return subprocess.run(_cmd(tmp_path, name, *extra), env=cpu_env(1), capture_output=True, text=True, timeout=timeout)


def _records(tmp_path, name):
    path = tmp_path / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _complete(ckpts):
    return sorted(int(n) for n in os.listdir(ckpts) if n.isdigit())


def test_kill_9_mid_run_and_during_async_save_then_rerun_finishes_like_an_uninterrupted_run(tmp_path):
    # Every run has the same config; steps are slowed to 0.2 s so that a kill lands mid-run.
    steps = ["train.steps=8", "checkpoint.every=2", "checkpoint.keep=10", "resilience.fault.slow_process=0",
             "resilience.fault.slow_seconds=0.2"]
    ckpts = tmp_path / "killed" / "checkpoints"

    # 1. kill -9 in the middle of training, the moment checkpoint 4 is committed (Orbax renames
    # its directory to "4"): step 4's metrics are already on disk (the next step's start is 0.2 s
    # away; they used to be written only once step 5 was dispatched, and so were lost for good).
    proc = subprocess.Popen(_cmd(tmp_path, "killed", *steps), env=cpu_env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while not (ckpts / "4").is_dir():
        assert proc.poll() is None and time.time() < deadline, "training did not get going"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    first = _complete(ckpts)[-1]
    assert first == 4
    assert [r["step"] for r in _records(tmp_path, "killed")] == [1, 2, 3, 4]

    # 2. The rerun resumes from that checkpoint; kill -9 it the moment an async save is in flight
    # (Orbax writes <step>.orbax-checkpoint-tmp-*, renamed when complete).
    leftovers = set(os.listdir(ckpts))  # the first kill may itself have cut a save short
    proc = subprocess.Popen(_cmd(tmp_path, "killed", *steps), env=cpu_env(1), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    partial = None
    while partial is None:
        assert proc.poll() is None and time.time() < deadline, "no async save caught in flight"
        tmp = [n for n in set(os.listdir(ckpts)) - leftovers if "tmp" in n and int(n.split(".")[0]) > first]
        if tmp:
            proc.send_signal(signal.SIGKILL)
            partial = tmp[0]
        time.sleep(0.002)  # poll often, yet leave the CPU to the trainer
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == -signal.SIGKILL
    assert f"resumed from {ckpts}/{first}" in out
    assert int(partial.split(".")[0]) not in _complete(ckpts)  # the interrupted save is no checkpoint
    resume = _complete(ckpts)[-1]
    assert resume < 8

    # 3. The next rerun ignores the partial save, resumes from the last complete checkpoint and
    # ends exactly where a run that was never interrupted ends. The records the killed process
    # wrote after that checkpoint (those of the save cut short) move aside, not logged twice.
    written_after = [r for r in _records(tmp_path, "killed") if r["step"] > resume]
    assert written_after
    again = _run(tmp_path, "killed", *steps)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"resumed from {ckpts}/{resume}" in again.stdout
    assert f"metrics.jsonl: moved the records after step {resume}'s, written after its checkpoint" in again.stdout
    assert [json.loads(line) for line in (tmp_path / "killed" / "metrics.superseded.jsonl").read_text().splitlines()
            ] == written_after
    reference = _run(tmp_path, "reference", *steps)
    assert reference.returncode == 0, reference.stderr[-3000:]
    killed, ref = _records(tmp_path, "killed"), _records(tmp_path, "reference")
    assert killed[-1]["step"] == ref[-1]["step"] == 8
    assert killed[-1]["loss"] == ref[-1]["loss"]  # bit for bit: nothing of the kills leaked into the run
    assert [r["step"] for r in killed] == [r["step"] for r in ref] == list(range(1, 9))  # each step once
    assert [r["loss"] for r in killed] == [r["loss"] for r in ref]


def test_a_resumed_run_moves_aside_the_records_written_after_its_checkpoint(tmp_path):
    # The file a process killed after checkpoint 4 leaves (a record cut short at the end), with
    # records before the tail long enough that it is read in more than one block from the end.
    from maxfp4.metrics import MetricsLogger
    path, aside = tmp_path / "metrics.jsonl", tmp_path / "metrics.superseded.jsonl"
    pad = "x" * 20_000
    records = [json.dumps({"step": s, "loss": 1.0 / s, "pad": pad}) + "\n" for s in range(1, 8)]
    path.write_text("".join(records) + '{"step": 8, "lo')
    said = []
    logger = MetricsLogger(str(tmp_path), total_steps=8, enabled=True)
    logger.say = said.append
    logger.resume_at(4)
    logger.write({"step": 5, "loss": 0.5})
    logger.close()
    assert path.read_text() == "".join(records[:4]) + json.dumps({"step": 5, "loss": 0.5}) + "\n"
    assert aside.read_text() == "".join(records[4:]) + '{"step": 8, "lo\n'  # nothing written is lost
    assert said == [f"{path}: moved the records after step 4's, written after its checkpoint by the process that "
                    f"stopped (those steps run again) to {aside}"]

    # A fresh start (no checkpoint: step 0) and a file with nothing after the checkpoint's record
    # keep every record; only a line cut short moves.
    path.write_text("".join(records[:3]) + '{"step": 4')
    logger = MetricsLogger(str(tmp_path), total_steps=8, enabled=True)
    logger.say = said.append
    logger.resume_at(0)
    logger.resume_at(3)
    logger.close()
    assert path.read_text() == "".join(records[:3])
    assert said[1:] == [f"{path}: moved a line cut short to {aside}"] and aside.read_text().endswith('{"step": 4\n')


def test_nan_steps_are_skipped_a_streak_rolls_back_and_a_persistent_fault_stops(tmp_path):
    # Step 3 alone is skipped. Steps 7-9 are a streak of 3: roll back to checkpoint 4, with the
    # data moving on. The fault is tied to step numbers, so the streak comes back after the
    # rollback: the second streak exceeds max_rollbacks=1 and the run stops with exit code 3.
    out = _run(tmp_path, "nan", "train.steps=14", "checkpoint.every=4", "resilience.fault.nonfinite_at_steps=[3,7,8,9]",
               "resilience.max_consecutive_skips=3", "resilience.spike_window=3", "resilience.max_rollbacks=1")
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-3000:]
    recs = _records(tmp_path, "nan")
    by_step = [(r["step"], r["skipped_steps"]) for r in recs]
    assert by_step[:9] == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1), (7, 2), (8, 3), (9, 4)]
    assert not math.isfinite(recs[2]["grad_norm"])
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in recs[3:6])  # training went on
    assert "rollback 1/1: 3 consecutive skipped steps (7..9); restored checkpoint 4" in text
    # After the rollback: steps 5.. again, on new data (the losses differ), skips still counted.
    assert [(r["step"], r["skipped_steps"]) for r in recs[9:11]] == [(5, 4), (6, 4)]
    assert recs[9]["loss"] != recs[4]["loss"]
    assert "resilience.max_rollbacks=1" in text and "Diverged" in text
    assert json.loads((tmp_path / "nan" / "crash.json").read_text())["error"].startswith("Diverged")


def test_rollback_finds_the_pre_streak_checkpoint_that_rotation_would_have_deleted(tmp_path):
    # Saves every 2 steps, keep 3: by the time a NaN streak of exactly max_consecutive_skips (10,
    # steps 8..17) is seen whole, the saves of steps 8-16 would have rotated out every checkpoint
    # from before it, and the save of step 18 (a good step: its state shows no streak) is issued
    # before the host reads step 17. Checkpoint 6 is kept, so the rollback restores it. The fault is
    # tied to step numbers: the streak comes back after the rollback and, with max_rollbacks=1,
    # stops the run. (Other lengths, periods and keeps: tests/test_checkpoint.py.)
    out = _run(tmp_path, "rot", "train.steps=20", "checkpoint.every=2", "checkpoint.keep=3",
               "resilience.fault.nonfinite_at_steps=[8,9,10,11,12,13,14,15,16,17]", "resilience.max_rollbacks=1")
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-3000:]
    assert "rollback 1/1: 10 consecutive skipped steps (8..17); restored checkpoint 6," in text
    recs = _records(tmp_path, "rot")
    assert [r["step"] for r in recs[:17]] == list(range(1, 18)) and recs[17]["step"] == 7  # resumed after 6
    # The second streak: checkpoint 6 was still there, the rollbacks were used up.
    assert "10 consecutive skipped steps (8..17), all non-finite, and 1 rollback(s) done" in text
    assert _complete(tmp_path / "rot" / "checkpoints")[0] == 6


def test_streak_with_nothing_to_roll_back_to_suspends_spike_judgement_and_trains_on(tmp_path):
    # The loss jumps x10 at step 20 (spikes for up to the bound, 7 steps with a window of 12),
    # then steps 25-29 are NaN: a mixed streak of 10 (20..29) with checkpoint.every=0. It is said in
    # one line, spike judgement is suspended for a window, and the run ends normally.
    out = _run(tmp_path, "susp", "train.steps=48", "resilience.spike_warmup=10", "resilience.fault.loss_scale=10",
               "resilience.fault.loss_scale_at_step=20", "resilience.fault.nonfinite_at_steps=[25,26,27,28,29]")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    line = next(l for l in text.splitlines() if l.startswith("guard: "))
    assert line == ("guard: 10 consecutive skipped steps (20..29), 5 with a finite loss, and no checkpoint before "
                    "step 20 to roll back to (checkpoint.every=0 saves only the last step; set checkpoint.every to "
                    "roll back); spike judgement suspended for 12 steps while the loss window refills, training goes on")
    skipped = [r["step"] for prev, r in zip([{"skipped_steps": 0}] + _records(tmp_path, "susp"), _records(tmp_path, "susp"))
               if r["skipped_steps"] > prev["skipped_steps"]]
    # Step 30 was already queued (judged before the suspension); nothing after it is skipped.
    assert skipped == list(range(20, 31))
    assert all(math.isfinite(r["loss"]) for r in _records(tmp_path, "susp")[30:])


def test_nan_streak_with_no_checkpoint_before_it_stops_and_says_why(tmp_path):
    # checkpoint.every=4 is set, but the streak (2..4) begins before the first save: the message
    # names the setting instead of asking for it.
    out = _run(tmp_path, "early", "train.steps=10", "checkpoint.every=4", "resilience.fault.nonfinite_at_steps=[2,3,4]",
               "resilience.max_consecutive_skips=3", "resilience.spike_window=3")
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-3000:]
    assert ("3 consecutive skipped steps (2..4), all non-finite, and no checkpoint before step 2 to roll back to "
            "(checkpoint.every=4); stopping") in text
    assert "set checkpoint.every" not in text


def test_loss_level_shift_in_a_real_run_skips_at_most_the_bound(tmp_path):
    # resilience.fault.loss_scale multiplies the loss and gradients by 3 from step 30 on (a loss x1.5
    # stays under the default margin and is no spike at all): skips only from step 30, at most
    # spike_window // 2 + 1 = 7 of them, no rollback, and the run ends normally.
    out = _run(tmp_path, "shift", "train.steps=60", "resilience.spike_warmup=10", "resilience.fault.loss_scale=3",
               "resilience.fault.loss_scale_at_step=30")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    recs = _records(tmp_path, "shift")
    assert [r["step"] for r in recs] == list(range(1, 61))
    assert recs[28]["skipped_steps"] == 0  # none before step 30
    assert 1 <= recs[-1]["skipped_steps"] <= 7
    assert recs[-1]["loss"] > 2.5 * recs[28]["loss"]  # the shift is real and training goes on at its level
    assert "rollback" not in text and "guard: " not in text


def test_hang_watchdog_dumps_stacks_and_exits(tmp_path):
    start = time.time()
    out = _run(tmp_path, "hang", "train.steps=100", "resilience.fault.hang_at_step=4", "resilience.hang_timeout_s=3",
               timeout=240)
    assert out.returncode == 124, out.stdout[-2000:] + out.stderr[-2000:]
    assert time.time() - start < 120
    dump = (tmp_path / "hang" / "hang_0.txt").read_text()
    assert "no training step completed for 3 s" in dump and "last completed step 2" in dump
    assert "hang_forever" in dump and "Thread" in dump  # every thread's stack, the stuck one included
    assert '"loss"' in dump
    assert "hang watchdog: no step completed for 3 s" in out.stderr


def test_two_processes_report_the_slow_one_as_straggler(tmp_path):
    port = _free_port()
    cmd = _cmd(tmp_path, "two", "train.steps=6", "mesh.data=2", "resilience.straggler_every=3",
               "resilience.fault.slow_process=1", "resilience.fault.slow_seconds=0.4",
               f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2")
    procs = [subprocess.Popen(cmd + [f"distributed.process_id={i}"], env=cpu_env(1), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, o in zip(procs, outs):
        assert p.returncode == 0, o[-3000:]
    # Start-up preflight ran the all-reduce across both processes.
    assert "preflight: devices ok, gemm skipped, allreduce ok" in outs[0]
    line = next(l for l in outs[0].splitlines() if "stragglers (" in l)
    assert "process 1 on " in line and "process 0 on" not in line
    recs = _records(tmp_path, "two")
    reported = [r for r in recs if "straggler_processes" in r]
    assert [r["step"] for r in reported] == [3, 6]
    for r in reported:
        assert [s["process"] for s in r["straggler_processes"]] == [1]
        assert r["straggler_processes"][0]["host_time_s"] >= 0.4 and r["straggler_processes"][0]["host"]


def test_preflight_cli_reports_each_failure_in_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    out = subprocess.run([sys.executable, "-m", "maxfp4.preflight", CONFIG, *ARGS, f"run.output_dir={blocker}",
                          "data.source=text", f"data.paths=[{tmp_path}/missing.txt]"],
                         env=cpu_env(2), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "allreduce  ok" in out.stdout and "devices    ok       2 x cpu" in out.stdout
    lines = out.stderr.strip().splitlines()
    # One line per failed check (a third, the memory check, fails on this 2-device mesh too).
    assert lines[0].startswith("error: preflight data: data.paths:") and "missing.txt" in lines[0]
    assert lines[1].startswith(f"preflight output: {blocker}/quickstart: not writable")


def test_rerun_of_skipped_steps_tells_transient_faults_from_a_divergence_and_says_drain(tmp_path):
    # Steps 3 and 5: NaN gradients in the first evaluation only (a transient fault); 7-9: NaN in
    # every evaluation (a divergence), a streak of max_consecutive_skips with no checkpoint before
    # it, so the run stops (exit 3) and crash.json holds every re-run's verdict.
    out = _run(tmp_path, "rerun", "train.steps=12", "run.deterministic=true", "resilience.rerun_skipped=true",
               "resilience.fault.transient_nonfinite_at_steps=[3,5]", "resilience.fault.nonfinite_at_steps=[7,8,9]",
               "resilience.max_consecutive_skips=3", "resilience.spike_window=3")
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-3000:]
    recs = _records(tmp_path, "rerun")
    assert [(r["step"], r["rerun_verdict"]) for r in recs] == [
        (1, 0), (2, 0), (3, 2), (4, 0), (5, 2), (6, 0), (7, 1), (8, 1), (9, 1)]
    assert recs[-1]["skipped_steps"] == 5
    lines = [line for line in out.stdout.splitlines() if line.startswith("rerun: ")]
    device = f"device cpu:0 of process 0 (host {host_name()})"
    assert lines[:3] == [
        f"rerun: step 3 skipped (non-finite); its re-run gave a different result: a transient hardware fault "
        f"(silent data corruption) on {device}, 1 in this run",
        f"rerun: step 5 skipped (non-finite); its re-run gave a different result: a transient hardware fault "
        f"(silent data corruption) on {device}, 2 in this run",
        f"rerun: {device} gave different results on 2 re-runs (steps 3, 5): drain it",
    ]
    assert lines[3:] == [f"rerun: step {s} skipped (non-finite); its re-run reproduced it bit for bit: a divergence or "
                         f"bad data, not a hardware fault ({device})" for s in (7, 8, 9)]
    crash = json.loads((tmp_path / "rerun" / "crash.json").read_text())
    assert crash["error"].startswith("Diverged")
    assert [(r["step"], r["verdict"]) for r in crash["reruns"]] == [
        (3, "differed"), (5, "differed"), (7, "reproduced"), (8, "reproduced"), (9, "reproduced")]
