"""``python -m maxfp4.reliability.preflight CONFIG [overrides]``: check a machine before spending an allocation
on it. The trainer runs the same checks at start-up (``resilience.preflight``).

Checks, each one line when it fails (exit code 2), a short table when all pass:
- devices: visible, and all of one kind (a mixed node gives mismatched speeds and numerics);
- gemm: a jitted BF16 matmul timed on every device; a device below ``GEMM_SLOW_RATIO`` x the
  median of all devices (all processes) is flagged (a throttled or faulty GPU slows every step
  of a synchronous run). It costs seconds, so it runs on GPUs, or off GPU when asked
  (``resilience.preflight_gemm`` / ``--gemm``);
- allreduce: a psum of the device positions over every device of every process must equal
  0 + 1 + ... + (N-1) on every device (a broken link or NCCL/gloo setup shows up here, not
  an hour into the run);
- data: the data files and tokenizer can be read (synthetic data needs nothing);
- output: the run directory is writable and its disk has room for ``checkpoint.keep + 1``
  checkpoints (the kept ones and the one being written before the oldest is deleted), less those
  already on disk, each estimated as parameters x (4 bytes FP32 weights + 8 bytes Adam moments)
  + the precision state;
- memory: a rough per-device estimate (weights, gradients and Adam moments over the
  model-parallel axes, plus saved activations and logits) against the device's memory limit;
  devices without memory statistics (CPU) share the host's memory: their estimate is compared
  with the machine's physical memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxfp4.config import Config, ConfigError, add_config_arguments, config_from_arguments
from maxfp4.reliability.run_lock import missing_directories, remove_if_empty
from maxfp4.errors import UserError, exit_code_of
from maxfp4.step_memory import device_limit_bytes, memory_remedy

GEMM_SLOW_RATIO = 0.7
MEMORY_HEADROOM = 0.9  # leave room for XLA's workspace and fragmentation (the host check)
# The planner's memory model overestimates measured peaks by up to 17% (docs/PLANNING.md,
# "Memory"): the device check refuses only past the device by more than that, so that it never
# refuses a step that fits; the compiled step's own plan is checked exactly at its first call
# (maxfp4.step_memory).
PLANNER_MEMORY_OVER = 0.2


class PreflightFailed(UserError):
    """One or more checks failed; the message has one line per failure."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None  # None: skipped
    detail: str


# ----------------------------------------------------------------------------- the checks


def check_devices(devices: Sequence[jax.Device]) -> Check:
    if not devices:
        return Check("devices", False, "no devices visible to JAX")
    kinds = sorted({f"{d.platform}:{d.device_kind}" for d in devices})
    if len(kinds) > 1:
        return Check("devices", False, f"devices of {len(kinds)} kinds ({', '.join(kinds)}); expected one kind")
    local = sum(d.process_index == jax.process_index() for d in devices)
    return Check("devices", True, f"{len(devices)} x {devices[0].device_kind} ({local} on this process)")


def gemm_rates(devices: Sequence[jax.Device], n: int, iters: int, repeats: int = 3) -> list[float]:
    """TFLOP/s of an n x n x n BF16 matmul on each device, timed after a warm-up call; the best
    of ``repeats`` timings, so a moment of contention on a shared host is not taken for a slow device."""
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    host = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    rates = []
    for d in devices:
        a = jax.device_put(jnp.asarray(host, jnp.bfloat16), d)
        matmul(a, a).block_until_ready()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(iters):
                out = matmul(a, a)
            out.block_until_ready()
            best = min(best, time.perf_counter() - start)
        rates.append(2.0 * n ** 3 * iters / best / 1e12)
    return rates


def slow_devices(rates: Sequence[float], ratio: float = GEMM_SLOW_RATIO) -> list[int]:
    median = float(np.median(rates))
    return [i for i, r in enumerate(rates) if r < ratio * median]


def check_gemm(devices: Sequence[jax.Device]) -> Check:
    from maxfp4.reliability.stragglers import allgather, host_name
    local = [d for d in devices if d.process_index == jax.process_index()]
    gpu = local[0].platform == "gpu"
    rates = gemm_rates(local, n=8192 if gpu else 512, iters=10 if gpu else 2)
    # Compare against the devices of every process: one slow GPU on one node slows them all.
    all_rates = allgather(np.asarray(rates, np.float64)).ravel()
    median = float(np.median(all_rates))
    offset = sum(jax.process_index() > d.process_index for d in devices)  # processes' devices come in order
    slow = [i for i in slow_devices(all_rates) if offset <= i < offset + len(local)]
    if slow:
        named = ", ".join(f"device {local[i - offset].id} on {host_name()} {all_rates[i]:.2f} TFLOP/s" for i in slow)
        return Check("gemm", False, f"{named}: below {GEMM_SLOW_RATIO} x the median {median:.2f} TFLOP/s")
    return Check("gemm", True, f"{len(all_rates)} device(s), median {median:.2f} TFLOP/s, "
                               f"slowest {min(all_rates) / median:.2f} x median")


