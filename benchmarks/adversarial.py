"""The adversarial matrix: hostile and clumsy-user cases against ``python -m maxfp4.train``, each
run as real processes with real signals and real files (a 0.1M-parameter model on CPU), each
outcome put in one of four classes. Prints a table, writes JSON, exits 0 whatever it finds:

    PYTHONPATH=$PWD python benchmarks/adversarial.py [--only SUBSTRING] [--workers 2]
        [--json adversarial.json] [--markdown] [--keep DIR] [--list]

Families: ``kill`` (kill -9 at each phase of a run, then a rerun), ``signal`` (SIGTERM, SIGINT,
SIGHUP at the same phases, then a rerun), ``damage`` (a finished run's checkpoints or lock
damaged before a rerun), ``nan`` (non-finite streaks around ``resilience.max_consecutive_skips``),
``config`` (bad configs and overrides), ``data`` (bad data files). The phases: ``imports`` (0.5 s
after the process started, nothing printed: Python importing JAX), ``start-up`` (the
"run directory" line printed, nothing compiled yet), ``compile`` (1.5 s after the "model:" line, no
step finished: the first step compiling into an empty compilation cache), ``mid-run`` (three steps in
metrics.jsonl), ``async-save`` (a ``<step>.orbax-checkpoint-tmp*`` directory of a periodic save on
disk), ``after-commit`` (``<step>/commit_success.txt`` of a periodic save just appeared),
``final-save`` (the temporary directory of the last step's save on disk).

Classes (what the promise is: docs/RELIABILITY.md, and the one-line rule for bad input):

- **clean**: the run did what the docs promise: the documented exit code, a one-line message
  (exactly one ``error:`` line on stderr for a refusal; the stop line for a signal), no
  ``Traceback``, and every check of the case passed (a resume from the newest complete
  checkpoint, every logged loss equal to the uninterrupted reference run's, a fall-back naming
  the damaged checkpoint, a rollback, ...).
- **unclear**: nothing was lost and nothing bad was accepted silently, but the way it ended is not
  the promised one: a Python traceback, a message of several lines or not naming what it
  should, an undocumented exit code (a segfault's 139, death by a signal's default action), no
  end within the case's time limit (30 s for a config or data case), or a refusal where the
  docs promise the run goes on (and the reverse).
- **data loss**: something that existed is gone or wrong: a complete checkpoint (the rerun
  resumed from an older one, or a rollback found none although one was saved before the
  streak), a metrics record of a step that a complete checkpoint holds, a file outside the run
  (through a ``run.lock`` symlink), or the rerun's logged losses differ from the uninterrupted
  reference run's at the same step (every logged step compared exactly).
- **silent**: bad input or damage accepted without a word: exit 0 and no line naming the problem
  (``train.steps=1:30`` read as 90, a duplicate YAML key, an edited checkpoint trusted, a run
  directory of only unfinished checkpoints restarted from step 1).

A case collects findings; its class is the worst of them (data loss, then silent, then unclear),
clean when there is none. The uninterrupted reference run and a finished run to damage are made
once per matrix; every process shares one JAX compilation cache (the compile phase excepted,
which needs a real compilation), with the XLA flags of tests/conftest.py. ``--workers`` cases run
at a time (default 2), each driven by a thread of this process: the work is in the trainer
processes, so the driver stays one small process.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import functools
import glob
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from maxfp4.compiler import xla_knows_cpu_fusion_emitters_flag

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
RUN = "run"  # run.name of every case
XLA_FLAGS = ("--xla_force_host_platform_device_count=1 --xla_backend_optimization_level=0 "
             "--xla_llvm_disable_expensive_passes=true"
             + (" --xla_cpu_use_fusion_emitters=false" if xla_knows_cpu_fusion_emitters_flag() else ""))
TINY = ("model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
        "model.vocab_size=256", "data.source=synthetic", "data.seq_len=32", "data.global_batch=4",
        "train.log_every=1", "optim.warmup_steps=1", "optim.schedule_steps=100000", "mesh.data=1")
STEPS = 8  # the interrupted runs' and reruns' length
SEED_STEPS = 6  # the finished run that damage cases start from: checkpoints 2, 4, 6
# Slow steps (host time only, not math) widen the windows a signal must land in.
CURVE = TINY + (f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=10",
                "resilience.fault.slow_process=0", "resilience.fault.slow_seconds=0.15")
SEED = TINY + (f"train.steps={SEED_STEPS}", "checkpoint.every=2", "checkpoint.keep=10", "checkpoint.verify=true",
               "resilience.fault.slow_process=0", "resilience.fault.slow_seconds=0.15")
DOCUMENTED_EXITS = {0: "done", 1: "full disk or crash", 2: "bad input", 3: "diverged", 4: "peer lost",
                    124: "hang", 129: "SIGHUP", 130: "SIGINT", 143: "SIGTERM"}
CLASSES = ("clean", "unclear", "data loss", "silent")
SEVERITY = {"data loss": 3, "silent": 2, "unclear": 1}
INPUT_LIMIT_S = 30  # a config or data case that takes longer is unclear
RUN_LIMIT_S = 240
DAMAGE_LIMIT_S = 60  # a rerun of 8 tiny steps after damage takes ~4 s; longer is a hang
MEMORY_LIMIT = 8 << 30  # address space of a config or data case (a /dev/zero include must not eat the host)
COMPILE_DELAY_S = 1.5
IMPORTS_S = 0.5
LIMIT = 10  # resilience.max_consecutive_skips, default
STREAK_AT = 16
NAN_STEPS = 30


# ----------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class Shared:
    """What every case may read: the matrix's directory, the compilation cache, the reference
    run's loss per step, and a finished run (checkpoints 2, 4, 6, verified) to copy and damage."""

    root: Path
    cache: Path
    reference: tuple[tuple[int, float], ...]
    seed_run: Path

    def reference_loss(self) -> dict[int, float]:
        return dict(self.reference)


