"""The planner's cost model: parameters, FLOPs, memory per device, communication, compute and
step time of a run on a mesh of GPUs, for each precision column (``python -m maxfp4.plan`` and
maxfp4.plan.layout read it). Every formula and constant is stated in docs/PLANNING.md; the
constants below carry the same names.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

import jax

from maxfp4.config import Config, ModelConfig, PrecisionConfig
from maxfp4.errors import UserError
from maxfp4.parallel.mesh import LOGICAL_RULES
from maxfp4.metrics import DEVICE_PEAKS_TFLOPS
from maxfp4.model import abstract_params
from maxfp4.model_spec import (BlockSpec, LinearSpec, model_spec,
                               mamba_splits_over_tensor as splits_over_tensor)
from maxfp4.precision.catalog import SPECS

# The recipe each column of the plan stands for; bytes and peak classes come from its catalog
# entry. The memory functions also take any recipe's name (``mxfp8``).
PLAN_RECIPES = {"bf16": "bf16", "fp8": "fp8_delayed", "nvfp4": "nvfp4"}
PRECISIONS = tuple(PLAN_RECIPES)

# Effective GEMM rates in TFLOP/s on one H200 (docs/PERFORMANCE.md, one linear layer at
# M = K = N = 8192, forward + both gradients, quantization passes included): bf16 recipe and
# fp8_delayed as measured; emulated nvfp4 runs BF16 GEMMs, its quantization passes are charged
# as memory traffic (NVFP4_QUANT_BYTES).
MEASURED_H200_TFLOPS = {"bf16": 666.0, "fp8": 1079.0, "nvfp4": 666.0}
# Emulated NVFP4's quantize passes (RHT, stochastic rounding, scales, the FP32 output's cast),
# bytes moved per element of each GEMM operand (x and dY per token, the weight once a
# microbatch): fitted to the whole-model NVFP4 steps of 2026-11-25/27 (docs/PLANNING.md); the
# passes run below HBM bandwidth (one layer's ~2.7 GB took ~1.7 ms on an H100).
NVFP4_QUANT_BYTES = 36.0
# Native FP4 GEMMs (B200) run at the datasheet FP4 peak times the efficiency FP8 reached on H200.
FP4_EFFICIENCY = MEASURED_H200_TFLOPS["fp8"] / DEVICE_PEAKS_TFLOPS["H200"]["fp8"]
# cuDNN flash attention, model FLOPs (causal half) per second on one H200: the Llama-3-8B BF16
# profile spends 283 ms on 1.06e14 attention FLOPs a GPU (docs/PERFORMANCE.md, "What bounds each").
ATTENTION_H200_TFLOPS = 370.0
# Mamba-2's SSD and convolution kernels, charged per SSD matmul FLOP: ~1.8 ms a layer at
# mamba2-1p3b's shapes on one H200 (the profile's kernel times), i.e. ~70 TFLOP/s; they are
# bound by memory traffic and occupancy, so other GPUs scale it by HBM bandwidth.
SSD_H200_TFLOPS = 70.0
# Scanned blocks (train.scan_layers=true) zero and fill stacked residual buffers: dense-1p3b BF16
# 350.9 vs 292.2 ms unrolled (2026-11-23), 329.8 vs 275.0 (2026-11-27) on one H200. Under full
# remat the stack holds only each block's input, and the factor does not apply: the scanned
# nemotron-h-8b steps on 2 and 4 H200s (2026-11-27) were 15-18% faster than the factor made them.
SCANNED_BLOCKS_FACTOR = 1.20

GPUS: dict[str, dict[str, float]] = {
    # memory GB (1e9 bytes), HBM bandwidth TB/s, NVLink GB/s per GPU (one direction)
    "h100": {"memory_gb": 80.0, "hbm_tbs": 3.35, "nvlink_gbs": 450.0},
    "h200": {"memory_gb": 141.0, "hbm_tbs": 4.8, "nvlink_gbs": 450.0},
    "b200": {"memory_gb": 180.0, "hbm_tbs": 8.0, "nvlink_gbs": 900.0},
}
GPUS_PER_NODE = 8  # default of --gpus-per-node
IB_GBS = 50.0  # one 400 Gb/s InfiniBand NIC per GPU
USABLE_MEMORY = 0.90  # the rest goes to the CUDA context, XLA workspace and fragmentation
OVERLAP = 0.70  # fraction of FSDP and data-parallel communication hidden behind compute (capped at the compute time)
# Share of wall-clock time that trains (default of --goodput): failures, restarts from the last
# checkpoint, checkpoint stalls and evaluation take the rest. Llama 3 405B: "higher than 90%
# effective training time" over 54 days with 419 unexpected interruptions (Meta, 2024).
GOODPUT = 0.90

# Bytes per parameter.
MASTER_BYTES, ADAM_BYTES, GRAD_BYTES = 4, 8, 4
# Bytes per element of the working weight copy the GEMMs read (FP4 + one E4M3 scale per 16 for NVFP4).
WORKING_BYTES = {name: spec.weight_bytes for name, spec in SPECS.items()} | {
    column: SPECS[recipe].weight_bytes for column, recipe in PLAN_RECIPES.items()}
# Adam update traffic per parameter: read master, grad, two moments; write master, two moments.
OPTIMIZER_TRAFFIC_BYTES = 4 * 4 + 3 * 4
# Activations kept for the backward pass: maxfp4.model_spec (ACT_BYTES_*, GEMM_OUT_BYTES).
# Per input feature: train.remat=save_gemm_io also keeps each linear layer's activation operand as
# its recipe's backward reads it (FP8 bytes; BF16 for BF16 and for NVFP4, whose wgrad quantizes it
# again along the tokens).
GEMM_IN_BYTES = {name: spec.operand_bytes for name, spec in SPECS.items()} | {
    column: SPECS[recipe].operand_bytes for column, recipe in PLAN_RECIPES.items()}
LOGIT_BYTES = 4  # x vocab per token: the loss streams the logits in FP32 (traffic)
# x vocab per token held at the loss's peak: the BF16 logits kept for the backward pass, their
# BF16 gradient and ~2 more bytes of temporaries. Fitted to measured peaks: with 4 (FP32 logits
# alone) the model was 4-12 GB under every Llama-3-8B peak (docs/PLANNING.md, calibration).
LOGIT_MEMORY_BYTES = 6
# The NVFP4 preset keeps both ends of the stack in BF16 (configs/precision/nvfp4.yaml): its rules,
# resolved against the model's blocks, give the share of block GEMM FLOPs that run at BF16.
NVFP4_PRESET_RULES = ({"layers": ":3%", "recipe": "bf16"}, {"layers": "-12%:", "recipe": "bf16"})


# ----------------------------------------------------------------------------- model counts


@functools.lru_cache(maxsize=64)
def param_count(cfg: ModelConfig) -> int:
    """Every parameter of the real model, from its abstract init (nothing is allocated)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_params(cfg)))