def check_allreduce(devices: Sequence[jax.Device]) -> Check:
    n = len(devices)
    mesh = Mesh(np.array(sorted(devices, key=lambda d: (d.process_index, d.id)), dtype=object), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    positions = np.arange(n, dtype=np.float32)
    ids = jax.make_array_from_callback((n,), sharding, lambda idx: positions[idx])
    shard_map = getattr(jax, "shard_map", None)
    if shard_map is None:  # older JAX
        from jax.experimental.shard_map import shard_map
    total = jax.jit(shard_map(lambda x: jax.lax.psum(x, "d"), mesh=mesh, in_specs=PartitionSpec("d"),
                              out_specs=PartitionSpec("d")))(ids)
    expected = n * (n - 1) / 2
    wrong = [(s.device.id, float(np.asarray(s.data)[0])) for s in total.addressable_shards
             if float(np.asarray(s.data)[0]) != expected]
    if wrong:
        return Check("allreduce", False, f"psum of device positions over {n} devices gave "
                                         f"{', '.join(f'{v:g} on device {i}' for i, v in wrong)}; expected {expected:g}")
    return Check("allreduce", True, f"psum over {n} device(s) correct")


def _check_source(cfg: Config, source: str, paths) -> str:
    """Open what one data source reads, cheaply; returns what was found."""
    from maxfp4.data.corpus import open_prepared, prepared_directories
    from maxfp4.data.sources import expand_paths, open_tfds, source_documents, tfds_field
    from maxfp4.errors import DataError
    if source in ("text", "jsonl"):  # open every file but read only its start: corpora are large
        files = expand_paths(paths)
        for path in files:
            with open(path, "rb") as fh:
                fh.read(4096)
        return f"{len(files)} {source} file(s) readable"
    if source == "array_record":  # every shard opened and its record count checked
        shards, _, _ = open_prepared(prepared_directories(paths))
        return f"{len(shards.lengths_N)} prepared document(s)"
    if source == "tfds":  # opened and its first example's field checked; the loader reads the rest
        d = cfg.data
        records = open_tfds(d.tfds_name, d.tfds_split, d.tfds_data_dir)
        if len(records) == 0:
            raise DataError(f"data.tfds_name={d.tfds_name!r} split {d.tfds_split!r}: no examples")
        tfds_field(d.tfds_name, records[0], 0, d.tfds_field)
        return f"{len(records)} tfds example(s)"
    return f"{len(source_documents(cfg, source, paths))} {source} document(s)"  # builtin: in memory


def check_data(cfg: Config) -> Check:
    from maxfp4.data.tokenizer import Tokenizer
    d = cfg.data
    try:
        if d.source == "synthetic":
            return Check("data", True, "synthetic: nothing to read")
        parts = ([(p["source"], tuple(p.get("paths", ()))) for p in d.mixture] if d.source == "mixture"
                 else [(d.source, d.paths)])
        what = "; ".join(_check_source(cfg, source, paths) for source, paths in parts)
        if d.tokenizer:
            what += f", tokenizer {Tokenizer(d.tokenizer).vocab_size} pieces"
        return Check("data", True, what)
    except (UserError, OSError) as e:
        return Check("data", False, str(e))


def state_sizes(cfg: Config) -> tuple[int, int]:
    """(parameter count, precision-state bytes), from shapes only (nothing is allocated)."""
    from maxfp4.model import abstract_params, get_model
    from maxfp4.precision import resolve_policy
    from maxfp4.precision.state import init_precision_state
    model = get_model(cfg.model)
    params = abstract_params(cfg.model)
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    prec = jax.eval_shape(lambda: init_precision_state(policy, model.block_layer_classes))
    return (sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params)),
            sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(prec)))


def checkpoint_bytes(n_params: int, precision_bytes: int) -> int:
    return n_params * (4 + 8) + precision_bytes


