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
import os
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


def initialize(cfg: DistributedConfig, env: Mapping[str, str] = os.environ) -> str:
    """Join the multi-process runtime if there is one; returns how the process started."""
    # CPU collectives across processes need an implementation; GPUs use NCCL regardless.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cfg.coordinator:
        # JAX's coordination service (started by process 0) binds to [::]:port, every interface,
        # unless told otherwise; bind it to the configured address only, so a run on loopback or
        # on the cluster network is not reachable from elsewhere. The environment variable
        # JAX_COORDINATOR_BIND_ADDRESS, which JAX reads, still wins for unusual setups (NAT).
        jax.distributed.initialize(coordinator_address=cfg.coordinator,
                                   num_processes=cfg.num_processes, process_id=cfg.process_id,
                                   coordinator_bind_address=os.environ.get("JAX_COORDINATOR_BIND_ADDRESS",
                                                                           cfg.coordinator))
        return f"explicit coordinator {cfg.coordinator}, process {cfg.process_id} of {cfg.num_processes}"
    if in_slurm_step(env):
        # JAX's own Slurm detection finds the coordinator (first node of the step, a port
        # derived from the job id) and the process ids; we only choose the GPUs. On CPU the
        # device ids it would pick only restrict GPUs, so they do no harm there. JAX derives the
        # coordinator address itself here and binds its service to every interface of the first
        # node; set JAX_COORDINATOR_BIND_ADDRESS=<node address>:<port> to narrow it.
        jax.distributed.initialize(local_device_ids=slurm_local_device_ids(env))
        return (f"Slurm job {env['SLURM_JOB_ID']}, task {env['SLURM_PROCID']} of {env['SLURM_NTASKS']}"
                f" on {env.get('SLURMD_NODENAME', '?')}")
    return "single process"