@dataclasses.dataclass(frozen=True)
class Ctx:
    """One case's directory (its run directory is ``work/run``) and the shared inputs."""

    work: Path
    shared: Shared

    @property
    def run_dir(self) -> Path:
        return self.work / RUN

    @property
    def ckpts(self) -> Path:
        return self.run_dir / "checkpoints"


@dataclasses.dataclass(frozen=True)
class Ran:
    """One trainer process: exit code (negative: killed by that signal), output, seconds."""

    rc: int
    out: str
    err: str
    seconds: float
    timed_out: bool = False
    missed: str = ""  # the phase a signal was meant for never came

    @property
    def text(self) -> str:
        return self.out + self.err

    def error_lines(self) -> list[str]:
        return [line for line in self.err.splitlines() if line.startswith("error:")]


@dataclasses.dataclass(frozen=True)
class Observed:
    """What a case's action saw: its processes in order and facts gathered between them."""

    runs: tuple[Ran, ...]
    facts: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Finding:
    klass: str
    note: str


@dataclasses.dataclass(frozen=True)
class Case:
    """``setup`` prepares the case directory, ``action`` runs the trainer (and reruns), ``expect``
    turns what was observed into findings (none: clean)."""

    name: str
    family: str
    action: Callable[[Ctx], Observed]
    expect: Callable[[Ctx, Observed], list[Finding]]
    setup: Callable[[Ctx], None] = lambda ctx: None
    what: str = ""


@dataclasses.dataclass(frozen=True)
class Result:
    name: str
    family: str
    klass: str
    notes: tuple[str, ...]
    seconds: float
    exit_codes: tuple[int, ...]
    what: str


# ----------------------------------------------------------------------------- processes