def checkpoints_to_fit(cfg: Config) -> int:
    """How many more checkpoints the disk must hold: ``keep`` plus the one being written,
    less those already there (a resumed run)."""
    from maxfp4.checkpoint import finalized_steps
    if not cfg.checkpoint.enabled:
        return 0
    return max(1, cfg.checkpoint.keep + 1 - len(finalized_steps(cfg.run_dir)))


def check_output(cfg: Config, n_params: int, precision_bytes: int) -> Check:
    count = checkpoints_to_fit(cfg)
    one = checkpoint_bytes(n_params, precision_bytes)
    need = count * one
    created = missing_directories(cfg.run_dir)  # removed again: a check leaves nothing behind
    try:
        os.makedirs(cfg.run_dir, exist_ok=True)
        probe = os.path.join(cfg.run_dir, f".preflight_{jax.process_index()}_{os.getpid()}")
        with open(probe, "wb") as fh:
            fh.write(b"\0" * 4096)
        os.remove(probe)
        free = shutil.disk_usage(cfg.run_dir).free
    except OSError as e:
        return Check("output", False, f"{cfg.run_dir}: not writable ({e.strerror or e})")
    finally:
        remove_if_empty(created)
    if free < need:
        return Check("output", False, f"{cfg.run_dir}: {free / 2**30:.3f} GiB free; checkpoint.keep={cfg.checkpoint.keep} "
                                      f"+ 1 checkpoints of about {one / 2**30:.3f} GiB need {need / 2**30:.3f} GiB "
                                      f"(less those already saved); expected more free space or a smaller keep")
    return Check("output", True, f"{cfg.run_dir} writable, {free / 2**30:.1f} GiB free, "
                                 f"{count} checkpoint(s) of ~{one / 2**20:.1f} MiB")


def memory_per_device(cfg: Config, n_params: int, mesh_shape: dict[str, int]) -> float:
    """Bytes per device by the planner's memory model (``maxfp4.plan.cost.memory_per_device``: state
    over fsdp x tensor, the working weights and activations by ``train.remat``, the loss's logits;
    docs/PLANNING.md gives it with its calibration against measured peaks). Priced in the widest
    recipe the config's precision policy runs in its blocks (:func:`widest_block_recipe`): the
    working weights and the kept GEMM operands take its bytes."""
    from maxfp4.plan.context import proxy_config, state_over_context
    from maxfp4.plan.cost import memory_per_device as planned
    from maxfp4.plan.stages import PlanMesh
    # A pipeline stage keeps 1/pipeline of the blocks' state and activations, as an fsdp shard
    # does of the state and a data shard of the activations: charged as more fsdp. Outside the
    # experts the expert axis splits the batch as data does (maxfp4.parallel.mesh.resolve_mesh_shape).
    mesh = PlanMesh(mesh_shape["data"] * mesh_shape.get("expert", 1),
                    mesh_shape["fsdp"] * mesh_shape.get("pipeline", 1), mesh_shape["tensor"],
                    shard_optimizer=cfg.mesh.shard_optimizer_over_data)
    widest = widest_block_recipe(cfg)
    # A context group of C devices: each holds T/C tokens of its rows and 1/C of the state, as
    # the planner's proxy prices it (maxfp4.plan.context).
    c = mesh_shape.get("context", 1)
    parts = planned(proxy_config(cfg, c) if c > 1 else cfg, mesh, n_params, widest, cfg.train.remat)
    return sum(state_over_context(parts, c).values())


def widest_block_recipe(cfg: Config) -> str:
    """The recipe of the config's block GEMMs with the most bytes a weight and operand (BF16
    for a BF16 model, FP8 for an all-FP8 one, BF16 for the NVFP4 preset's BF16 ends)."""
    from maxfp4.model_spec import model_spec
    from maxfp4.precision import resolve_policy
    from maxfp4.precision.catalog import SPECS
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    spec = model_spec(cfg.model)
    used = {policy.recipe_for(lin.layer_class, i) for i, block in enumerate(spec.blocks)
            for lin in block.linears if lin.layer_class != "router"}
    return max(used, key=lambda name: (SPECS[name].weight_bytes, SPECS[name].operand_bytes))