def flops_by_block_type(cfg: ModelConfig, seq_len: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward) split by where they are spent; the sum is
    metrics.flops_per_token, so MFU and the plan count the same work."""
    return model_spec(cfg).flops_by_mixer(seq_len)


def _tensor_share(block: BlockSpec, m: ModelConfig, tensor: int) -> float:
    """The share of a block's work and activations one of ``tensor`` devices has: 1 / tensor,
    except a Mamba-2 block whose groups the tensor axis cannot split (``splits_over_tensor``):
    each tensor device runs that mixer whole."""
    if tensor > 1 and "mamba" in block.mixers and not splits_over_tensor(m, tensor):
        return 1.0
    return 1.0 / tensor


def _tensor_split(lin: LinearSpec) -> tuple[bool, bool]:
    """Whether a stored [K, N] weight (its ``weight_axes``) is split over tensor along K
    (row-parallel layers) and along N (column-parallel ones). Mamba-2's in_proj is split along
    neither: its columns are split only after a reordering (maxfp4.model.mamba)."""
    return tuple(axis is not None and "tensor" in LOGICAL_RULES.get(axis, ())  # type: ignore[return-value]
                 for axis in lin.weight_axes)


def _sharded_over_tensor(lin: LinearSpec) -> bool:
    return any(_tensor_split(lin))


def _row_parallel_layers(m: ModelConfig) -> int:
    """Linear layers whose input (K) is split over tensor (attention's and Mamba-2's output
    projections, the MLP's down projection): each sums its output over the tensor axis."""
    return sum(_tensor_split(lin)[0] for b in model_spec(m).blocks for lin in b.linears)


def _tensor_replicated_params(m: ModelConfig) -> int:
    """Matmul parameters kept whole on every tensor device (Mamba-2's in_proj)."""
    return sum(lin.params for b in model_spec(m).blocks for lin in b.linears if not _sharded_over_tensor(lin))


def state_params_per_device(m: ModelConfig, params: int, fsdp: int, tensor: int) -> float:
    """Parameters one device keeps master weights, moments and gradients for: sharded over
    fsdp x tensor, except those kept whole on every tensor device (over fsdp only)."""
    whole = _tensor_replicated_params(m) if tensor > 1 else 0
    return (params - whole) / (fsdp * tensor) + whole / fsdp


# ----------------------------------------------------------------------------- device rates


def gemm_tflops(gpu: str, precision: str) -> float:
    """Effective GEMM rate: the H200 measurement scaled by the datasheet peak of ``gpu``."""
    peaks = DEVICE_PEAKS_TFLOPS[gpu.upper()]
    peak_class = SPECS[PLAN_RECIPES[precision]].peak
    if peak_class == "fp4" and "fp4" in peaks:
        return peaks["fp4"] * FP4_EFFICIENCY
    peak_key = "bf16" if peak_class == "fp4" else peak_class  # emulated FP4 runs BF16 GEMMs
    return MEASURED_H200_TFLOPS[precision] * peaks[peak_key] / DEVICE_PEAKS_TFLOPS["H200"][peak_key]


def _bf16_peak_ratio(gpu: str) -> float:
    return DEVICE_PEAKS_TFLOPS[gpu.upper()]["bf16"] / DEVICE_PEAKS_TFLOPS["H200"]["bf16"]


def attention_tflops(gpu: str) -> float:
    return ATTENTION_H200_TFLOPS * _bf16_peak_ratio(gpu)


def ssd_tflops(gpu: str) -> float:
    return SSD_H200_TFLOPS * GPUS[gpu]["hbm_tbs"] / GPUS["h200"]["hbm_tbs"]


def datasheet_tflops(gpu: str, precision: str) -> float:
    peaks = DEVICE_PEAKS_TFLOPS[gpu.upper()]
    return peaks.get(SPECS[PLAN_RECIPES[precision]].peak, peaks["bf16"])


@functools.lru_cache(maxsize=64)
def nvfp4_bf16_share(cfg: ModelConfig) -> float:
    """Share of the blocks' GEMM parameters that the NVFP4 preset keeps in BF16."""
    from maxfp4.precision import resolve_policy
    policy = resolve_policy(PrecisionConfig(default="nvfp4", rules=NVFP4_PRESET_RULES), cfg.n_layers)
    spec = model_spec(cfg)
    kept = sum(lin.params for i, block in enumerate(spec.blocks) for lin in block.linears
               if policy.recipe_for(lin.layer_class, i) == "bf16")
    return kept / max(spec.block_matmul_params, 1)


def nvfp4_quant_bytes(cfg: Config, tokens: float) -> float:
    """Bytes the emulated NVFP4 recipe's quantize passes move a step for ``tokens`` a device."""
    spec = model_spec(cfg.model)
    per_token = sum(lin.k + lin.n for b in spec.blocks for lin in b.linears)
    weights = spec.block_matmul_params * cfg.train.microbatches
    return NVFP4_QUANT_BYTES * (1 - nvfp4_bf16_share(cfg.model)) * (tokens * per_token + weights)


def _split_gemm_flops(cfg: ModelConfig, flops: dict[str, float], seq_len: int,
                      precision: str, ssd: float) -> tuple[float, float]:
    """(block GEMM FLOPs at the precision's rate, GEMM FLOPs at BF16): the LM head stays BF16
    in the shipped FP8/NVFP4 policies, as do the NVFP4 preset's end blocks. Attention scores and
    SSD products (``ssd`` a token, as the device runs them) are not GEMMs here (see
    :func:`compute_seconds`)."""
    scores = model_spec(cfg).attention_flops_per_token(seq_len)
    block_gemm = flops["attention"] - scores + flops["mlp"] + flops["mamba"] - ssd
    if precision == "bf16":
        return 0.0, block_gemm + flops["lm_head"]
    tail = nvfp4_bf16_share(cfg) if precision == "nvfp4" else 0.0
    return block_gemm * (1 - tail), block_gemm * tail + flops["lm_head"]


# ----------------------------------------------------------------------------- memory


def _tokens_per_device(cfg: Config, mesh: tuple[int, int, int]) -> float:
    data, fsdp, _ = mesh
    return cfg.data.global_batch * cfg.data.seq_len / (data * fsdp)


def memory_per_device(cfg: Config, mesh: tuple[int, int, int], params: int, precision: str,
                      remat: str) -> dict[str, float]:
    """Bytes per device. State (master, Adam, gradients) is sharded over fsdp x tensor; one
    block's working copy (or the BF16 LM head, whichever is larger) is live at a time, and with
    unrolled blocks under save_gemm every block's cast weight shard too."""
    m = cfg.model
    _, fsdp, tensor = mesh
    spec = model_spec(m)
    blocks = spec.blocks
    share = [_tensor_share(b, m, tensor) for b in blocks]  # of each block's activations, on one device
    # every expert's weights are held (params_total), though a token passes through top_k of them
    weights = [sum(lin.params_total / (tensor if _sharded_over_tensor(lin) else 1) for lin in b.linears) for b in blocks]
    working = max(max(weights) * WORKING_BYTES[precision], spec.lm_head.params * 2 / tensor)
    if remat in ("save_gemm", "save_gemm_io") and not cfg.train.scan_layers:
        # Unrolled blocks keep every block's cast weight shard for the backward pass (maxfp4.model.remat).
        working += sum(weights) * WORKING_BYTES[precision] / fsdp
    tokens = _tokens_per_device(cfg, mesh) / cfg.train.microbatches
    per_token = sum(s * spec.activation_bytes_per_token(b, remat, GEMM_IN_BYTES[precision])
                    for b, s in zip(blocks, share))
    if remat != "none":  # the block being recomputed holds its activations
        per_token += spec.activation_bytes_per_token(blocks[0], "none") * max(share)
    acts = tokens * per_token
    logits = tokens * m.vocab_size * LOGIT_MEMORY_BYTES / tensor / cfg.train.loss_chunks
    state = state_params_per_device(m, params, fsdp, tensor)
    return {"master": state * MASTER_BYTES, "adam": state * ADAM_BYTES,
            # with microbatches, the FP32 accumulator and one microbatch's gradients (maxfp4.step)
            "grads": state * GRAD_BYTES * (2 if cfg.train.microbatches > 1 else 1),
            "working_copy": working,
            "activations": acts, "logits": logits}


# ----------------------------------------------------------------------------- time


def _non_gemm_bytes_per_token(m: ModelConfig, recompute: bool = False, tensor: int = 1) -> float:
    """Elementwise traffic (norms, residuals, RoPE, gates, conv, softmax of the loss) on one of
    ``tensor`` devices, per token of its rows: a block reads and writes about 10 x d_model + 3 x
    its widest intermediate BF16 values forward, and the backward pass moves twice that (with
    remat, the forward's share once more), a block the tensor axis splits 1 / tensor of it; the
    loss moves the FP32 logits about 4 times, split over tensor by vocabulary."""
    passes = 4 if recompute else 3
    total = 0.0
    for block in model_spec(m).blocks:
        wide = max(lin.params for lin in block.linears) / m.d_model
        total += passes * 2 * (10 * m.d_model + 3 * wide) * _tensor_share(block, m, tensor)
    return total + 4 * LOGIT_BYTES * m.vocab_size / tensor


def _link_gbs(gpu: str, span: int, gpus_per_node: int = GPUS_PER_NODE) -> float:
    """Bandwidth of a collective over ``span`` consecutive GPUs: NVLink inside a node, IB across."""
    return GPUS[gpu]["nvlink_gbs"] if span <= gpus_per_node else IB_GBS


def comm_seconds(cfg: Config, mesh: tuple[int, int, int], params: int, precision: str, gpu: str,
                 gpus_per_node: int = GPUS_PER_NODE) -> tuple[float, float]:
    """Ring collectives per step, bytes per device / link bandwidth, as (exposed, overlappable)
    seconds. Axes are laid out tensor innermost, then fsdp, then data (maxfp4.parallel.mesh), so an axis
    crosses nodes once the product of it and the axes inside it exceeds a node.

    Tensor parallelism's activation all-reduces are exposed: each sums a GEMM's output that the
    next operation (a norm, the residual) needs at once, so there is no independent work to hide
    them behind. FSDP's weight gathers (fetched ahead of the layer that needs them) and the
    gradient reduce-scatters and all-reduces (of finished layers) overlap with compute; FSDP
    gathers and reduce-scatters once a microbatch."""
    data, fsdp, tensor = mesh
    m = cfg.model
    exposed = overlappable = 0.0
    state = state_params_per_device(m, params, fsdp, tensor)  # the shard each device keeps
    if tensor > 1:  # per row-parallel layer: its output forward, its sublayer input's gradient backward
        ar = 2 * (tensor - 1) / tensor * _tokens_per_device(cfg, mesh) * m.d_model * 2
        exposed += 2 * _row_parallel_layers(m) * ar / (_link_gbs(gpu, tensor, gpus_per_node) * 1e9)
    if fsdp > 1:  # weights gathered forward and again backward, FP32 gradients reduce-scattered
        per_device = state * (fsdp - 1) * cfg.train.microbatches
        overlappable += per_device * (2 * WORKING_BYTES[precision] + GRAD_BYTES) / (
            _link_gbs(gpu, tensor * fsdp, gpus_per_node) * 1e9)
    experts = cfg.mesh.expert
    if experts > 1 and "E" in m.pattern:  # the E blocks' token all-to-alls, which the experts wait for
        per_token = model_spec(m).moe_dispatch_bytes_per_token(m.moe.top_k)
        a2a = (experts - 1) / experts * _tokens_per_device(cfg, mesh) * per_token
        exposed += a2a / (_link_gbs(gpu, experts * tensor, gpus_per_node) * 1e9)
    if data > 1:  # all-reduce of each device's FP32 gradient shard
        shard = state * GRAD_BYTES
        overlappable += 2 * (data - 1) / data * shard / (_link_gbs(gpu, data * fsdp * tensor, gpus_per_node) * 1e9)
    return exposed, overlappable


def compute_seconds(cfg: Config, mesh: tuple[int, int, int], flops: dict[str, float], params: int,
                    precision: str, gpu: str, utilisation: float | None) -> float:
    """GEMMs at the precision's effective rate (the LM head at BF16), attention at cuDNN's rate,
    Mamba-2's SSD at its kernels' rate, elementwise work at HBM bandwidth; or, given a measured
    utilisation, all FLOPs at that fraction of the peak."""
    m = cfg.model
    tensor = mesh[2]
    rows = _tokens_per_device(cfg, mesh)  # tokens of the rows a device holds
    tokens = rows / tensor  # tensor parallelism splits each token's work over its devices,
    ssd = model_spec(m).ssd_flops_per_token()
    if tensor > 1 and not splits_over_tensor(m, tensor):  # except a Mamba-2 mixer it cannot split
        flops = dict(flops, mamba=flops["mamba"] * tensor)
        ssd *= tensor
    fast, slow = _split_gemm_flops(m, flops, cfg.data.seq_len, precision, ssd)
    scores = model_spec(m).attention_flops_per_token(cfg.data.seq_len)
    if utilisation is not None:
        peak = datasheet_tflops(gpu, precision) * 1e12
        slow += scores + ssd
        return tokens * (fast / (utilisation * peak) + slow / (utilisation * datasheet_tflops(gpu, "bf16") * 1e12))
    lm_head = flops["lm_head"]
    recompute = 4 / 3  # one more forward pass: a third of a layer's training FLOPs
    if cfg.train.remat == "full":  # the blocks' forward runs again
        fast, slow = fast * recompute, lm_head + (slow - lm_head) * recompute
        scores, ssd = scores * recompute, ssd * recompute
    elif cfg.train.remat != "none":  # save_gemm keeps the GEMM outputs; the Mamba-2 kernels run again
        ssd *= recompute
    if cfg.train.loss_chunks > 1:  # each slice's LM head runs again in the backward pass
        slow += lm_head / 3
    gemm = tokens * (fast / (gemm_tflops(gpu, precision) * 1e12) + slow / (gemm_tflops(gpu, "bf16") * 1e12))
    if precision == "nvfp4" and "fp4" not in DEVICE_PEAKS_TFLOPS[gpu.upper()]:
        gemm += nvfp4_quant_bytes(cfg, tokens) / (GPUS[gpu]["hbm_tbs"] * 1e12)
    kernels = tokens * (scores / (attention_tflops(gpu) * 1e12) + ssd / (ssd_tflops(gpu) * 1e12))
    hbm = GPUS[gpu]["hbm_tbs"] * 1e12
    elementwise = rows * _non_gemm_bytes_per_token(m, cfg.train.remat != "none", tensor) / hbm
    optimizer = state_params_per_device(m, params, mesh[1], tensor) * OPTIMIZER_TRAFFIC_BYTES / hbm
    blocks = gemm + kernels + elementwise
    if cfg.train.scan_layers and cfg.train.remat != "full":
        blocks *= SCANNED_BLOCKS_FACTOR
    return blocks + optimizer


def step_seconds(compute: float, exposed_comm: float, overlappable_comm: float) -> float:
    hidden = min(OVERLAP * overlappable_comm, compute)
    return compute + exposed_comm + overlappable_comm - hidden


# ----------------------------------------------------------------------------- the plan


def read_utilisation(path: str, gpu: str) -> float:
    """Utilisation from a results file: the last record with ``mfu``, or ``tflops_per_device``
    over the BF16 peak; a JSON document, a JSON list, or JSON lines (metrics.jsonl)."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise UserError(f"--mfu-from {path}: {e.strerror}") from None
    try:
        records = [json.loads(text)]
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError:
            raise UserError(f"--mfu-from {path}: not JSON or JSON lines") from None
    found = _find_fields(records)
    if found is None:
        raise UserError(f"--mfu-from {path}: no 'mfu' or 'tflops_per_device' field")
    key, value = found
    u = value if key == "mfu" else value / DEVICE_PEAKS_TFLOPS[gpu.upper()]["bf16"]
    if not 0 < u <= 1:
        raise UserError(f"--mfu-from {path}: utilisation {u:.3f} from {key!r} is not in (0, 1]")
    return u


def _find_fields(node: Any) -> tuple[str, float] | None:
    """The last numeric ``mfu`` (preferred) or ``tflops_per_device`` found depth-first."""
    found = None
    if isinstance(node, list):
        for item in node:
            found = _find_fields(item) or found
    elif isinstance(node, dict):
        for key in ("mfu", "tflops_per_device"):
            if isinstance(node.get(key), (int, float)) and not isinstance(node.get(key), bool):
                return key, float(node[key])
        for value in node.values():
            found = _find_fields(value) or found
    return found


def project(cfg: Config, mesh: tuple[int, int, int], gpu: str, precision: str,
            utilisation: float | None = None, gpus_per_node: int = GPUS_PER_NODE) -> dict:
    """One precision's memory and step time for ``cfg`` (its batch, remat, microbatches) on ``mesh``."""
    m = cfg.model
    params = param_count(m)
    flops = flops_by_block_type(m, cfg.data.seq_len)
    mem = memory_per_device(cfg, mesh, params, precision, cfg.train.remat)
    compute = compute_seconds(cfg, mesh, flops, params, precision, gpu, utilisation)
    exposed, overlappable = comm_seconds(cfg, mesh, params, precision, gpu, gpus_per_node)
    comm = exposed + overlappable
    step = step_seconds(compute, exposed, overlappable)
    tokens_per_step = cfg.data.global_batch * cfg.data.seq_len
    other_remat = "full" if cfg.train.remat == "none" else "none"
    return {
        "precision": precision, "gpu": gpu, "gpus": math.prod(mesh),
        "mesh": dict(zip(("data", "fsdp", "tensor"), mesh)),
        "params": params, "matmul_params": model_spec(m).matmul_params,
        "flops_per_token": sum(flops.values()), "flops_per_token_by_block": flops,
        "memory_per_device_gb": sum(mem.values()) / 1e9,
        "memory_breakdown_gb": {k: v / 1e9 for k, v in mem.items()},
        "memory_other_remat_gb": sum(memory_per_device(cfg, mesh, params, precision, other_remat).values()) / 1e9,
        "remat": cfg.train.remat, "microbatches": cfg.train.microbatches,
        "global_batch": cfg.data.global_batch,
        "fits": sum(mem.values()) / 1e9 <= USABLE_MEMORY * GPUS[gpu]["memory_gb"],
        "tokens_per_step": tokens_per_step,
        "compute_s": compute, "comm_s": comm, "step_time_s": step,
        # model FLOPs over the BF16 peak while training (goodput not included), as metrics.py reports MFU
        "mfu": sum(flops.values()) * tokens_per_step / step / math.prod(mesh) / (datasheet_tflops(gpu, "bf16") * 1e12),
    }


def rows_for(layout, gpus: int, gpu: str, tokens: float, utilisation: float | None,
             gpus_per_node: int, goodput: float) -> list[dict]:
    """The plan of each precision for a layout (maxfp4.plan.layout.Layout)."""
    rows = []
    for precision in PRECISIONS:
        row = project(layout.cfg, layout.mesh, gpu, precision, utilisation, gpus_per_node)
        steps = math.ceil(tokens / row["tokens_per_step"])
        wall = steps * row["step_time_s"] / goodput
        row.update(steps=steps, days=wall / 86400, gpu_hours=wall * gpus / 3600, goodput=goodput,
                   utilisation_from_file=utilisation, layout_chosen=layout.chosen, notes=list(layout.reasons))
        rows.append(row)
    return rows
