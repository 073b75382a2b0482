"""Orbax checkpoints: a rerun with the same run name resumes exactly (parameters, optimizer,
FP8 scaling state, data position, RNG)."""

import io
import json
import os

from maxfp4.config import load_config
from maxfp4.train import train

BASE = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
        "model.vocab_size=512", "data.source=builtin", "data.seq_len=32", "data.global_batch=8",
        "train.log_every=1", "optim.warmup_steps=1", "optim.lr=3e-3", "optim.schedule_steps=6",
        "mesh.data=1", "precision.default=fp8_delayed", "precision.rules=[{classes: [mlp_down], recipe: nvfp4}]",
        "precision.recipes={fp8_delayed: {amax_history: 4}}"]


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return {r["step"]: r["loss"] for r in map(json.loads, fh)}


def test_resume_continues_exactly(tmp_path):
    import jax
    dev = jax.devices()[:1]
    full = load_config(None, BASE + [f"run.output_dir={tmp_path}", "run.name=full", "train.steps=6"])
    train(full, devices=dev, stream=io.StringIO())

    tok = [f"data.tokenizer={tmp_path / 'full' / 'tokenizer.model'}"]
    first = load_config(None, BASE + tok + [f"run.output_dir={tmp_path}", "run.name=split", "train.steps=3",
                                            "checkpoint.every=2", "checkpoint.keep=2"])
    train(first, devices=dev, stream=io.StringIO())
    ckpts = sorted(os.listdir(tmp_path / "split" / "checkpoints"))
    assert ckpts == ["2", "3"], ckpts  # every 2 steps and at the end
    out = io.StringIO()
    second = load_config(None, BASE + tok + [f"run.output_dir={tmp_path}", "run.name=split", "train.steps=6",
                                             "checkpoint.every=2", "checkpoint.keep=2"])
    recs = train(second, devices=dev, stream=out)
    assert [r["step"] for r in recs] == [4, 5, 6]
    a, b = _losses(tmp_path / "full"), _losses(tmp_path / "split")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]  # the rerun appended to the same metrics file
    for step in range(1, 7):
        # Same program, same inputs, same state: identical up to float32 noise of 1e-6.
        assert abs(a[step] - b[step]) <= 1e-6 * a[step], (step, a[step], b[step])
    assert sorted(os.listdir(tmp_path / "split" / "checkpoints")) == ["4", "6"]  # keep=2


# ----------------------------------------------------------------------------- config, mesh, damage
# One small run, trained once for the tests below (which copy it before changing anything):
# the tiny test model on 8 devices as fsdp=8, 3 steps, checkpoints at steps 1, 2 and 3.

import glob  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from maxfp4.checkpoint import CheckpointError, Checkpointer, read_params, refuse_changed_run, saved_config  # noqa: E402
from maxfp4.config import ConfigError  # noqa: E402
from maxfp4.parallel.mesh import make_mesh  # noqa: E402
from maxfp4.optim import make_optimizer  # noqa: E402
from maxfp4.train import init_state  # noqa: E402
from tests.conftest import TINY, cpu_env  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVED = TINY + ["run.name=base", "train.steps=3", "optim.schedule_steps=10", "checkpoint.every=1",
                "checkpoint.keep=5", "mesh.data=1", "mesh.fsdp=8"]


def _cfg(output_dir, *overrides):
    return load_config(None, SAVED + [f"run.output_dir={output_dir}", *overrides])


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    import jax
    out = tmp_path_factory.mktemp("saved")
    train(_cfg(out), devices=jax.devices()[:8], stream=io.StringIO())
    return out


def _copy(saved_run, dest):
    shutil.copytree(saved_run, dest)
    return dest


def _cpu_params(run_dir, step, cfg):
    """The parameters as saved, read onto one device (the reference for the other restores)."""
    import jax
    from maxfp4.model import get_model
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.eval_shape(lambda k: get_model(cfg.model).init_params(cfg.model, k), jax.random.key(0))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), shapes)
    return jax.tree.map(np.asarray, read_params(run_dir, step, abstract))


def _snapshot(directory):
    """Every file under ``directory`` with its size, mtime and bytes: to show nothing changed."""
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
        if os.path.isfile(path):
            st = os.stat(path)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, directory)] = (st.st_size, st.st_mtime_ns, fh.read())
    return out