def check_memory(cfg: Config, devices: Sequence[jax.Device], n_params: int, mesh_shape: dict[str, int]) -> Check:
    need = memory_per_device(cfg, n_params, mesh_shape)
    local = [d for d in devices if d.process_index == jax.process_index()]
    limit = device_limit_bytes(local[0])
    if not limit:
        return check_host_memory(cfg, need * len(local), local[0].platform)
    if need > (1 + PLANNER_MEMORY_OVER) * limit:
        return Check("memory", False, f"about {need / 2**30:.1f} GiB per device estimated, over the device's "
                                      f"{limit / 2**30:.1f} GiB by more than the estimate's "
                                      f"{PLANNER_MEMORY_OVER:.0%} margin; {memory_remedy(cfg.train.remat)} "
                                      f"(the estimate is rough: resilience.preflight=false runs anyway)")
    return Check("memory", True, f"~{need / 2**30:.1f} of {limit / 2**30:.1f} GiB per device (the compiled step "
                                 f"is checked at its first call)")


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_memory(cfg: Config, need: int | float, platform: str) -> Check:
    """Devices without a memory limit of their own (CPU) share the host's memory: this process's
    devices' estimate against the machine's physical memory, so a GPU-sized config is refused in
    one line instead of swapping for minutes before its first step."""
    host = host_memory_bytes()
    if not host:
        return Check("memory", None, f"~{need / 2**30:.2f} GiB estimated; {platform} reports no memory limit and "
                                     "the host's memory is unknown, not compared")
    if need > MEMORY_HEADROOM * host:
        return Check("memory", False, f"about {need / 2**30:.1f} GiB estimated for this process's {platform} devices, "
                                      f"over {MEMORY_HEADROOM:.0%} of the host's {host / 2**30:.1f} GiB; this config "
                                      "is sized for GPUs (try configs/quickstart.yaml on a CPU; "
                                      "resilience.preflight=false runs anyway)")
    return Check("memory", True, f"~{need / 2**30:.2f} of the host's {host / 2**30:.1f} GiB ({platform})")


# ----------------------------------------------------------------------------- running them


def run_checks(cfg: Config, devices: Sequence[jax.Device] | None = None, *, gemm: bool | None = None) -> list[Check]:
    """All checks, in order. ``gemm`` None: on GPUs or when ``resilience.preflight_gemm``."""
    from maxfp4.parallel.mesh import make_mesh
    devices = list(devices if devices is not None else jax.devices())
    checks = [check_devices(devices)]
    if not checks[0].ok:
        return checks
    if gemm is None:
        gemm = devices[0].platform == "gpu" or cfg.resilience.preflight_gemm
    checks.append(check_gemm(devices) if gemm else
                  Check("gemm", None, "not timed off GPU (resilience.preflight_gemm=true or --gemm to time it)"))
    checks.append(check_allreduce(devices))
    checks.append(check_data(cfg))
    n_params, precision_bytes = state_sizes(cfg)
    checks.append(check_output(cfg, n_params, precision_bytes))
    try:
        mesh_shape = dict(make_mesh(cfg.mesh, devices).shape)
    except ConfigError as e:
        return checks + [Check("memory", False, str(e))]
    checks.append(check_memory(cfg, devices, n_params, mesh_shape))
    return checks


def format_table(checks: Sequence[Check]) -> str:
    width = max(len(c.name) for c in checks)
    status = {True: "ok", False: "FAILED", None: "skipped"}
    return "\n".join(f"  {c.name:<{width}}  {status[c.ok]:<7}  {c.detail}" for c in checks)


def raise_on_failure(checks: Sequence[Check]) -> None:
    failed = [c for c in checks if c.ok is False]
    if failed:
        # One line per failed check (usually one: the first line of the message names it).
        raise PreflightFailed("\n".join(f"preflight {c.name}: {c.detail}" for c in failed))


def preflight_summary(cfg: Config, devices: Sequence[jax.Device]) -> str:
    """The trainer's start-up check: raises :class:`PreflightFailed`, else returns one line."""
    checks = run_checks(cfg, devices)
    raise_on_failure(checks)
    return "preflight: " + ", ".join(f"{c.name} {'ok' if c.ok else 'skipped'}" for c in checks)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxfp4.reliability.preflight",
                                     description="Check devices, collectives, data, disk and memory for a config.")
    add_config_arguments(parser)
    parser.add_argument("--gemm", action="store_true", help="time a GEMM on every device even off GPU")
    args = parser.parse_args(argv)

    def run() -> None:
        from maxfp4 import distributed
        cfg = config_from_arguments(args)
        distributed.initialize(cfg.distributed)
        checks = run_checks(cfg, gemm=True if args.gemm else None)
        if jax.process_index() == 0:
            print("preflight:\n" + format_table(checks), flush=True)
        raise_on_failure(checks)

    return exit_code_of(run)


if __name__ == "__main__":
    sys.exit(main())
