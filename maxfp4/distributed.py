"""Process start-up, in this order: an explicit coordinator (``distributed.*``), else Slurm
(``SLURM_JOB_ID`` and friends, set by ``srun``), else a single process.

Under Slurm each task is one JAX process. Which GPUs a task drives:
- one task per node: all GPUs of the node;
- several tasks per node, each seeing only its own GPU (``CUDA_VISIBLE_DEVICES`` of one entry,
  as ``--gpus-per-task=1`` or ``--gpu-bind`` give): that GPU, device 0;
- several tasks per node, each seeing every GPU: the GPU numbered ``SLURM_LOCALID``.
CPU processes exchange collectives through gloo, so multi-process runs work without GPUs.
"""

from __future__ import annotations

import glob
import math
import os
import socket
import sys
import threading
from typing import Mapping

import jax

from maxfp4.config import DistributedConfig
from maxfp4.errors import UserError

SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")

# What the trainer sets, unless the environment already says otherwise. Read by the CUDA driver
# when JAX starts the GPU backend, so they must be in place before the first device query.
# CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware work queue per GPU, which starts kernels in the
# order XLA launches them. With CUDA's default of 8 queues, an NCCL kernel launched on the
# collective stream just before a GEMM on the compute stream ran only after that GEMM, so
# FSDP's FP32 gradient reduce-scatters did not overlap the GEMMs they were scheduled beside
# (Llama-3-8B on two H200s: 66-75 ms a step with no compute kernel running; with one queue
# 7-11 ms, and the step 838 -> 812 ms in BF16, 638 -> 609 ms in FP8; one GPU: unchanged).
# docs/PERFORMANCE.md, section "Defaults and options". NVIDIA advises against 1 on Blackwell
# (unmeasured here): there, set the variable yourself.
GPU_ENVIRONMENT_DEFAULTS = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


def set_gpu_environment_defaults(env=os.environ) -> dict[str, str]:
    """Put ``GPU_ENVIRONMENT_DEFAULTS`` into ``env`` where it has no value; returns what was set.
    Call before JAX starts its GPU backend (the first device query)."""
    added = {k: v for k, v in GPU_ENVIRONMENT_DEFAULTS.items() if k not in env}
    env.update(added)
    return added


def set_gpu_memory_fraction(fraction: float, env=os.environ) -> str:
    """JAX's GPU allocator takes ``fraction`` of each GPU (``run.gpu_memory_fraction``) unless
    XLA_PYTHON_CLIENT_MEM_FRACTION is already set; returns the value in force. Call before JAX
    starts its GPU backend: its default of 0.75 left a Llama-3-8B config that fits an H100
    refused by the preflight."""
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{fraction:g}")
    return env["XLA_PYTHON_CLIENT_MEM_FRACTION"]


def in_slurm_step(env: Mapping[str, str] = os.environ) -> bool:
    return all(v in env for v in SLURM_VARS)


def _tasks_on_this_node(env: Mapping[str, str]) -> int:
    """From SLURM_TASKS_PER_NODE ("4", "2(x3)", "3,2") or SLURM_NTASKS_PER_NODE; 1 if unknown."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return int(env["SLURM_NTASKS_PER_NODE"])
    spec = env.get("SLURM_TASKS_PER_NODE", "")
    node = int(env.get("SLURM_NODEID", "0"))
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        n, _, rep = part.partition("(x")
        counts += [int(n)] * (int(rep.rstrip(")")) if rep else 1)
    return counts[node] if node < len(counts) else 1


def _gpus_on_node() -> int:
    return len(glob.glob("/proc/driver/nvidia/gpus/*"))


def slurm_local_device_ids(env: Mapping[str, str] = os.environ, gpus_on_node: int | None = None) -> list[int] | None:
    """The local GPU ids this Slurm task drives (None: every device it sees, e.g. on CPU)."""
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    gpus = len(visible) if visible else (_gpus_on_node() if gpus_on_node is None else gpus_on_node)
    if gpus == 0:
        return None
    if _tasks_on_this_node(env) == 1 or len(visible) == 1:
        return list(range(gpus))
    local = int(env["SLURM_LOCALID"])
    if local >= gpus:
        raise UserError(f"SLURM_LOCALID={local}: this task sees only {gpus} GPU(s); expected one task per GPU")
    return [local]


# Exit code of a process whose peers did not all join in time (bad start-up, like bad input).
INIT_TIMEOUT_EXIT_CODE = 2
# JAX's own start-up limit is set this much above ours, so ours always fires first: JAX's ends
# in a C++ abort (exit 134) blaming "another task", after its full timeout.
_JAX_INIT_MARGIN_S = 60


def _check_coordinator_host(address: str) -> None:
    """An unknown host name is a one-line error now, not a start-up timeout later."""
    host = address.rpartition(":")[0].strip("[]")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"distributed.coordinator={address}: host {host!r} does not resolve "
                        f"({getattr(e, 'strerror', None) or e}); expected a reachable host:port") from None


def _reachable(address: str) -> str:
    """'' when a TCP connection to ``address`` opens now, else why not."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
        return ""
    except OSError as e:
        return e.strerror or type(e).__name__


