"""What a checkpoint costs the training loop, with Orbax async saving on and off.

For each mode it trains a few steps to compile and measure the plain step time, then:
- save + wait: ``blocking_s`` (the save() call: device-to-host copy, and for a synchronous save
  the whole write) and ``complete_s`` (until the checkpoint is committed on disk);
- save + train: the save followed at once by ``--steps`` timed steps; ``stall_s`` = their wall
  time plus the save call minus the wall time of ``--steps`` plain steps, i.e. what the save
  added to training (async: the copy plus any slowdown from writing in the background), and
  ``wait_after_s``, what was still left to write after those steps. On a shared or noisy
  machine step-time jitter of the same order makes stall_s noisy (it can come out negative).

With ``--verify`` it measures async saves with ``checkpoint.verify`` off and on instead: the
array files are hashed (SHA-256) by a background thread once the save has committed, so the
cost shows in ``complete_s`` (commit + hashing, what ``wait`` blocks on), ``hash_s`` (the
hashing alone) and in the steps that overlap it (``stall_s``), and the restore-time check in
``verify_restore_s``.

Prints a table and writes JSON. Examples:

    python benchmarks/checkpoint_save.py                        # configs/dense-1p3b.yaml, GPU
    python benchmarks/checkpoint_save.py --config configs/quickstart.yaml --steps 10 data.source=synthetic
    python benchmarks/checkpoint_save.py --verify                 # checkpoint.verify off vs on
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import jax
from jax.sharding import NamedSharding, PartitionSpec

from maxfp4 import checksums
from maxfp4.checkpoint import Checkpointer
from maxfp4.config import load_config
from maxfp4.data import make_batches
from maxfp4.parallel.mesh import batch_sharding, make_mesh
from maxfp4.optim import make_optimizer, make_schedule
from maxfp4.precision import resolve_policy
from maxfp4.step import make_train_step
from maxfp4.train import init_state

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def measure(cfg, steps: int, warmup: int) -> dict:
    mesh = make_mesh(cfg.mesh)
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    optimizer = make_optimizer(cfg)
    state, state_sh = init_state(cfg, mesh, optimizer, policy)
    os.makedirs(cfg.run_dir, exist_ok=True)
    data = make_batches(cfg, cfg.run_dir)
    step_fn = make_train_step(cfg, policy, optimizer, make_schedule(cfg), mesh,
                              data.max_runs_per_row)  # the attention kernel the trainer would pick
    b_sh = batch_sharding(mesh)
    jitted = jax.jit(step_fn, in_shardings=(state_sh, b_sh),
                     out_shardings=(state_sh, NamedSharding(mesh, PartitionSpec())), donate_argnums=0)

    def one_step(state):
        batch = {k: jax.make_array_from_process_local_data(b_sh, v) for k, v in next(data).items()}
        state, metrics = jitted(state, batch)
        jax.block_until_ready((state, metrics))
        return state

    def timed_steps(state, n):
        times = []
        for _ in range(n):
            t = time.perf_counter()
            state = one_step(state)
            times.append(time.perf_counter() - t)
        return state, times

    for _ in range(warmup):  # compile, and let allocation settle
        state = one_step(state)
    state, plain = timed_steps(state, steps)
    step_s = statistics.mean(plain)

    ck = Checkpointer(cfg.run_dir, cfg.checkpoint)
    # save + wait: the save alone.
    t0 = time.perf_counter()
    ck.save(int(state.step), state, data.get_state(), cfg.to_dict())
    blocking = time.perf_counter() - t0
    ck.wait()
    complete = time.perf_counter() - t0
    size = _dir_bytes(ck.step_path(int(state.step)))
    # save + train: what the save costs the steps around it.
    state = one_step(state)
    t0 = time.perf_counter()
    saved_step = int(state.step)
    ck.save(saved_step, state, data.get_state(), cfg.to_dict())
    overlapped_blocking = time.perf_counter() - t0
    state, during = timed_steps(state, steps)
    t1 = time.perf_counter()
    ck.wait()
    wait_after = time.perf_counter() - t1
    ck.close()
    step_dir = ck.step_path(saved_step)
    t0 = time.perf_counter()  # the hashing alone, as the background thread does it
    checksums.write(step_dir, jax.process_index())
    hash_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    problem = checksums.verify(step_dir, jax.process_index(), jax.process_count())
    verify_restore_s = time.perf_counter() - t0
    assert problem is None, problem
    return {
        "async": cfg.checkpoint.async_, "verify": cfg.checkpoint.verify, "hash_s": hash_s,
        "verify_restore_s": verify_restore_s, "step_s": step_s, "checkpoint_gb": size / 1e9,
        "blocking_s": blocking, "complete_s": complete, "write_gb_per_s": size / 1e9 / complete,
        "overlapped_blocking_s": overlapped_blocking,
        "stall_s": overlapped_blocking + sum(during) - sum(plain),
        "max_step_during_save_s": max(during), "wait_after_s": wait_after,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(REPO, "configs", "dense-1p3b.yaml"))
    ap.add_argument("--steps", type=int, default=10, help="timed steps (plain, and after the save)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--json", default="checkpoint_save.json")
    ap.add_argument("--verify", action="store_true",
                    help="compare checkpoint.verify off and on (async saves) instead of async on and off")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    a = ap.parse_args(argv)
    workdir = a.workdir or tempfile.mkdtemp(prefix="maxfp4_ckpt_bench_")
    rows = []
    modes = [(True, False), (True, True)] if a.verify else [(True, False), (False, False)]
    for async_, verify in modes:
        out = os.path.join(workdir, f"async_{async_}_verify_{verify}")
        shutil.rmtree(out, ignore_errors=True)
        cfg = load_config(a.config, ["data.source=synthetic", *a.overrides, f"run.output_dir={out}",
                                     "run.name=bench", f"checkpoint.async={str(async_).lower()}",
                                     f"checkpoint.verify={str(verify).lower()}"])
        rows.append(measure(cfg, a.steps, a.warmup))
        shutil.rmtree(out, ignore_errors=True)
    device = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    print(f"{a.config} {' '.join(a.overrides)} on {device}, jax {jax.__version__}")
    print(f"{'async':>5} {'verify':>6} {'step s':>8} {'ckpt GB':>8} {'blocking s':>10} {'complete s':>10} "
          f"{'GB/s':>6} {'stall s':>8} {'max step s':>10} {'wait after s':>12} {'hash s':>7} {'check s':>7}")
    for r in rows:
        print(f"{str(r['async']):>5} {str(r['verify']):>6} {r['step_s']:8.3f} {r['checkpoint_gb']:8.3f} "
              f"{r['blocking_s']:10.3f} {r['complete_s']:10.3f} {r['write_gb_per_s']:6.2f} {r['stall_s']:8.3f} "
              f"{r['max_step_during_save_s']:10.3f} {r['wait_after_s']:12.3f} {r['hash_s']:7.3f} "
              f"{r['verify_restore_s']:7.3f}")
    with open(a.json, "w") as fh:
        json.dump({"config": a.config, "overrides": a.overrides, "steps": a.steps, "device": device,
                   "jax": jax.__version__, "rows": rows}, fh, indent=1)
    print(f"wrote {a.json}", file=sys.stderr)


if __name__ == "__main__":
    main()
