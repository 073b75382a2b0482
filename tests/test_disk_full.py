"""Full and read-only file systems, for real: each test mounts a small tmpfs (the tests run as
root here; where mounting is not permitted they are skipped, saying so, since a directory
without a size limit cannot return ENOSPC). Preflight wants room for ``checkpoint.keep + 1``
checkpoints; a disk filled from outside mid-run ends in one line with the previous checkpoint
intact; a crash report that cannot be written leaves no temporary file; a read-only output
directory is one line and exit code 2."""

import errno
import json
import os
import subprocess
import sys
import time

import pytest

from maxfp4.reliability.crash import write_crash_report
from maxfp4.reliability.preflight import check_output, checkpoint_bytes, state_sizes
from tests.conftest import cpu_env
from tests.test_preemption import ARGS, REPO

CONFIG = os.path.join(REPO, "configs", "quickstart.yaml")


@pytest.fixture
def small_fs(tmp_path):
    """``mount(size_mb, read_only=False)`` -> a fresh tmpfs directory, unmounted afterwards."""
    mounts = []

    def mount(size_mb: float, read_only: bool = False):
        path = tmp_path / f"fs{len(mounts)}"
        path.mkdir()
        opts = f"size={int(size_mb * 1024)}k" + (",ro" if read_only else "")
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()}): a real small file system is needed")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(directory) -> None:
    """Take every free byte, as another job writing to the same disk would."""
    with open(os.path.join(directory, "filler"), "wb", buffering=0) as fh:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    fh.write(b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC


def test_preflight_wants_room_for_keep_plus_one_checkpoints(small_fs, tiny_cfg):
    n_params, prec = state_sizes(tiny_cfg())
    one = checkpoint_bytes(n_params, prec)
    disk = small_fs(2.5 * one / 2**20)  # room for two checkpoints, not four
    fits = check_output(tiny_cfg(f"run.output_dir={disk}", "checkpoint.keep=1"), n_params, prec)
    assert fits.ok, fits.detail
    full = check_output(tiny_cfg(f"run.output_dir={disk}", "checkpoint.keep=3"), n_params, prec)
    assert full.ok is False
    assert "checkpoint.keep=3 + 1 checkpoints" in full.detail and str(disk) in full.detail


def test_crash_report_on_a_full_disk_leaves_no_temporary_file(small_fs):
    disk = small_fs(1)
    _fill(disk)
    with pytest.raises(OSError) as info:
        write_crash_report(str(disk), RuntimeError("boom"), step=3, config={"x": "y" * 10000}, last_metrics=None)
    assert info.value.errno == errno.ENOSPC
    assert sorted(os.listdir(disk)) == ["filler"]  # no crash.json, no 0-byte crash.json.tmp


def test_disk_filled_during_the_run_ends_in_one_line_with_the_previous_checkpoint_intact(small_fs, tmp_path):
    disk = small_fs(24)
    args = [*ARGS, f"run.output_dir={disk}", "run.name=full", "train.steps=1000", "checkpoint.every=2",
            "checkpoint.keep=1", "resilience.fault.slow_process=0", "resilience.fault.slow_seconds=0.2"]
    proc = subprocess.Popen([sys.executable, "-m", "maxfp4.train", CONFIG, *args], env=cpu_env(1),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ckpts = disk / "full" / "checkpoints"
    deadline = time.time() + 240
    while not (ckpts / "2" / "commit_success.txt").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    _fill(disk)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out + err, err[-3000:]
    assert lines[0].startswith(f"error: {disk / 'full'}: No space left on device at step ")
    newest = sorted(int(n) for n in os.listdir(ckpts) if n.isdigit())
    assert newest and f"the newest complete checkpoint is {ckpts / str(newest[-1])}, intact" in lines[0]
    assert not [n for n in os.listdir(ckpts) if "tmp" in n]  # the failed save's partial directory is gone
    assert not (disk / "full" / "crash.json.tmp").exists() and not (disk / "full" / "run.lock").exists()
    if (disk / "full" / "crash.json").exists():
        assert "No space left on device" in json.loads((disk / "full" / "crash.json").read_text())["traceback"]
    # The checkpoint left behind restores: after space is freed, a rerun resumes from it.
    os.remove(disk / "filler")
    again = subprocess.run([sys.executable, "-m", "maxfp4.train", CONFIG, *args[:-5], "train.steps=" + str(newest[-1] + 1),
                            "checkpoint.keep=1"], env=cpu_env(1), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {ckpts / str(newest[-1])}" in again.stdout


def test_read_only_output_with_preflight_off_is_one_line(small_fs):
    disk = small_fs(1, read_only=True)
    out = subprocess.run([sys.executable, "-m", "maxfp4.train", CONFIG, *ARGS, f"run.output_dir={disk}",
                          "run.name=ro", "train.steps=2", "resilience.preflight=false"],
                         env=cpu_env(1), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: run directory {disk / 'ro'}: cannot be written"), out.stderr
    assert "Read-only file system" in lines[0] and "run.output_dir" in lines[0]


# ----------------------------------------------------------------------------- maxfp4.files


def test_an_atomic_file_replaces_the_old_one_only_when_its_block_ends_cleanly(tmp_path):
    from maxfp4.files import atomic_file, atomic_path, write_text_atomic

    path = str(tmp_path / "config.yaml")
    write_text_atomic(path, "old\n")
    with pytest.raises(OSError):
        with atomic_file(path) as fh:
            fh.write("half of a new one")
            raise OSError(28, "No space left on device")
    assert open(path).read() == "old\n" and os.listdir(tmp_path) == ["config.yaml"]  # no temporary left
    with atomic_file(path, "wb", fsync=True, unique=True) as fh:
        fh.write(b"new\n")
    assert open(path).read() == "new\n" and os.listdir(tmp_path) == ["config.yaml"]
    # Two writers at once get temporaries of their own; file_mode is set before the rename.
    with atomic_path(path, unique=True, file_mode=0o644) as a, atomic_path(path, unique=True) as b:
        assert a != b
        open(a, "w").write("a")
        open(b, "w").write("b")
    assert open(path).read() == "a" and os.stat(path).st_mode & 0o777 == 0o644


EFBIG_SCRIPT = """
import os, resource, signal, sys
from maxfp4.reliability.crash import crash_error
run_dir = sys.argv[1]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    with open(os.path.join(run_dir, "big.bin"), "wb") as fh:
        fh.write(bytes(2 << 20))
except OSError as error:
    print(crash_error(run_dir, error, step=7, config={}, last_metrics=None, say=print,
                      newest_checkpoint=lambda: os.path.join(run_dir, "checkpoints", "6"),
                      remove_partial_saves=lambda: []))
"""


def test_a_file_size_limit_is_named_as_such_not_as_a_full_disk(tmp_path):
    """A real EFBIG (a write past ``ulimit -f``): the line says the file is too large and how to
    lift the limit; freeing space would not help."""
    proc = subprocess.run([sys.executable, "-c", EFBIG_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=cpu_env(1, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == (
        f"{tmp_path}: File too large at step 7; the newest complete checkpoint is {tmp_path / 'checkpoints' / '6'}, "
        f"intact; raise the file size limit (ulimit -f) or use a file system that holds larger files and rerun to "
        f"resume; crash report {tmp_path / 'crash.json'}")