def trainer_env(cache: Path, **extra: str) -> dict:
    env = dict(os.environ, XLA_FLAGS=XLA_FLAGS, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def trainer_cmd(ctx: Ctx, overrides: Sequence[str], config: str = QUICKSTART, named: bool = True) -> list[str]:
    """``named=False``: the config file gives run.name (a case about the name itself)."""
    return [sys.executable, "-m", "maxfp4.train", config, *overrides, f"run.output_dir={ctx.work}",
            *([f"run.name={RUN}"] if named else [])]


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


class Trainer:
    """A trainer process whose stdout and stderr go to files, readable while it runs."""

    def __init__(self, ctx: Ctx, overrides: Sequence[str], *, tag: str, config: str = QUICKSTART,
                 cache: Path | None = None, limit_memory: bool = False, named: bool = True):
        self.out_path, self.err_path = ctx.work / f"{tag}.out", ctx.work / f"{tag}.err"
        self.started = time.monotonic()
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(trainer_cmd(ctx, overrides, config, named), cwd=REPO, stdout=out, stderr=err,
                                         env=trainer_env(cache or ctx.shared.cache), stdin=subprocess.DEVNULL,
                                         preexec_fn=_limit_memory if limit_memory else None)

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def finish(self, limit_s: float, missed: str = "") -> Ran:
        timed_out = False
        try:
            self.proc.wait(timeout=max(1.0, limit_s - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            timed_out = True
            self.proc.kill()
            self.proc.wait()
        return Ran(self.proc.returncode, self.stdout(), self.err_path.read_text(errors="replace"),
                   round(time.monotonic() - self.started, 2), timed_out, missed)


def run_trainer(ctx: Ctx, overrides: Sequence[str], *, tag: str, limit_s: float = RUN_LIMIT_S,
                config: str = QUICKSTART, limit_memory: bool = False, named: bool = True) -> Ran:
    return Trainer(ctx, overrides, tag=tag, config=config, limit_memory=limit_memory, named=named).finish(limit_s)


# ----------------------------------------------------------------------------- the run directory


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({"unparsable": line[:80]})
    return out


def complete_steps(ckpts: Path) -> list[int]:
    return sorted(int(n) for n in os.listdir(ckpts) if n.isdigit()) if ckpts.is_dir() else []


def temporary_steps(ckpts: Path) -> list[int]:
    if not ckpts.is_dir():
        return []
    return sorted(int(n.split(".")[0]) for n in os.listdir(ckpts)
                  if ".orbax-checkpoint-tmp" in n and n.split(".")[0].isdigit())


# ----------------------------------------------------------------------------- phases of a run


def _phase_imports(ctx: Ctx, trainer: Trainer, seen: dict) -> bool:
    """IMPORTS_S after the process started, nothing printed yet: Python is importing JAX."""
    return time.monotonic() - trainer.started >= IMPORTS_S and not trainer.stdout()


def _phase_start_up(ctx: Ctx, trainer: Trainer, seen: dict) -> bool:
    return "run directory " in trainer.stdout()


def _phase_compile(ctx: Ctx, trainer: Trainer, seen: dict) -> bool:
    """COMPILE_DELAY_S after the "model:" line: the state is built and the first step is being
    traced and compiled (about 5 s into an empty cache; signal_at checks no step had finished)."""
    if "since" not in seen and "model: " in trainer.stdout():
        seen["since"] = time.monotonic()
    return "since" in seen and time.monotonic() - seen["since"] >= COMPILE_DELAY_S


def _phase_mid_run(ctx: Ctx, trainer: Trainer, seen: dict) -> bool:
    return len(records(ctx.run_dir)) >= 3


def _phase_async_save(ctx: Ctx, trainer: Trainer, seen: dict) -> bool:
    return any(4 <= s < STEPS for s in temporary_steps(ctx.ckpts))  # one complete checkpoint before it


def _phase_after_commit(ctx: Ctx, trainer: Trainer, seen: dict) -> bool:
    return any((ctx.ckpts / str(s) / "commit_success.txt").exists() for s in range(4, STEPS, 2))


def _phase_final_save(ctx: Ctx, trainer: Trainer, seen: dict) -> bool:
    return STEPS in temporary_steps(ctx.ckpts)


PHASES: dict[str, Callable[[Ctx, Trainer, dict], bool]] = {
    "imports": _phase_imports, "start-up": _phase_start_up, "compile": _phase_compile, "mid-run": _phase_mid_run,
    "async-save": _phase_async_save, "after-commit": _phase_after_commit, "final-save": _phase_final_save,
}
SAVE_PHASES = ("async-save", "after-commit", "final-save")


def signal_at(ctx: Ctx, phase: str, sig: int, overrides: Sequence[str], tag: str = "interrupted") -> Ran:
    """Start a run, wait for ``phase`` (polling its stdout and checkpoints/), send ``sig``."""
    fresh = ctx.work / "empty-cache" if phase == "compile" else None  # a real compilation to interrupt
    trainer = Trainer(ctx, overrides, tag=tag, cache=fresh)
    reached, seen = PHASES[phase], {}
    poll = 0.001 if phase in SAVE_PHASES else 0.01
    deadline = time.monotonic() + RUN_LIMIT_S
    while not reached(ctx, trainer, seen):
        if trainer.proc.poll() is not None or time.monotonic() > deadline:
            return trainer.finish(5, missed=phase)
        time.sleep(poll)
    if phase == "compile" and records(ctx.run_dir):
        return trainer.finish(RUN_LIMIT_S, missed="compile (the first step had finished)")
    trainer.proc.send_signal(sig)
    return trainer.finish(120)


# ----------------------------------------------------------------------------- actions


def interrupt_then_rerun(phase: str, sig: int, ctx: Ctx) -> Observed:
    first = signal_at(ctx, phase, sig, CURVE)
    facts = {"complete_before_rerun": complete_steps(ctx.ckpts), "records_before_rerun": records(ctx.run_dir)}
    rerun = run_trainer(ctx, CURVE, tag="rerun")
    return Observed((first, rerun), facts)


def copy_seed(ctx: Ctx) -> None:
    shutil.copytree(ctx.shared.seed_run, ctx.run_dir, symlinks=True)


def damage_then_rerun(damage: Callable[[Ctx], dict], extra: Sequence[str], ctx: Ctx) -> Observed:
    copy_seed(ctx)
    facts = damage(ctx) or {}
    facts["complete_before_rerun"] = complete_steps(ctx.ckpts)
    facts["records_before_rerun"] = records(ctx.run_dir)
    rerun = run_trainer(ctx, CURVE + tuple(extra), tag="rerun", limit_s=DAMAGE_LIMIT_S)
    facts.update(victim_after(facts))
    return Observed((rerun,), facts)


def single_run(overrides: Sequence[str], ctx: Ctx, *, files: dict[str, bytes] | None = None,
               config: str = QUICKSTART, limit_s: float = RUN_LIMIT_S, bounded: bool = False,
               named: bool = True) -> Observed:
    """One run; ``files`` written into the case directory first (``{work}`` in an override or
    in ``config`` names that directory)."""
    for name, content in (files or {}).items():
        path = ctx.work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    overrides = [o.replace("{work}", str(ctx.work)) for o in overrides]
    ran = run_trainer(ctx, overrides, tag="run", config=config.replace("{work}", str(ctx.work)), limit_s=limit_s,
                      limit_memory=bounded, named=named)
    return Observed((ran,), {"records": records(ctx.run_dir), "complete": complete_steps(ctx.ckpts)})


# ----------------------------------------------------------------------------- damage


def _newest(ctx: Ctx) -> Path:
    return ctx.ckpts / str(SEED_STEPS)


def _largest_array_file(step_dir: Path) -> Path:
    files = [Path(p) for p in glob.glob(str(step_dir / "state" / "**" / "d" / "*"), recursive=True)]
    return max(files, key=lambda p: p.stat().st_size)


def truncate_array(ctx: Ctx) -> dict:
    path = _largest_array_file(_newest(ctx))
    with open(path, "r+b") as fh:
        fh.truncate(path.stat().st_size // 2)
    return {}


def flip_array_byte(ctx: Ctx) -> dict:
    path = _largest_array_file(_newest(ctx))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    return {}


def delete_integrity(ctx: Ctx) -> dict:
    shutil.rmtree(_newest(ctx) / "integrity")
    return {}


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    value = json.loads(path.read_text())
    edit(value)
    path.write_text(json.dumps(value))


def edit_data_position(ctx: Ctx) -> dict:
    _edit_json(_newest(ctx) / "data" / "metadata", lambda v: v.update(next_index=10 ** 12))
    return {}


def edit_saved_config(ctx: Ctx) -> dict:
    _edit_json(_newest(ctx) / "config" / "metadata", lambda v: v["optim"].update(lr=0.5))
    return {}


def only_temporary_checkpoints(ctx: Ctx) -> dict:
    for step in complete_steps(ctx.ckpts):
        os.rename(ctx.ckpts / str(step), ctx.ckpts / f"{step}.orbax-checkpoint-tmp-1700000000")
    return {}


def checkpoints_is_a_file(ctx: Ctx) -> dict:
    shutil.rmtree(ctx.ckpts)
    ctx.ckpts.write_text("not a directory\n")
    return {}


def _victim(ctx: Ctx, content: bytes) -> dict:
    victim = ctx.work / "victim.txt"
    victim.write_bytes(content)
    os.symlink(victim, ctx.run_dir / "run.lock")
    return {"victim": str(victim), "victim_content": content.decode()}


def lock_symlink_to_text_file(ctx: Ctx) -> dict:
    return _victim(ctx, b"a file that belongs to someone else\n")


def victim_after(facts: dict) -> dict:
    if "victim" not in facts:
        return {}
    path = Path(facts["victim"])
    return {"victim_after": path.read_text(errors="replace") if path.exists() else None}


def _write_lock(ctx: Ctx, text: str) -> dict:
    """A lock file whose holder stopped beating ten minutes ago (past run.lock_stale_s's 300 s
    default): a node lost that long before its job is requeued."""
    path = ctx.run_dir / "run.lock"
    path.write_text(text)
    past = time.time() - 600
    os.utime(path, (past, past))
    return {}


def stale_lock_other_host(ctx: Ctx) -> dict:
    return _write_lock(ctx, json.dumps({"host": "node-that-died", "pid": 4242, "started": time.time() - 86400}))


def lock_with_garbage(ctx: Ctx) -> dict:
    return _write_lock(ctx, "\x00\x01garbage{")


# ----------------------------------------------------------------------------- expectations


def _worst(findings: list[Finding]) -> str:
    return max((f.klass for f in findings), key=lambda k: SEVERITY[k], default="clean")


def ending(ran: Ran, expected: set[int], what: str) -> list[Finding]:
    """The way a process ended: within its limit, a documented exit code among ``expected``, no traceback."""
    if ran.timed_out:
        return [Finding("unclear", f"{what}: no end within {ran.seconds:.0f} s (killed)")]
    found = []
    if ran.rc < 0 and 128 - ran.rc in expected:
        pass  # died by the signal it was sent: a shell and a scheduler read 128 + signal
    elif ran.rc < 0:
        found.append(Finding("unclear", f"{what}: died by {signal.Signals(-ran.rc).name} "
                                        f"(a shell's exit {128 - ran.rc}, undocumented)"))
    elif ran.rc not in DOCUMENTED_EXITS:
        found.append(Finding("unclear", f"{what}: exit {ran.rc}, undocumented"))
    elif ran.rc not in expected:
        found.append(Finding("unclear", f"{what}: exit {ran.rc}, expected {sorted(expected)}"))
    if "Traceback (most recent call last)" in ran.text:
        found.append(Finding("unclear", f"{what}: a traceback ({_last_exception(ran.text)})"))
    return found


def _last_exception(text: str) -> str:
    lines = [line for line in text.splitlines() if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    return (lines[-1] if lines else "?")[:120]


def on_the_curve(ctx: Ctx, recs: list[dict]) -> list[Finding]:
    """Every logged loss equals the uninterrupted reference run's at that step, exactly."""
    ref = ctx.shared.reference_loss()
    off = [r["step"] for r in recs if "step" in r and ref.get(r["step"]) != r.get("loss")]
    if off:
        return [Finding("data loss", f"logged loss differs from the uninterrupted run at steps {off[:6]}")]
    if not recs or recs[-1].get("step") != STEPS:
        return [Finding("data loss", f"metrics.jsonl does not end at step {STEPS}")]
    return []


def resumed_from_newest(ctx: Ctx, rerun: Ran, complete: list[int]) -> list[Finding]:
    if not complete:
        return []
    newest = complete[-1]
    if f"resumed from {ctx.ckpts}/{newest}" not in rerun.out:
        said = re.search(r"resumed from \S+", rerun.out)
        return [Finding("data loss", f"checkpoint {newest} was complete; the rerun "
                                     f"{said.group(0) if said else 'did not resume'}")]
    return []


def records_kept(recs_before: list[dict], complete: list[int]) -> list[Finding]:
    """Each step a complete checkpoint holds has its metrics record."""
    logged = {r.get("step") for r in recs_before}
    missing = [s for s in range(1, (complete[-1] if complete else 0) + 1) if s not in logged]
    if missing:
        return [Finding("data loss", f"metrics records of steps {missing} lost (checkpoint {complete[-1]} "
                                     f"holds them)")]
    return []


def stop_line(ran: Ran, sig: int, phase: str, ctx: Ctx, complete: list[int], recs: list[dict]) -> list[Finding]:
    """A signal's promise: one stop line naming it; mid-run, a checkpoint of the running step."""
    name = signal.Signals(sig).name
    lines = [line for line in ran.text.splitlines() if f"({name})" in line and "again" not in line]
    if ran.rc not in (128 + sig, -sig):
        return []  # the exit code finding says it already
    if phase == "imports" and not lines:
        return []  # stopped before the trainer had anything to say: the exit code says it
    if not lines:
        return [Finding("unclear", f"no stop line naming {name}"
                                   + (f" (died by {name}'s default action)" if ran.rc < 0 else ""))]
    if len(lines) != 1:
        return [Finding("unclear", f"{len(lines)} stop lines naming {name}")]
    if phase in ("imports", "start-up", "compile"):
        return [] if "nothing was saved" in lines[0] else [Finding("unclear", f"stop line: {lines[0][:120]}")]
    last = max((r.get("step", 0) for r in recs), default=0)
    if "checkpoint saved" not in lines[0] or not complete or complete[-1] != last:
        return [Finding("data loss", f"no complete checkpoint of the last logged step {last} "
                                     f"(complete: {complete}); stop line: {lines[0][:100]}")]
    return []


def expect_interrupt(sig: int, phase: str, ctx: Ctx, seen: Observed) -> list[Finding]:
    first, rerun = seen.runs
    if first.missed:
        return [Finding("unclear", f"harness: phase {phase} not reached (exit {first.rc}); case not exercised")]
    complete, recs = seen.facts["complete_before_rerun"], seen.facts["records_before_rerun"]
    found = []
    if sig != signal.SIGKILL:
        found += ending(first, {128 + sig}, "signalled run")
        found += stop_line(first, sig, phase, ctx, complete, recs)
    found += ending(rerun, {0}, "rerun")
    found += resumed_from_newest(ctx, rerun, complete)
    found += records_kept(recs, complete)
    found += on_the_curve(ctx, records(ctx.run_dir))
    return found


def expect_fallback(bad: int, to: int, ctx: Ctx, seen: Observed) -> list[Finding]:
    """Damage caught: a warning naming checkpoint ``bad``, a resume from ``to``, the curve kept."""
    (rerun,) = seen.runs
    found = ending(rerun, {0}, "rerun")
    named = [line for line in rerun.text.splitlines() if f"{ctx.ckpts}/{bad}" in line and "resumed from" not in line]
    resumed = re.search(r"resumed from \S+/(\d+)", rerun.out)
    if resumed and int(resumed.group(1)) == bad and not named:
        found.append(Finding("silent", f"the damaged checkpoint {bad} was restored without a word"))
    elif not named and rerun.rc == 0:
        found.append(Finding("silent", f"no line names the damaged checkpoint {bad}"))
    if rerun.rc == 0 and not (resumed and int(resumed.group(1)) in (to, bad)):
        found.append(Finding("data loss", f"expected a resume from {to}: "
                                          f"{resumed.group(0) if resumed else 'no resume'}"))
    if rerun.rc == 0:
        found += on_the_curve(ctx, records(ctx.run_dir))
    elif rerun.rc == 2 and len(rerun.error_lines()) == 1:
        found.append(Finding("unclear", f"refused instead of falling back to {to}: {rerun.error_lines()[0][:140]}"))
    return found


def expect_warned_or_refused(bad: int, ctx: Ctx, seen: Observed) -> list[Finding]:
    """A checkpoint that cannot be checked: a warning naming it, or a fall-back."""
    (rerun,) = seen.runs
    found = ending(rerun, {0}, "rerun")
    if rerun.rc == 0 and not [l for l in rerun.text.splitlines()
                              if f"{ctx.ckpts}/{bad}" in l and "resumed from" not in l]:
        found.append(Finding("silent", f"checkpoint {bad} restored unchecked without a warning"))
    if rerun.rc == 0:
        found += on_the_curve(ctx, records(ctx.run_dir))
    return found


def expect_one_line_refusal(hint: str, ctx: Ctx, seen: Observed) -> list[Finding]:
    """Exit 2 with exactly one ``error:`` line naming ``hint``; nothing trained."""
    (ran,) = seen.runs
    if ran.rc == 0:
        return [Finding("silent", f"accepted; ran {len(seen.facts.get('records') or records(ctx.run_dir))} steps")]
    found = ending(ran, {2}, "run")
    lines = ran.error_lines()
    if ran.rc == 2 and not found:
        if len(lines) != 1:
            found.append(Finding("unclear", f"{len(lines)} error lines"))
        elif len([l for l in ran.err.splitlines() if l.strip()]) != len(
                [l for l in ran.err.splitlines() if l.startswith(("error:", "warning:"))]):
            found.append(Finding("unclear", "the message continues over several lines"))
        elif hint and hint not in lines[0]:
            found.append(Finding("unclear", f"the line does not name {hint!r}: {lines[0][:140]}"))
    if ran.seconds > INPUT_LIMIT_S and not ran.timed_out:
        found.append(Finding("unclear", f"took {ran.seconds:.0f} s"))
    return found


def expect_bounded(hint: str, ctx: Ctx, seen: Observed) -> list[Finding]:
    """Large but legal input: accepted, or refused in one line naming ``hint`` (the real reason),
    within the time limit."""
    (ran,) = seen.runs
    return [] if ran.rc == 0 and ran.seconds <= INPUT_LIMIT_S else expect_one_line_refusal(hint, ctx, seen)


def _nothing_lost(ctx: Ctx, seen: Observed) -> list[Finding]:
    before = seen.facts["complete_before_rerun"]
    aside = [int(n.split(".")[0]) for n in os.listdir(ctx.ckpts) if ".unreadable" in n] if ctx.ckpts.is_dir() else []
    gone = [s for s in before if s not in complete_steps(ctx.ckpts) and s not in aside]
    recs_before = len(seen.facts["records_before_rerun"])
    found = [Finding("data loss", f"checkpoints {gone} gone")] if gone else []
    if len(records(ctx.run_dir)) < recs_before:
        found.append(Finding("data loss", "metrics records lost"))
    return found


def expect_lock_victim_kept(ctx: Ctx, seen: Observed) -> list[Finding]:
    """A ``run.lock`` symlink: the file it points to is never written; one line or a run."""
    (rerun,) = seen.runs
    found = []
    if seen.facts["victim_after"] != seen.facts["victim_content"]:
        found.append(Finding("data loss", f"the file run.lock points to was "
                                          f"{'deleted' if seen.facts['victim_after'] is None else 'overwritten'}"))
    if rerun.rc == 0:
        found += on_the_curve(ctx, records(ctx.run_dir))
    else:
        found += expect_one_line_refusal("run.lock", ctx, seen)
    return found


def expect_lock_taken_over(ctx: Ctx, seen: Observed) -> list[Finding]:
    """A lock left by a dead run (another host, garbage, a dead pid): taken over in one line."""
    (rerun,) = seen.runs
    found = ending(rerun, {0}, "rerun")
    if rerun.rc == 2 and rerun.error_lines():
        found.append(Finding("unclear", f"stranded: {rerun.error_lines()[0][:140]}"))
    if rerun.rc == 0:
        if not [l for l in rerun.text.splitlines() if "run.lock" in l or "lock" in l.lower()]:
            found.append(Finding("silent", "lock taken over without a line"))
        found += on_the_curve(ctx, records(ctx.run_dir))
    return found


def expect_temporary_only_said(ctx: Ctx, seen: Observed) -> list[Finding]:
    """Only unfinished checkpoints: one line saying so, no second run appended from step 1."""
    (rerun,) = seen.runs
    text = rerun.text.replace(str(ctx.work), "<case>")  # the case's own name says "temporary"
    said = [l for l in text.splitlines() if re.search(r"unfinished|temporary|orbax-checkpoint-tmp", l)]
    found = ending(rerun, {0, 2}, "rerun")
    steps = [r.get("step") for r in records(ctx.run_dir)]
    if rerun.rc == 0 and not said:
        found.append(Finding("silent", f"started over from step 1 without a word "
                                       f"(metrics.jsonl holds step 1 {steps.count(1)} times)"))
    found += _nothing_lost(ctx, Observed(seen.runs, {**seen.facts, "complete_before_rerun": []}))
    return found


def expect_nan(length: int, every: int, ctx: Ctx, seen: Observed) -> list[Finding]:
    """Below the limit: skipped, finished. At or above it with a checkpoint before the streak:
    a rollback (the fault is tied to step numbers, so it comes back and, with max_rollbacks=1,
    stops the run with exit 3 after it). With none possible: exit 3 and one line saying so."""
    (ran,) = seen.runs
    if length < LIMIT:
        found = ending(ran, {0}, "run")
        if ran.rc == 0 and (not seen.facts["records"] or seen.facts["records"][-1].get("step") != NAN_STEPS):
            found.append(Finding("data loss", "metrics.jsonl does not reach the last step"))
        return found
    found = ending(ran, {3}, "run")
    possible = every > 0 and every < STREAK_AT
    rolled = "rollback 1/1:" in ran.text
    if possible and not rolled:
        why = next((l for l in ran.text.splitlines() if "no checkpoint before" in l), "no rollback line")
        found.append(Finding("data loss", f"no rollback: the pre-streak checkpoint was rotated out ({why[:110]})"))
    if not possible and "no checkpoint before step" not in ran.text:
        found.append(Finding("unclear", "the stop does not say there is no checkpoint before the streak"))
    return found


# ----------------------------------------------------------------------------- the cases


def _p(fn, *args, **kwargs):
    return functools.partial(fn, *args, **kwargs)


def kill_and_signal_cases() -> list[Case]:
    """kill -9 at every phase after the imports; SIGINT during the imports; SIGTERM,
    SIGINT and SIGHUP at start-up, while compiling, mid-run; SIGTERM during the final save (the
    documented wait for it)."""
    plan = [(signal.SIGKILL, phase) for phase in PHASES if phase != "imports"]
    plan.append((signal.SIGINT, "imports"))  # Ctrl-C right after the command
    plan += [(sig, phase) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
             for phase in ("start-up", "compile", "mid-run")]
    plan.append((signal.SIGTERM, "final-save"))
    cases = []
    for sig, phase in plan:
        family = "kill" if sig == signal.SIGKILL else "signal"
        cases.append(Case(f"{signal.Signals(sig).name.lower()}-{phase}", family,
                          _p(interrupt_then_rerun, phase, sig), _p(expect_interrupt, sig, phase),
                          what=f"{signal.Signals(sig).name} during {phase}, then a rerun"))
    return cases


def damage_cases() -> list[Case]:
    v, n = ("checkpoint.verify=true",), ("checkpoint.verify=false",)
    fall = _p(expect_fallback, SEED_STEPS, SEED_STEPS - 2)
    table = [
        ("truncated-array", truncate_array, n, fall, "largest array file of checkpoint 6 cut in half"),
        ("flipped-byte-verify", flip_array_byte, v, fall, "the same, checkpoint.verify=true"),
        ("integrity-deleted", delete_integrity, n, _p(expect_warned_or_refused, SEED_STEPS),
         "checkpoint 6's integrity item deleted"),
        ("integrity-deleted-verify", delete_integrity, v, fall, "the same, checkpoint.verify=true"),
        ("data-position-edited", edit_data_position, n, fall, "next_index set to 10**12"),
        ("saved-config-edited", edit_saved_config, n, fall, "optim.lr in checkpoints/6/config edited"),
        ("only-temporary-checkpoints", only_temporary_checkpoints, n, expect_temporary_only_said,
         "every checkpoint renamed to N.orbax-checkpoint-tmp-*"),
        ("checkpoints-is-a-file", checkpoints_is_a_file, n, _p(expect_one_line_refusal, "checkpoints"),
         "checkpoints/ replaced by a regular file"),
        ("lock-symlink-text-file", lock_symlink_to_text_file, n, expect_lock_victim_kept,
         "run.lock a symlink to another file"),
        ("stale-lock-other-host", stale_lock_other_host, n, expect_lock_taken_over,
         "run.lock of a dead run on another host"),
        ("lock-garbage", lock_with_garbage, n, expect_lock_taken_over, "run.lock holding garbage"),
    ]
    return [Case(name, "damage", _p(damage_then_rerun, damage, extra), expect, what=what)
            for name, damage, extra, expect, what in table]


def nan_cases() -> list[Case]:
    """Streaks one short of, at and one over the limit, with every in {1, 2} and keep in {1, 3};
    and one saving only at the end (nothing to roll back to)."""
    cases = []
    for every in (1, 2):
        for keep in (1, 3):
            for length in (LIMIT - 1, LIMIT, LIMIT + 1):
                steps = list(range(STREAK_AT, STREAK_AT + length))
                overrides = TINY + (f"train.steps={NAN_STEPS}", f"checkpoint.every={every}", f"checkpoint.keep={keep}",
                                    f"resilience.fault.nonfinite_at_steps={steps}".replace(" ", ""),
                                    "resilience.max_rollbacks=1")
                cases.append(Case(f"nan-{length}-every{every}-keep{keep}", "nan", _p(single_run, overrides),
                                  _p(expect_nan, length, every),
                                  what=f"{length} non-finite steps from {STREAK_AT}, every={every}, keep={keep}"))
    no_ckpt = TINY + (f"train.steps={NAN_STEPS}", "checkpoint.every=0", f"resilience.fault.nonfinite_at_steps="
                      f"{list(range(STREAK_AT, STREAK_AT + LIMIT))}".replace(" ", ""))
    cases.append(Case("nan-10-every0", "nan", _p(single_run, no_ckpt), _p(expect_nan, LIMIT, 0),
                      what="10 non-finite steps, checkpoint.every=0 (only the final save: nothing to roll back to)"))
    return cases


def _yaml(body: str) -> bytes:
    return body.encode()


def _config_case(name: str, overrides: Sequence[str], hint: str, what: str, files: dict | None = None,
                 config: str = QUICKSTART, family: str = "config", steps: bool = True, named: bool = True,
                 expect: Callable = expect_one_line_refusal) -> Case:
    """A run that must be refused in one line naming ``hint`` (``steps``: with train.steps=3)."""
    action = _p(single_run, TINY + (("train.steps=3",) if steps else ()) + tuple(overrides), files=files,
                config=config, limit_s=INPUT_LIMIT_S, bounded=True, named=named)
    return Case(name, family, action, _p(expect, hint), what=what)


def config_cases() -> list[Case]:
    digits = "9" * 5000
    big_list = "[" + ",".join(str(i) for i in range(1, 100_000)) + "]"  # ~590 KB
    include = lambda target: {"c.yaml": _yaml(f"include: [{target}]\n")}  # noqa: E731
    return [
        _config_case("unknown-key", ["model.d_modle=64"], "model.d_modle", "a misspelt key"),
        _config_case("sexagesimal-steps", ["train.steps=1:30"], "train.steps", "train.steps=1:30 (YAML 1.1 base 60)"),
        _config_case("sexagesimal-in-file", [], "train.steps", "train: {steps: 1:30} in a file",
                     files={"c.yaml": _yaml("train:\n  steps: 1:30\n")}, config="{work}/c.yaml", steps=False),
        _config_case("duplicate-key", [], "steps", "train.steps twice in one mapping",
                     files={"c.yaml": _yaml("train:\n  steps: 3\n  steps: 5\n")}, config="{work}/c.yaml"),
        _config_case("duplicate-section", [], "train", "the train section twice",
                     files={"c.yaml": _yaml("train:\n  steps: 3\ntrain:\n  log_every: 1\n")}, config="{work}/c.yaml"),
        _config_case("5000-digit-int", [f"train.steps={digits}"], "train.steps", "an integer of 5000 digits"),
        _config_case("include-dev-zero", [], "/dev/zero", "include: [/dev/zero]", files=include("/dev/zero"),
                     config="{work}/c.yaml"),
        _config_case("nul-in-name", [], "run.name", "NUL in run.name (from a file)",
                     files={"c.yaml": _yaml('run:\n  name: "a\\0b"\n')}, config="{work}/c.yaml", named=False),
        _config_case("lr-inf", ["optim.lr=inf"], "optim.lr", "optim.lr=inf"),
        _config_case("slow-seconds-1e300", ["resilience.fault.slow_process=0", "resilience.fault.slow_seconds=1e300"],
                     "slow_seconds", "resilience.fault.slow_seconds=1e300"),
        _config_case("list-override-127kb", ["resilience.fault.nonfinite_at_steps=" + big_list[:127_000].rsplit(",", 1)[0]
                                             + "]"], "nonfinite_at_steps", "a 127 KB list override (argv's limit)",
                     expect=expect_bounded),
        _config_case("list-in-file-600kb", [], "c.yaml", "a 590 KB list in a config file (named by file and line)",
                     files={"c.yaml": _yaml(f"resilience:\n  fault:\n    nonfinite_at_steps: {big_list}\n")},
                     config="{work}/c.yaml", expect=expect_bounded),
    ]


def data_cases() -> list[Case]:
    def text(name: str, files: dict, hint: str, what: str, source: str = "text") -> Case:
        path = "{work}/" + name
        return _config_case(f"data-{what.split(':')[0]}", [f"data.source={source}", f"data.paths=[{path}]"], hint,
                            what, files=files, family="data")

    rand = bytes((i * 1103515245 + 12345) >> 16 & 0xFF for i in range(64 << 10))
    return [
        text("bad.txt", {"bad.txt": b"good line\nbad \xff\xfe bytes\n" * 50}, "bad.txt", "invalid-utf8: in a text file"),
        text("bad.jsonl", {"bad.jsonl": b'{"text": "fine"}\n{"text": "\\ud800 lone"}\n' * 50}, "bad.jsonl",
             "lone-surrogate: escaped in JSONL", source="jsonl"),
        text("bad-utf8.jsonl", {"bad-utf8.jsonl": b'{"text": "fine"}\n{"text": "\xff\xfe"}\n' * 50}, "bad-utf8.jsonl",
             "jsonl-invalid-utf8: raw bytes in JSONL", source="jsonl"),
        text("empty.txt", {"empty.txt": b""}, "empty.txt", "empty-file: no text at all"),
        text("random.bin", {"random.bin": rand}, "random.bin", "random-bytes: 64 KB of them"),
        text("dir.txt", {"dir.txt/inner": b""}, "dir.txt", "directory: in place of a file"),
    ]


def all_cases() -> list[Case]:
    return kill_and_signal_cases() + damage_cases() + nan_cases() + config_cases() + data_cases()


# ----------------------------------------------------------------------------- running the matrix


def run_case(case: Case, shared: Shared) -> Result:
    ctx = Ctx(shared.root / case.name, shared)
    ctx.work.mkdir(parents=True)
    started = time.monotonic()
    try:
        case.setup(ctx)
        seen = case.action(ctx)
        findings = case.expect(ctx, seen)
        codes = tuple(r.rc for r in seen.runs)
    except Exception as error:  # noqa: BLE001 - a harness failure is reported, not fatal to the matrix
        findings, codes = [Finding("unclear", f"harness error: {type(error).__name__}: {error}")], ()
    return Result(case.name, case.family, _worst(findings), tuple(f"{f.klass}: {f.note}" for f in findings),
                  round(time.monotonic() - started, 1), codes, case.what)


def prepare(root: Path, seed: bool = True) -> Shared:
    """The uninterrupted reference run (its losses) and, with ``seed``, the finished run that
    damage cases copy."""
    cache = root / "jax-cache"
    cache.mkdir(parents=True)
    draft = Shared(root, cache, (), root / "seed" / RUN)
    ref_ctx = Ctx(root / "reference", draft)
    ref_ctx.work.mkdir()
    runs = [("reference", run_trainer(ref_ctx, CURVE, tag="run"))]  # fills the compilation cache first
    if seed:
        seed_ctx = Ctx(root / "seed", draft)
        seed_ctx.work.mkdir()
        runs.append(("seed", run_trainer(seed_ctx, SEED, tag="run")))
    for what, ran in runs:
        if ran.rc != 0:
            raise SystemExit(f"error: the {what} run failed (exit {ran.rc}): {ran.text[-2000:]}")
    reference = tuple((r["step"], r["loss"]) for r in records(ref_ctx.run_dir))
    return dataclasses.replace(draft, reference=reference)


def run_matrix(cases: Sequence[Case], shared: Shared, workers: int, progress: Callable[[Result], None]
               ) -> list[Result]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_case, case, shared) for case in cases]
        results = []
        for future in concurrent.futures.as_completed(futures):
            results.append(future.result())
            progress(results[-1])
    order = {case.name: i for i, case in enumerate(cases)}
    return sorted(results, key=lambda r: order[r.name])


def counts(results: Sequence[Result]) -> dict[str, dict[str, int]]:
    """Per family and in total: cases and each class."""
    table: dict[str, dict[str, int]] = {}
    for r in results:
        for key in (r.family, "total"):
            row = table.setdefault(key, {"cases": 0, **{k: 0 for k in CLASSES}})
            row["cases"] += 1
            row[r.klass] += 1
    return table


def markdown(results: Sequence[Result], date: str, wall_s: float) -> str:
    table = counts(results)
    lines = [f"CPU, 2 cores, {date}, {wall_s / 60:.1f} min:", "",
             "| family | cases | clean | unclear | data loss | silent |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for family in [f for f in ("kill", "signal", "damage", "nan", "config", "data") if f in table] + ["total"]:
        row = table[family]
        name = f"**{family}**" if family == "total" else family
        lines.append(f"| {name} | {row['cases']} | " + " | ".join(str(row[k]) for k in CLASSES) + " |")
    return "\n".join(lines)


def text_table(results: Sequence[Result]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'case':<{width}}  {'family':<7} {'class':<9} {'s':>6}  exit   notes"]
    for r in results:
        codes = ",".join(str(c) for c in r.exit_codes)
        lines.append(f"{r.name:<{width}}  {r.family:<7} {r.klass:<9} {r.seconds:>6.1f}  {codes:<6} "
                     + " | ".join(r.notes))
    return "\n".join(lines)


def select(cases: Sequence[Case], only: str | None) -> list[Case]:
    """The cases whose name or family contains ``only`` (all of them without it)."""
    return [c for c in cases if not only or only in c.name or only == c.family]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="only the cases whose name contains this, or of this family "
                                       "(kill signal damage nan config data)")
    parser.add_argument("--workers", type=int, default=2, help="cases at a time")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--markdown", action="store_true", help="print the counts as a markdown table")
    parser.add_argument("--keep", help="keep every case's directory under this one (default: a removed temp dir)")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    cases = select(all_cases(), args.only)
    if args.list:
        print("\n".join(f"{c.family:<7} {c.name:<32} {c.what}" for c in cases))
        return 0
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="maxfp4-adversarial-"))
    started = time.monotonic()
    try:
        shared = prepare(root, seed=any(c.family == "damage" for c in cases))
        results = run_matrix(cases, shared, args.workers,
                             lambda r: print(f"{r.klass:<9} {r.name} ({r.seconds:.0f} s)", flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    wall = time.monotonic() - started
    date = datetime.date.today().isoformat()
    print(text_table(results))
    total = counts(results)["total"]
    print(f"{total['cases']} cases: " + ", ".join(f"{total[k]} {k}" for k in CLASSES) + f"; {wall:.0f} s")
    if args.markdown:
        print(markdown(results, date, wall))
    if args.json:
        Path(args.json).write_text(json.dumps({"date": date, "wall_s": round(wall, 1), "counts": counts(results),
                                               "cases": [dataclasses.asdict(r) for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
