"""SIGTERM / SIGINT / SIGHUP: the running step finishes, a checkpoint of it is written, the process exits
with 128 + signal, and a rerun resumes from exactly that step."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import cpu_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARGS = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
        "model.vocab_size=256", "data.source=synthetic", "data.seq_len=32", "data.global_batch=4",
        "train.log_every=1", "optim.warmup_steps=1", "optim.schedule_steps=100000", "mesh.data=1"]


def _run(tmp_path, steps):
    env = cpu_env(1)
    return subprocess.Popen([sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml"),
                             *ARGS, f"run.output_dir={tmp_path}", "run.name=pre", f"train.steps={steps}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps(tmp_path):
    path = tmp_path / "pre" / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_signal_checkpoints_and_rerun_resumes(tmp_path, sig):
    proc = _run(tmp_path, 100000)
    deadline = time.time() + 180
    while len(_steps(tmp_path)) < 3:
        assert proc.poll() is None and time.time() < deadline, "training did not get going"
        time.sleep(0.2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, out[-2000:]
    assert "checkpoint saved, rerun to resume" in out
    saved = sorted(int(d) for d in os.listdir(tmp_path / "pre" / "checkpoints"))
    last = _steps(tmp_path)[-1]
    assert saved[-1] == last >= 3  # the step that was running when the signal came

    again = _run(tmp_path, last + 2)
    out2, _ = again.communicate(timeout=180)
    assert again.returncode == 0, out2[-2000:]
    assert "resumed from" in out2 and f"/{last}" in out2
    assert _steps(tmp_path)[-2:] == [last + 1, last + 2]


def test_unhandled_exception_writes_a_crash_report(tmp_path):
    env = cpu_env(1)
    proc = subprocess.run([sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml"),
                           *ARGS, f"run.output_dir={tmp_path}", "run.name=pre", "train.steps=10",
                           "resilience.fault.exception_at_step=4"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    report = json.loads((tmp_path / "pre" / "crash.json").read_text())
    assert report["error"].startswith("InjectedFault: resilience.fault.exception_at_step=4")
    assert "Traceback" in report["traceback"] and report["step"] == 4
    assert report["config"]["resilience"]["fault"]["exception_at_step"] == 4
    assert report["last_metrics"]["step"] == 3  # step 4's metrics were not yet logged
    assert "crash.json" in proc.stdout + proc.stderr


# ----------------------------------------------------------------------------- signals at any moment

# A model of 5M parameters (60 MB with the optimizer state), so that the final asynchronous save
# is still being written when the test sees its temporary directory and signals.
BIG = ["model.d_model=256", "model.d_ff=768", "model.vocab_size=4096", "model.n_layers=4"]


def _start(tmp_path, name, *extra, env=None):
    """The trainer with its output in a file (read while it runs)."""
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml"),
                             *ARGS, f"run.output_dir={tmp_path}", f"run.name={name}", *extra],
                            env=env or cpu_env(1), stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, tmp_path / f"{name}.log"


def _wait_for(proc, predicate, what, timeout=240, poll=0.02):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, f"exited (code {proc.returncode}) before {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def _finish(proc, log, timeout=120):
    proc.wait(timeout=timeout)
    return log.read_text()


def _checkpoint_entries(tmp_path, name):
    directory = tmp_path / name / "checkpoints"
    return sorted(os.listdir(directory)) if directory.exists() else []


@pytest.mark.parametrize("signals", [2, 3])
def test_sigterm_during_the_final_async_save_waits_for_it_or_aborts_on_the_third(tmp_path, signals):
    # checkpoint.every=0: the final save is the run's only checkpoint, as in the default config.
    proc, log = _start(tmp_path, "final", "train.steps=3", "checkpoint.every=0", *BIG)
    ckpts = tmp_path / "final" / "checkpoints"
    _wait_for(proc, lambda: ckpts.exists() and any(n.startswith("3.orbax-checkpoint-tmp") for n in os.listdir(ckpts)),
              "the final save", poll=0.002)
    for _ in range(signals):
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)  # a signal sent while the last is still pending would merge with it
    out = _finish(proc, log)
    assert proc.returncode == 143, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "signal 15 (SIGTERM) again: still waiting for" in out
    if signals == 2:
        assert "stopped by signal 15 (SIGTERM) after step 3; checkpoint saved" in out
        assert _checkpoint_entries(tmp_path, "final") == ["3"]  # complete, nothing temporary left
        assert (ckpts / "3" / "commit_success.txt").exists()
    else:
        line = next(l for l in out.splitlines() if "a third time" in l)
        assert "aborting without waiting" in line and "exiting with code 143" in line
        assert "3" not in _checkpoint_entries(tmp_path, "final")  # the save cut short is no checkpoint
    assert not (tmp_path / "final" / "run.lock").exists()  # released on every way out


# JAX logs this when the first step's lowering is done; XLA's compile of it (about 2 s here,
# unrolled blocks, no compilation cache) follows at once.
COMPILING = "Finished jaxpr to MLIR module conversion jit(train_step)"


@pytest.mark.parametrize("sig, after", [(signal.SIGINT, "run directory "), (signal.SIGTERM, COMPILING),
                                        (signal.SIGINT, COMPILING), (signal.SIGHUP, COMPILING)])
def test_signal_during_start_up_is_one_line_and_leaves_nothing_half_written(tmp_path, sig, after):
    # SIGINT while the data and state are set up; each stop signal while the first step compiles
    # (raised out of XLA's compile call while its threads run: no segfault on the way out).
    env = {k: v for k, v in cpu_env(1, JAX_LOG_COMPILES="1").items() if k != "JAX_COMPILATION_CACHE_DIR"}
    proc, log = _start(tmp_path, "early", "train.steps=1000", "train.scan_layers=false", "run.compile_cache_dir=",
                       *BIG, env=env)
    _wait_for(proc, lambda: after in log.read_text(), repr(after), poll=0.005)
    time.sleep(0.3 if after == COMPILING else 0)
    sent = time.time()
    proc.send_signal(sig)
    out = _finish(proc, log)
    assert proc.returncode == 128 + sig, out[-3000:]  # 139 (a segfault at exit) before
    assert "Segmentation fault" not in out and "Fatal Python error" not in out
    assert time.time() - sent < 30  # promptly, not after the compilation
    lines = [l for l in out.splitlines() if "(SIG" in l]
    assert len(lines) == 1 and "during start-up" in lines[0] and "nothing was saved" in lines[0], out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out
    run = tmp_path / "early"
    assert not [p for p in run.rglob("*") if p.name.endswith(".tmp") or "orbax-checkpoint-tmp" in p.name]
    assert not (run / "run.lock").exists() and _checkpoint_entries(tmp_path, "early") == []
    assert (run / "config.yaml").read_text().startswith("run:")  # complete, when written


def test_sigint_during_the_imports_is_one_line_without_a_traceback():
    proc = subprocess.Popen([sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml")],
                            env=cpu_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # jaxlib's library is mapped while the imports are still running (they take seconds).
    maps = f"/proc/{proc.pid}/maps"
    _wait_for(proc, lambda: os.path.exists(maps) and "jaxlib" in open(maps).read(), "jaxlib loaded", poll=0.002)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]  # a segfault or a KeyboardInterrupt traceback before
    assert err.strip().splitlines() == ["stopped by signal 2 (SIGINT) while starting, before the config was read; "
                                        "nothing was saved"], err[-3000:]
    assert out == ""


def test_a_hung_run_still_honours_sigterm(tmp_path):
    # The loop blocks forever before step 4 and the hang watchdog is off (the default).
    proc, log = _start(tmp_path, "hung", "train.steps=100", "checkpoint.every=2", "resilience.fault.hang_at_step=4")
    _wait_for(proc, lambda: len(_steps_of(tmp_path, "hung")) >= 2, "two logged steps")
    time.sleep(1)
    sent = time.time()
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, log, timeout=90)
    assert proc.returncode == 143, out[-3000:]
    waited = time.time() - sent
    assert 10 <= waited < 60, waited  # the grace period (MIN_GRACE_S = 10 s), then out
    line = next(l for l in out.splitlines() if "made no progress" in l)
    assert "a hung step cannot be checkpointed" in line
    assert f"the newest complete checkpoint is {tmp_path / 'hung' / 'checkpoints' / '2'}" in line
    assert _checkpoint_entries(tmp_path, "hung") == ["2"]
    assert not (tmp_path / "hung" / "run.lock").exists()


def test_sigterm_with_checkpointing_off_says_nothing_was_saved(tmp_path):
    proc, log = _start(tmp_path, "nosave", "train.steps=100000", "checkpoint.enabled=false")
    _wait_for(proc, lambda: len(_steps_of(tmp_path, "nosave")) >= 2, "two logged steps")
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, log)
    assert proc.returncode == 143, out[-3000:]
    assert "checkpoint saved" not in out
    assert "checkpointing is off (checkpoint.enabled=false): nothing was saved" in out
    assert _checkpoint_entries(tmp_path, "nosave") == []


def _steps_of(tmp_path, name):
    path = tmp_path / name / "metrics.jsonl"
    return [json.loads(l)["step"] for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


SWALLOWED = """
import gc, os, signal
from maxfp4.reliability.preemption import Interrupted, PreemptionWatch