def test_restore_onto_a_different_mesh_is_bitwise(saved_run):
    import jax
    cfg = _cfg(saved_run, "mesh.data=2", "mesh.fsdp=2")
    expected = _cpu_params(cfg.run_dir, 3, cfg)
    mesh = make_mesh(cfg.mesh, jax.devices()[:4])
    like, _ = init_state(cfg, mesh, make_optimizer(cfg))
    ck = Checkpointer(cfg.run_dir, cfg.checkpoint)
    assert ck.latest_step() == 3
    state, data_state = ck.restore(3, like)  # (restore, not restore_latest: the shared run stays as it is)
    ck.close()
    assert int(state.step) == 3 and data_state["next_index"] == 3
    w = state.params["blocks"]["w_qkv"]
    assert w.sharding.mesh.shape == {"data": 2, "pipeline": 1, "fsdp": 2, "context": 1, "expert": 1, "tensor": 1} and len(w.sharding.device_set) == 4
    assert not w.sharding.is_fully_replicated  # the embed axis really is split over fsdp=2
    got = jax.tree.map(np.asarray, state.params)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))
    # The optimizer moments came across too (not just re-initialised zeros).
    assert any(np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(state.opt_state) if x.ndim >= 2)


def test_rerun_refuses_math_changes_and_resumes_harmless_ones(saved_run, tmp_path):
    import jax
    run = _copy(saved_run, tmp_path / "out") / "base"
    before = _snapshot(run)
    env = cpu_env(8, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml"),
                           *SAVED, f"run.output_dir={tmp_path / 'out'}", "model.d_model=128", "optim.lr=1e-3"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = proc.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: "), proc.stderr
    assert "model.d_model: 64 -> 128" in errors[0] and "optim.lr: 0.0003 -> 0.001" in errors[0]
    assert os.path.join(str(run), "checkpoints", "3") in errors[0]
    assert _snapshot(run) == before  # checkpoints, metrics.jsonl, config.yaml: untouched

    # Step 3 again from checkpoint 2 with more steps (the schedule is pinned), other logging and
    # another mesh: the same math, so it resumes, and step 3's loss is the one the saving run had.
    shutil.rmtree(run / "checkpoints" / "3")
    recs = train(_cfg(tmp_path / "out", "train.steps=4", "train.log_every=7", "mesh.data=2", "mesh.fsdp=2"),
                 devices=jax.devices()[:4], stream=io.StringIO())
    assert [r["step"] for r in recs] == [3, 4]
    saved_loss = _losses(saved_run / "base")[3]
    assert np.isfinite(recs[0]["loss"]) and abs(recs[0]["loss"] - saved_loss) <= 1e-5 * saved_loss
    assert sorted(_losses(run)) == [1, 2, 3, 4]
    assert sorted(os.listdir(run / "checkpoints"), key=int) == ["1", "2", "3", "4"]


def test_unreadable_newest_checkpoint_falls_back_with_a_warning(saved_run, tmp_path):
    import jax
    run = _copy(saved_run, tmp_path / "out") / "base"
    cfg = _cfg(tmp_path / "out")
    # Truncate the array data files of step 3 (as a full disk or a partial copy would).
    data_files = glob.glob(str(run / "checkpoints" / "3" / "state" / "ocdbt.process_0" / "d" / "*"))
    assert data_files
    for path in data_files:
        os.truncate(path, os.path.getsize(path) // 2)
    like, _ = init_state(cfg, make_mesh(cfg.mesh, jax.devices()[:8]), make_optimizer(cfg))
    ck = Checkpointer(str(run), cfg.checkpoint)
    warnings = []
    step, state, data_state = ck.restore_latest(like, warn=warnings.append)
    assert step == 2 and int(state.step) == 2 and data_state["next_index"] == 2
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"checkpoint {run / 'checkpoints' / '3'} is unreadable (")
    assert "falling back to step 2" in warnings[0] and "\n" not in warnings[0]
    # Kept for inspection, and out of the way: the rerun's own save of step 3 succeeds.
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2", "3.unreadable"]
    ck.save(3, state, data_state, cfg.to_dict())
    ck.wait()
    assert ck.all_steps() == [1, 2, 3] and ck.restore(3, like)[1] == data_state

    # Nothing readable at all: one line naming the directory, and nothing moved (the fault could
    # be this process's rather than the files').
    for s in ("1", "2", "3"):
        shutil.rmtree(run / "checkpoints" / s / "state" / "ocdbt.process_0" / "d")
    ck.manager.reload()
    with pytest.raises(CheckpointError) as info:
        ck.restore_latest(like, warn=warnings.append)
    ck.close()
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{run / 'checkpoints'}: no readable checkpoint")
    assert all(f"{s} (" in message for s in "123") and len(warnings) == 1
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2", "3", "3.unreadable"]


KILL_SCRIPT = """
import os, signal, sys
from maxfp4.checkpoint import Checkpointer
from maxfp4.config import load_config
from maxfp4.parallel.mesh import make_mesh
from maxfp4.optim import make_optimizer
from maxfp4.train import init_state
cfg = load_config(None, sys.argv[1:])
state, _ = init_state(cfg, make_mesh(cfg.mesh), make_optimizer(cfg))
ck = Checkpointer(cfg.run_dir, cfg.checkpoint)
ck.save(1, state, {"step": 1, "global_batch": 8}, cfg.to_dict())
ck.wait()
ck.save(2, state, {"step": 2, "global_batch": 8}, cfg.to_dict())  # returns before the files are written
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_save_killed_mid_write_is_never_restored(tmp_path):
    import jax
    # A model of 5M parameters (60 MB with the optimizer state), so the background write of
    # step 2 is still running when the process is killed right after save() returns.
    args = TINY + [f"run.output_dir={tmp_path}", "run.name=killed", "mesh.data=1", "model.d_model=256",
                   "model.d_ff=768", "model.vocab_size=4096", "model.n_layers=4", "model.n_heads=4",
                   "checkpoint.async=true"]
    env = cpu_env(1, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    directory = tmp_path / "killed" / "checkpoints"
    # Orbax's layout for a save that never committed: <step>.orbax-checkpoint-tmp, not renamed.
    assert sorted(os.listdir(directory)) == ["1", "2.orbax-checkpoint-tmp"]

    cfg = load_config(None, args)
    like, _ = init_state(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), make_optimizer(cfg))
    ck = Checkpointer(cfg.run_dir, cfg.checkpoint)
    warnings = []
    step, state, data_state = ck.restore_latest(like, warn=warnings.append)
    assert (step, int(state.step), data_state["step"], warnings) == (1, 0, 1, [])
    # The next save of step 2 replaces the leftover directory and commits.
    ck.save(2, state, {"step": 2, "global_batch": 8}, cfg.to_dict())
    ck.close()
    assert sorted(os.listdir(directory)) == ["1", "2"]
    assert Checkpointer(cfg.run_dir, cfg.checkpoint).restore_latest(like)[0] == 2


def test_export_writes_safetensors_config_and_tokenizer(saved_run, tmp_path, capsys):
    import ml_dtypes
    import yaml
    from safetensors.numpy import load_file

    from maxfp4.interop.export import flat_params, main as export_main

    run = _copy(saved_run, tmp_path / "runs") / "base"
    cfg = _cfg(tmp_path / "runs")
    (run / "tokenizer.model").write_bytes(b"sentencepiece model bytes")  # as a text run keeps it
    expected = {3: flat_params(_cpu_params(str(run), 3, cfg)), 2: flat_params(_cpu_params(str(run), 2, cfg))}
    assert set(expected[3]) >= {"embed", "lm_head", "final_norm", "blocks.w_qkv", "blocks.w_down"}

    native = ["--format", "native"]
    assert export_main([str(run), "--out", str(tmp_path / "fp32"), "--dtype", "fp32"] + native) == 0
    assert export_main([str(run), "--out", str(tmp_path / "bf16"), "--step", "2"] + native) == 0  # bf16 by default
    fp32, bf16 = load_file(str(tmp_path / "fp32" / "model.safetensors")), load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert set(fp32) == set(bf16) == set(expected[3])
    for name, want in expected[3].items():
        assert fp32[name].dtype == np.float32 and np.array_equal(fp32[name], want), name
    for name, want in expected[2].items():
        # Round to nearest even, as a cast does: exactly the bf16 value of the saved float32.
        assert bf16[name].dtype == ml_dtypes.bfloat16 and np.array_equal(bf16[name], want.astype(ml_dtypes.bfloat16))
    assert not np.array_equal(expected[2]["blocks.w_qkv"], expected[3]["blocks.w_qkv"])  # --step mattered
    assert fp32["blocks.w_qkv"].shape == (cfg.model.n_layers, 64, 2, 4, 16)  # layer axis first
    model = yaml.safe_load((tmp_path / "fp32" / "config.yaml").read_text())["model"]
    assert model == cfg.to_dict()["model"]
    assert (tmp_path / "bf16" / "tokenizer.model").read_bytes() == b"sentencepiece model bytes"
    capsys.readouterr()

    # Bad input: one line, exit 2, nothing written or overwritten.
    before = _snapshot(tmp_path / "fp32")
    (tmp_path / "empty").mkdir()
    for argv, words in [
        ([str(tmp_path / "nope"), "--out", str(tmp_path / "x")], ["nope", "not found"]),
        ([str(tmp_path / "empty"), "--out", str(tmp_path / "x")], ["empty", "no complete checkpoint"]),
        ([str(run), "--out", str(tmp_path / "x"), "--step", "7"], ["--step 7", "expected one of 1, 2, 3"]),
        ([str(run), "--out", str(tmp_path / "fp32")], ["fp32", "already exists", "--force"]),
    ]:
        assert export_main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and all(w in err[0] for w in words), (argv, err)
    assert not (tmp_path / "x").exists() and _snapshot(tmp_path / "fp32") == before
    assert export_main([str(run), "--out", str(tmp_path / "fp32"), "--force", "--step", "2", "--dtype", "fp32"]
                       + native) == 0
    assert np.array_equal(load_file(str(tmp_path / "fp32" / "model.safetensors"))["embed"], expected[2]["embed"])


# ----------------------------------------------------------------------------- checksums


def test_an_edited_data_position_falls_back_to_the_previous_checkpoint(saved_run, tmp_path):
    import jax
    run = _copy(saved_run, tmp_path / "out") / "base"
    cfg = _cfg(tmp_path / "out")
    data_file = run / "checkpoints" / "3" / "data" / "metadata"
    position = json.loads(data_file.read_text())
    assert position["next_index"] == 3
    data_file.write_text(json.dumps({**position, "next_index": 10**12}))  # well-formed, and wrong
    like, _ = init_state(cfg, make_mesh(cfg.mesh, jax.devices()[:8]), make_optimizer(cfg))
    ck = Checkpointer(str(run), cfg.checkpoint)
    warnings = []
    step, state, data_state = ck.restore_latest(like, warn=warnings.append)
    ck.close()
    assert (step, int(state.step), data_state["next_index"]) == (2, 2, 2)
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith(f"checkpoint {run / 'checkpoints' / '3'} is unreadable (CheckpointCorrupt: data position")
    assert "1000000000000" in warnings[0] and "does not match its saved checksum" in warnings[0]
    assert "falling back to step 2" in warnings[0]

    # The config saved with a checkpoint is checked the same way, and before the rerun's config is
    # compared with it: the start-up compares with checkpoint 1, the one the restore will use,
    # instead of refusing the rerun for a seed the user never changed.
    config_file = run / "checkpoints" / "2" / "config" / "metadata"
    config_file.write_text(config_file.read_text().replace('"seed": 0', '"seed": 1'))
    refuse_changed_run(cfg)
    assert saved_config(str(run))[1] == str(run / "checkpoints" / "1")
    ck = Checkpointer(str(run), cfg.checkpoint)
    warnings.clear()
    assert ck.restore_latest(like, warn=warnings.append)[0] == 1
    ck.close()
    assert "saved config does not match its checksum" in warnings[0]
    # A real change of the math is still refused, against checkpoint 1.
    with pytest.raises(ConfigError, match=r"run.seed: 0 -> 1; expected the saved values"):
        refuse_changed_run(_cfg(tmp_path / "out", "run.seed=1"))


def test_a_checkpoint_without_its_integrity_record_warns_and_verify_refuses_it(saved_run, tmp_path, capfd):
    import jax
    run = _copy(saved_run, tmp_path / "out") / "base"
    shutil.rmtree(run / "checkpoints" / "3" / "integrity")  # as a partial copy, or an older maxfp4, leaves it
    cfg = _cfg(tmp_path / "out")
    like, _ = init_state(cfg, make_mesh(cfg.mesh, jax.devices()[:8]), make_optimizer(cfg))
    capfd.readouterr()
    ck = Checkpointer(str(run), cfg.checkpoint)
    assert ck.restore_latest(like, warn=pytest.fail)[0] == 3  # restored, not silently
    ck.close()
    lines = [l for l in capfd.readouterr().err.splitlines() if "integrity" in l]
    assert lines == [f"warning: checkpoint {run / 'checkpoints' / '3'} has no integrity record (saved by an older "
                     "maxfp4, or copied without it); its data position and config are restored unchecked"], lines

    # checkpoint.verify: refused, in the comparison at start-up and in the restore, which falls back.
    strict = _cfg(tmp_path / "out", "checkpoint.verify=true")
    assert saved_config(str(run), require_integrity=True)[1] == str(run / "checkpoints" / "2")
    warnings = []
    ck = Checkpointer(str(run), strict.checkpoint)
    assert ck.restore_latest(like, warn=warnings.append)[0] == 2
    assert len(warnings) == 1 and warnings[0].startswith(
        f"checkpoint {run / 'checkpoints' / '3'} is unreadable (CheckpointCorrupt: no integrity record"), warnings
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2", "3.unreadable"]
    # None has one: one line, exit code 2 from the command line (a UserError), nothing moved.
    for step in ("1", "2"):
        shutil.rmtree(run / "checkpoints" / step / "integrity")
    ck.manager.reload()
    with pytest.raises(CheckpointError, match=r"no readable checkpoint \(tried steps 2 \(CheckpointCorrupt: no "
                                              r"integrity record.*\), 1 \("):
        ck.restore_latest(like, warn=warnings.append)
    ck.close()
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2", "3.unreadable"]


def test_a_run_directory_with_only_unfinished_saves_starts_over_saying_so(saved_run, tmp_path, capsys):
    """A kill -9 during the first save leaves only Orbax's temporary directory: the rerun starts
    from step 1 (nothing could be restored), says so, and keeps the killed attempt's metrics
    aside instead of appending a second run to metrics.jsonl."""
    import jax
    from maxfp4.train import restore
    run = _copy(saved_run, tmp_path / "out") / "base"
    for step in ("1", "2", "3"):
        shutil.rmtree(run / "checkpoints" / step)
    (run / "checkpoints" / "1.orbax-checkpoint-tmp").mkdir()  # the layout a killed first save leaves
    before = (run / "metrics.jsonl").read_text()
    cfg = _cfg(tmp_path / "out")
    like, state_sh = init_state(cfg, make_mesh(cfg.mesh, jax.devices()[:8]), make_optimizer(cfg))
    capsys.readouterr()
    ck = Checkpointer(str(run), cfg.checkpoint)
    state = restore(cfg, ck, like, state_sh, data=None)
    ck.close()
    assert int(state.step) == 0
    lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("warning")]
    assert lines == [f"warning: no complete checkpoint in {run / 'checkpoints'} (only unfinished saves, never "
                     f"restored: 1.orbax-checkpoint-tmp); starting from step 1; the earlier attempt's metrics moved "
                     f"to {run / 'metrics.jsonl.1'}"], lines
    assert not (run / "metrics.jsonl").exists() and (run / "metrics.jsonl.1").read_text() == before


def test_verify_hashes_array_files_after_commit_and_catches_a_flipped_byte(tmp_path):
    import jax
    cfg = load_config(None, TINY + [f"run.output_dir={tmp_path}", "run.name=v", "mesh.data=1", "checkpoint.verify=true"])
    state, _ = init_state(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), make_optimizer(cfg))
    ck = Checkpointer(cfg.run_dir, cfg.checkpoint)
    for step in (1, 2):
        ck.save(step, state, {"next_index": step, "global_batch": 8}, cfg.to_dict())
    ck.wait()
    step_dir = tmp_path / "v" / "checkpoints" / "2"
    recorded = json.loads((step_dir / "checksums.process_0.json").read_text())["files"]
    arrays = [p for p in recorded if p.startswith("state/ocdbt.process_0/d/")]
    assert arrays and "state/_METADATA" in recorded and not any("commit_success" in p for p in recorded)
    import hashlib
    for rel, want in recorded.items():  # against an independent hash of each file
        assert hashlib.sha256((step_dir / rel).read_bytes()).hexdigest() == want["sha256"], rel
    assert ck.restore_latest(state)[0] == 2  # intact: restores, no warning needed

    biggest = max(arrays, key=lambda p: recorded[p]["bytes"])
    with open(step_dir / biggest, "r+b") as fh:  # one bit, same size: what a bad disk or copy does
        fh.seek(recorded[biggest]["bytes"] // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x01]))
    warnings = []
    step, _, data_state = ck.restore_latest(state, warn=warnings.append)
    ck.close()
    assert (step, data_state["next_index"]) == (1, 1)
    assert len(warnings) == 1 and f"array file {biggest}: SHA-256 differs from the saved one (checkpoint.verify)" in warnings[0]
    assert "falling back to step 1" in warnings[0]


# Rotation and rollback: the real loop, checkpoint and rollback hooks and Orbax checkpoints, with a
# one-number model whose guard (the real judge) skips the steps the batches mark bad.

@jax.jit
def _guarded_step(state, bad):
    import jax.numpy as jnp
    from maxfp4.reliability.guard import guard_metrics, judge
    loss = jnp.where(bad, jnp.float32(jnp.nan), jnp.float32(1.0))
    ok, guard = judge(state.guard, loss, jnp.float32(1.0), margin=0.0, warmup=0)
    state = state.replace(step=state.step + 1, params=jnp.where(ok, state.params + 1, state.params), guard=guard)
    return state, {"loss": loss, **guard_metrics(guard, ok)}


class _MarkedBatches:
    """Batch i (1-based, counted across rollbacks, as the data moves on) is bad if in ``bad``."""

    def __init__(self, bad):
        self.bad, self.i = set(bad), 0

    def __next__(self):
        self.i += 1
        return jax.numpy.bool_(self.i in self.bad)

    def get_state(self):
        return {"batches": self.i}


def _run_streak(directory, *, every, keep, limit, first, length):
    """Steps ``first .. first + length - 1`` skipped; returns the lines said and the checkpointer."""
    import contextlib

    import jax.numpy as jnp
    from maxfp4.checkpoint import CheckpointHook
    from maxfp4.config import CheckpointConfig
    from maxfp4.loop import Loop
    from maxfp4.reliability.guard import init_guard_state
    from maxfp4.reliability.rollback import RollbackHook, Rollbacks
    from maxfp4.state import TrainState

    cfg = CheckpointConfig(every=every, keep=keep)
    ck = Checkpointer(str(directory), cfg)
    said, batches = [], _MarkedBatches(range(first, first + length))
    state = TrainState(step=jnp.int32(0), params=jnp.float32(0), opt_state={}, rng=jax.random.key(0), precision={},
                       guard=init_guard_state(4))
    saves = CheckpointHook(ck, enabled=True, data=batches, config=None, saving=contextlib.nullcontext)
    hooks = [(saves, saves.cadence()),
             RollbackHook(Rollbacks(limit, 1, suspend_steps=4, checkpoint=cfg), ck, said.append)]
    loop = Loop(_guarded_step, state, batches, total_steps=first + length + 1, hooks=hooks)
    loop.run()
    ck.close()
    return said, ck, loop


@pytest.mark.parametrize("every", [1, 2, 5])
def test_rotation_keeps_the_checkpoint_before_a_streak_of_the_limit_and_one_either_side(tmp_path, every):
    # A streak one shorter than resilience.max_consecutive_skips goes on; one of the limit and one
    # longer roll back to the newest checkpoint before it, for keep 1, 2 and 3. Each streak ends
    # right before a save, so that save's state no longer shows the streak (with every=2, keep=3
    # and a streak of exactly 10 ending there, rotation used to delete that checkpoint).
    limit = 3
    for keep in (1, 2, 3):
        for length in (limit - 1, limit, limit + 1):
            first = next(s for s in range(every + 1, 3 * every + 2) if (s + length) % every == 0)
            target = (first - 1) // every * every
            said, ck, loop = _run_streak(tmp_path / f"k{keep}-l{length}", every=every, keep=keep, limit=limit,
                                         first=first, length=length)
            case = f"every={every} keep={keep} streak {first}..{first + length - 1}"
            expected = ([] if length < limit else
                        [f"rollback 1/1: {limit} consecutive skipped steps ({first}..{first + limit - 1}); "
                         f"restored checkpoint {target}, data continues past the skipped batches"])
            assert said == expected, case
            assert int(loop.state.step) == first + length + 1, case
            assert ck.all_steps()[-1] == first + length + 1 and len(ck.all_steps()) <= keep, case


def test_kept_steps_hold_every_rollback_target_and_at_most_keep_plus_one():
    from maxfp4.checkpoint import kept_steps, streak_floor
    # Every checkpoint is of a step the host has seen (seen >= the newest saved step). A future
    # rollback goes back to the newest checkpoint before the running streak's start, or, for a
    # streak beginning after `seen`, to the newest of all.
    for seen in range(1, 13):
        for consecutive in range(seen + 1):
            floor = streak_floor(seen, consecutive)
            for every in (1, 2, 5):
                steps = list(range(every, seen + 1, every))
                for keep in (1, 2, 3):
                    kept = kept_steps(steps, keep, floor)
                    targets = {max([s for s in steps if s < floor], default=None), max(steps, default=None)}
                    assert targets - {None} <= set(kept) and len(kept) <= keep + 1, (seen, consecutive, every, keep)
                    assert set(steps[-keep:]) <= set(kept)