def _start_up_report(address: str, process_id: int, num_processes: int, timeout_s: float) -> str:
    """The one line a process prints when the processes have not all joined in ``timeout_s``.
    JAX's coordination service does not tell a waiting process which peers are missing, so the
    line says who is known to be there: process 0 hosts the service; a process that cannot even
    reach it names the coordinator."""
    waited = f"distributed.init_timeout_s={timeout_s:g}"
    if process_id != 0 and (why := _reachable(address)):
        return (f"distributed.coordinator={address}: not reachable from process {process_id} within {waited} "
                f"({why}); expected process 0 to be running there")
    others = [str(p) for p in range(num_processes) if p != process_id]
    who = (f"process {others[0]}" if len(others) == 1 else
           f"one or more of processes {', '.join(others[:8])}{', ...' if len(others) > 8 else ''}")
    return (f"distributed: process {process_id} of {num_processes} waited {waited} at {address}, but not every "
            f"process joined ({who} never started or died first); start all of them, or raise "
            "distributed.init_timeout_s")


def _join_within(timeout_s: float, report) -> threading.Timer:
    """Give up the start-up after ``timeout_s``: print ``report()`` as one line and exit with
    INIT_TIMEOUT_EXIT_CODE. A timer thread, because the blocked call is JAX's C++ connect, which
    no Python exception can interrupt."""
    def expire() -> None:
        print(f"error: {report()}", file=sys.stderr, flush=True)
        os._exit(INIT_TIMEOUT_EXIT_CODE)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    return timer


# Exit code of a process whose collective failed because a peer process died.
PEER_LOST_EXIT_CODE = 4
# How a collective reports a vanished peer: gloo (CPU) and NCCL (GPU) messages, the
# coordination service's heartbeat verdict.
_PEER_LOST_SIGNS = ("Connection reset by peer", "Connection closed by peer", "Gloo", "NCCL", "heartbeat",
                    "remote process exited", "unhealthy")


def _stop_quietly_when_a_peer_is_lost(previous=None) -> None:
    """Install a ``sys.excepthook`` for multi-process runs: an uncaught runtime error from a
    collective that lost its peer ends the process with one line and PEER_LOST_EXIT_CODE,
    skipping interpreter shutdown, where JAX's shutdown barrier would abort the process
    (exit 134, a C++ stack trace) because that peer never arrives. Other errors go to the
    previous hook."""
    previous = previous or sys.excepthook

    def hook(kind, error, tb):
        text = str(error)
        if type(error).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and any(s in text for s in _PEER_LOST_SIGNS):
            first = (text.strip().splitlines() or [kind.__name__])[0][:300]
            print(f"error: distributed: process {jax.process_index()} of {jax.process_count()} lost a peer "
                  f"process (it died or was killed; its own log says why): {first}", file=sys.stderr, flush=True)
            os._exit(PEER_LOST_EXIT_CODE)
        previous(kind, error, tb)

    sys.excepthook = hook


def initialize(cfg: DistributedConfig, env: Mapping[str, str] = os.environ) -> str:
    """Join the multi-process runtime if there is one; returns how the process started.

    Every process must join within ``distributed.init_timeout_s``; a process that dies later is
    declared dead by JAX after ``distributed.heartbeat_timeout_s`` (docs/RELIABILITY.md)."""
    # CPU collectives across processes need an implementation; GPUs use NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    limits = {"initialization_timeout": int(math.ceil(cfg.init_timeout_s)) + _JAX_INIT_MARGIN_S,
              "heartbeat_timeout_seconds": int(cfg.heartbeat_timeout_s)}
    if cfg.coordinator:
        _check_coordinator_host(cfg.coordinator)
        timer = _join_within(cfg.init_timeout_s, lambda: _start_up_report(
            cfg.coordinator, cfg.process_id, cfg.num_processes, cfg.init_timeout_s))
        # JAX's coordination service (started by process 0) binds to [::]:port, every interface,
        # unless told otherwise; bind it to the configured address only, so a run on loopback or
        # on the cluster network is not reachable from elsewhere. The environment variable
        # JAX_COORDINATOR_BIND_ADDRESS, which JAX reads, still wins for unusual setups (NAT).
        try:
            jax.distributed.initialize(coordinator_address=cfg.coordinator,
                                       num_processes=cfg.num_processes, process_id=cfg.process_id,
                                       coordinator_bind_address=os.environ.get("JAX_COORDINATOR_BIND_ADDRESS",
                                                                               cfg.coordinator), **limits)
        finally:
            timer.cancel()
        _stop_quietly_when_a_peer_is_lost()
        return f"explicit coordinator {cfg.coordinator}, process {cfg.process_id} of {cfg.num_processes}"
    if in_slurm_step(env):
        # JAX's own Slurm detection finds the coordinator (first node of the step, a port
        # derived from the job id) and the process ids; we only choose the GPUs. On CPU the
        # device ids it would pick only restrict GPUs, so they do no harm there. JAX derives the
        # coordinator address itself here and binds its service to every interface of the first
        # node; set JAX_COORDINATOR_BIND_ADDRESS=<node address>:<port> to narrow it.
        procid, ntasks = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        timer = _join_within(cfg.init_timeout_s, lambda: (
            f"distributed: Slurm task {procid} of {ntasks}: not every task joined within "
            f"distributed.init_timeout_s={cfg.init_timeout_s:g}; check the other tasks' logs"))
        try:
            jax.distributed.initialize(local_device_ids=slurm_local_device_ids(env), **limits)
        finally:
            timer.cancel()
        _stop_quietly_when_a_peer_is_lost()
        return (f"Slurm job {env['SLURM_JOB_ID']}, task {env['SLURM_PROCID']} of {env['SLURM_NTASKS']}"
                f" on {env.get('SLURMD_NODENAME', '?')}")
    return "single process"