class SignalledWhileFinalised:
    def __del__(self):  # Python prints an exception raised here as "ignored" and goes on
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(1000))  # the handler runs between these bytecodes

watch = PreemptionWatch()
SignalledWhileFinalised()
gc.collect()
print("start-up went on", flush=True)
try:
    watch.check_start_up()
except Interrupted as stop:
    print("raised again:", stop.code, stop.message, flush=True)
"""


def test_a_start_up_stop_swallowed_by_a_finaliser_is_raised_again_before_the_first_step():
    # A SIGINT while the main thread runs a finaliser: the handler's Interrupted is printed as
    # "Exception ignored" and start-up goes on; the loop asks again before it steps (and once
    # the first step is dispatched), so the run still stops with the start-up line.
    done = subprocess.run([sys.executable, "-c", SWALLOWED], env=cpu_env(1), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Exception ignored" in done.stderr and "Interrupted" in done.stderr  # the swallowing happened
    assert done.stdout.splitlines() == [
        "start-up went on",
        "raised again: 130 stopped by signal 2 (SIGINT) during start-up, before the first step; nothing was saved"]


ABSL_HANDLER_IMPORT = """
import os, signal, sys, time
from maxfp4.reliability.signal_exit import stop_handlers_kept

got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
if sys.argv[1] == "kept":
    with stop_handlers_kept():
        import jax._src.test_util  # installs absl's failure signal handler as it is imported
else:
    import jax._src.test_util
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(4.5)  # absl's alarm would abort 3 s after the signal
print("handled", got, flush=True)
"""


@pytest.mark.parametrize("mode", ["kept", "taken"])
def test_an_import_that_installs_abseils_handler_does_not_take_sigterm(mode):
    # jax's Pallas GPU example kernels (the grouped GEMM's) import jax's test utilities, which
    # install absl's failure signal handler; on SIGTERM it arms an alarm that aborts the process
    # 3 s later, through any checkpoint a graceful stop is writing. Imported inside
    # stop_handlers_kept, the process's own handler keeps SIGTERM; "taken" shows the abort.
    done = subprocess.run([sys.executable, "-c", ABSL_HANDLER_IMPORT, mode], env=cpu_env(1), cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    if mode == "kept":
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.splitlines() == ["handled [15]"]
        assert "SIGTERM received" not in done.stderr
    else:
        assert done.returncode == -signal.SIGABRT and "SIGTERM received" in done.stderr, done.stderr[-3000:]
        assert done.stdout == ""
