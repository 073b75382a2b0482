"""The planner's cost model: parameters, FLOPs, memory per device, communication, compute and
step time of a run on a mesh of GPUs, for each precision column (``python -m maxfp4.plan`` and
maxfp4.plan.layout read it). Every formula and constant is stated in docs/PLANNING.md; the
constants below and in maxfp4.plan.rates carry the same names.
"""

from __future__ import annotations

import functools
import math

import jax

from maxfp4.config import Config, ModelConfig, PrecisionConfig
from maxfp4.parallel.mesh import LOGICAL_RULES
from maxfp4.metrics import DEVICE_PEAKS_TFLOPS
from maxfp4.model import abstract_params
from maxfp4.model_spec import (BlockSpec, LinearSpec, model_spec,
                               mamba_splits_over_tensor as splits_over_tensor)
from maxfp4.plan.rates import GPUS, PLAN_RECIPES, PRECISIONS, attention_tflops, datasheet_tflops, gemm_tflops, ssd_tflops
from maxfp4.parallel.pipeline_schedule import bubble_fraction, ticks
from maxfp4.parallel.pipeline_stages import (StageSplit, alike_blocks, block_flop_parts, block_flops, held_rows, split_stages,
                                             stage_program)
from maxfp4.plan.stages import PlanMesh
from maxfp4.precision.catalog import SPECS
from maxfp4.precision.policy import PrecisionPolicy, resolve_policy

# Emulated NVFP4's quantize passes (RHT, stochastic rounding, scales, the FP32 output's cast),
# bytes moved per element of each GEMM operand (x and dY per token, the weight once a
# microbatch): fitted to the whole-model NVFP4 steps of 2026-11-25/27 (docs/PLANNING.md); the
# passes run below HBM bandwidth (one layer's ~2.7 GB took ~1.7 ms on an H100).
NVFP4_QUANT_BYTES = 36.0
# Scanned blocks (train.scan_layers=true) zero and fill stacked residual buffers: dense-1p3b BF16
# 350.9 vs 292.2 ms unrolled (2026-11-23), 329.8 vs 275.0 (2026-11-27) on one H200. Under full
# remat the stack holds only each block's input, and the factor does not apply: the scanned
# nemotron-h-8b steps on 2 and 4 H200s (2026-11-27) were 15-18% faster than the factor made them.
SCANNED_BLOCKS_FACTOR = 1.20

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
# Gradient accumulation per parameter each time a microbatch's (or a pipeline tick's) gradient is
# added: read the FP32 accumulator and the new gradient, write the sum. The pipeline's ticks are
# one scan that autodiff reverses, and a scan's transpose adds the cotangent of every parameter
# it closes over into its carry each iteration: every tick, on every stage, for the stage's
# blocks and for the embedding and LM head each stage holds.
ACCUMULATE_BYTES = 3 * 4
# With stages, more traffic a tick per parameter every stage holds whole (the embedding, LM head
# and norms) on top of ACCUMULATE_BYTES: each tick embeds, runs the head's cond (the last stage's
# loss) and takes their cotangents as fresh FP32 tensors, on every stage, bubble ticks included.
# Fitted to the three pipelined dense-1p3b steps on cuDNN's attention (two H200s, 2026-11-28:
# 278.0, 503.5 and 551.7 ms at 9, 9 and 17 ticks): each missed ~6.2 ms a tick, whatever its
# chunk's size (12 blocks, or 6 with repeats) or its tokens (2 x 1,024 or 2 x 2,048); the embedding
# and LM head (525M parameters) are what every tick touches alike. Not yet split by a profile.
WHOLE_PER_TICK_BYTES = 56.0
# Activations kept for the backward pass: maxfp4.model_spec (ACT_BYTES_*, GEMM_OUT_BYTES).
# Per input feature: train.remat=save_gemm_io also keeps each linear layer's activation operand as
# its recipe's backward reads it (FP8 bytes; BF16 for BF16 and for NVFP4, whose wgrad quantizes it
# again along the tokens).
GEMM_IN_BYTES = {name: spec.operand_bytes for name, spec in SPECS.items()} | {
    column: SPECS[recipe].operand_bytes for column, recipe in PLAN_RECIPES.items()}
LOGIT_BYTES = 4  # x vocab per token: the loss streams the logits in FP32 (traffic)
# x vocab per token held at the loss's peak: the BF16 logits kept for the backward pass and their
# BF16 gradient (maxfp4.model.loss writes it once, in the logits' dtype). The 6 of earlier
# versions stood in for the Llama-3-8B rows' missing working copies (see memory_per_device).
LOGIT_MEMORY_BYTES = 4
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


def _whole_on_tensor(lin: LinearSpec, m: ModelConfig, tensor: int) -> bool:
    """Whether each of ``tensor`` devices keeps the whole weight: Mamba-2's in_proj where the
    tensor axis cannot split the mixer (stored group by group, its z, x, B, C and dt parts split
    with their groups whenever ``splits_over_tensor``; maxfp4.model.mamba_layout)."""
    if tensor == 1:
        return False
    if lin.layer_class == "mamba_in":
        return not splits_over_tensor(m, tensor)
    return not _sharded_over_tensor(lin)


@functools.lru_cache(maxsize=256)
def _block_matmul_params(m: ModelConfig) -> int:
    """The blocks' matmul parameters as stored (every expert): the rest of the model's
    parameters (embedding, LM head, norms, SSM scalars) is ``params`` less these."""
    return sum(b.matmul_params_total for b in model_spec(m).blocks)


def stage_split(cfg: Config, mesh: PlanMesh) -> StageSplit:
    """The blocks of each pipeline stage: the stack cut into pipeline x repeats chunks balanced by
    each block's training FLOPs (on the layouts the trainer runs, its own equal cut)."""
    return _stage_split(cfg.model, cfg.data.seq_len, mesh.pipeline, mesh.repeats)


@functools.lru_cache(maxsize=1024)  # the layout search asks again for every microbatch count
def _stage_split(m: ModelConfig, seq_len: int, stages: int, repeats: int) -> StageSplit:
    return split_stages(block_flops(m, seq_len), stages, repeats)


@functools.lru_cache(maxsize=4096)
def _held(m: ModelConfig, seq_len: int, stages: int, repeats: int) -> tuple[int, ...]:
    """The blocks whose activations the busiest device keeps (all blocks without stages): alike
    stages, those of its own chunks; unequal stages, a block of each slot of its stages (a
    skipped slot keeps zeroed residual buffers the size of the block it skips: a conditional's
    residuals are both branches')."""
    blocks = model_spec(m).blocks
    if stages == 1:
        return tuple(range(len(blocks)))
    if alike_blocks(m, stages * repeats):
        split = _stage_split(m, seq_len, stages, repeats)
        return max((split.device_blocks(p) for p in range(stages)),
                   key=lambda device: sum(blocks[b].matmul_params for b in device))
    program = stage_program(m, None, seq_len, stages, repeats)
    return tuple(program.slot_block(l) for l in range(len(program.slots))) * repeats


def _held_blocks(cfg: Config, mesh: PlanMesh) -> tuple[int, ...]:
    return _held(cfg.model, cfg.data.seq_len, mesh.pipeline, mesh.repeats)


def expert_ways(cfg: Config) -> int:
    """Devices ``mesh.expert`` splits an E block's experts over (1 without E blocks). Outside the
    experts the axis splits the batch, which the planner models as data (resolve_mesh_shape)."""
    return max(cfg.mesh.expert, 1) if "E" in cfg.model.pattern else 1


def _block_weights_on_device(block: BlockSpec, m: ModelConfig, tensor: int, experts: int = 1) -> float:
    """A block's matmul weights on one of ``tensor`` devices: every expert's of the 1/``experts``
    the device holds (what memory holds, though a token passes through top_k of them), 1/tensor
    of those tensor splits."""
    return sum(lin.params_total / (1 if _whole_on_tensor(lin, m, tensor) else tensor) / (experts if lin.experts else 1)
               for lin in block.linears)


def gathered_stage_params(cfg: Config, mesh) -> float:
    """Parameters of the copy of its stages' block weights a device gathers at the start of a
    step (:mod:`maxfp4.parallel.pipeline`), over fsdp x tensor as its state: with repeats its V
    stages (an all-to-all), with unequal stages a block of every slot (the skipped slots' rows
    padded); none for GPipe's alike stages, which read their part of the stacks in place."""
    mesh = PlanMesh(*mesh)
    if mesh.pipeline == 1 or (mesh.repeats == 1 and alike_blocks(cfg.model, mesh.pipeline)):
        return 0.0
    blocks = model_spec(cfg.model).blocks
    return sum(_block_weights_on_device(blocks[b], cfg.model, mesh.tensor, expert_ways(cfg))
               for b in _held_blocks(cfg, mesh)) / mesh.fsdp


@functools.lru_cache(maxsize=4096)
def _held_block_params(m: ModelConfig, seq_len: int, stages: int, repeats: int, tensor: int,
                       experts: int) -> tuple[float, float]:
    """(matmul parameters, those kept whole on every tensor device) a device keeps state for: its
    1/``stages`` of each block type's stack (:func:`maxfp4.parallel.pipeline_stages.held_rows`:
    its rows, or of every row where the pipeline degree does not divide the stack), of an E block
    every expert of the 1/``experts`` it holds."""
    blocks = model_spec(m).blocks
    held = whole = 0
    for group, rows in held_rows(m, stages).items():
        linears = next(b for b in blocks if b.group == group).linears
        stored = {lin.name: lin.params_total / (experts if lin.experts else 1) for lin in linears}
        held += rows * sum(stored.values())
        whole += rows * sum(stored[lin.name] for lin in linears if _whole_on_tensor(lin, m, tensor))
    return held, whole


def state_params_per_device(cfg: Config, params: int, mesh) -> float:
    """Parameters one device keeps master weights, moments and gradients for: its stage's block
    weights sharded over fsdp x tensor, except those kept whole on every tensor device (over fsdp
    only); the embedding, the LM head, norms and SSM scalars on every stage (the stages hold them
    whole over ``pipeline``, maxfp4.parallel.pipeline) over fsdp x tensor."""
    m, mesh = cfg.model, PlanMesh(*mesh)
    held, whole = _held_block_params(m, cfg.data.seq_len, mesh.pipeline, mesh.repeats, mesh.tensor, expert_ways(cfg))
    other = params - _block_matmul_params(m)
    return (held - whole + other) / (mesh.fsdp * mesh.tensor) + whole / mesh.fsdp


# ----------------------------------------------------------------------------- device rates


def runs_xla_attention(cfg: Config) -> bool:
    """Whether the step runs XLA's attention: when asked for (model.attention=xla), and in
    pipeline stages whose rows may hold several documents (any data but synthetic rows of one,
    or the masked kernel asked for), where cuDNN's packed and masked kernels do not compile
    (maxfp4.model.attention.stage_implementation). Elsewhere on GPU ``auto`` is cuDNN's fused
    kernel, context ranks and stages of one-document rows included: it is bound inside their
    shard_map through its primitives (maxfp4.kernels.cudnn_attention)."""
    if cfg.model.attention == "xla":
        return True
    return cfg.mesh.pipeline > 1 and (cfg.data.source != "synthetic" or cfg.model.attention == "cudnn_mask")


@functools.lru_cache(maxsize=64)
def nvfp4_preset_policy(cfg: ModelConfig) -> PrecisionPolicy:
    """The NVFP4 preset's recipes for each of the model's blocks (the nvfp4 row prices them)."""
    return resolve_policy(PrecisionConfig(default="nvfp4", rules=NVFP4_PRESET_RULES), cfg.n_layers)


@functools.lru_cache(maxsize=64)
def nvfp4_bf16_share(cfg: ModelConfig) -> float:
    """Share of the blocks' GEMM parameters that the NVFP4 preset keeps in BF16."""
    policy = nvfp4_preset_policy(cfg)
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


def _tokens_per_device(cfg: Config, mesh) -> float:
    """Tokens of the rows one device holds a step: the batch over data x fsdp (every pipeline
    stage and tensor rank of a batch shard sees all of its rows)."""
    return cfg.data.global_batch * cfg.data.seq_len / PlanMesh(*mesh).batch_shards


def in_flight_share(cfg: Config, mesh) -> float:
    """Share of a device's rows whose activations are held at once: one microbatch's without
    stages (the step accumulates them one by one); with stages, every microbatch's and the fill
    and drain ticks' (V M + P - 1 ticks of 1/(V M) each): the schedules run as one scan over the
    ticks that autodiff reverses, so nothing is freed before the backward pass (a 1F1B order
    would hold ~P microbatches; it is not what the trainer runs)."""
    mesh, micro = PlanMesh(*mesh), cfg.train.microbatches
    if mesh.pipeline == 1:
        return 1 / micro
    return ticks(mesh.pipeline, micro, mesh.repeats, mesh.lag) / (mesh.repeats * micro)


def memory_per_device(cfg: Config, mesh, params: int, precision: str,
                      remat: str) -> dict[str, float]:
    """Bytes per device. State (master, Adam, gradients) is sharded over fsdp x tensor, and a
    pipeline stage keeps its own blocks' (:func:`state_params_per_device`); one block's working
    copy (or the BF16 LM head, whichever is larger) is live at a time; without remat, and with
    unrolled blocks under save_gemm, every block's cast weight shard too (the recipes' VJPs keep
    it: ``GEMM_WEIGHT``). Gradients count whole: the backward pass writes each block's into
    buffers allocated when it starts, while the activations are still held. With stages whose
    weights are gathered each step (:func:`gathered_stage_params`), their FP32 copy and its
    FP32 gradient, which goes back to the checkpoint's layout when the backward pass ends."""
    m, mesh = cfg.model, PlanMesh(*mesh)
    fsdp, tensor = mesh.fsdp, mesh.tensor
    spec = model_spec(m)
    blocks = [spec.blocks[b] for b in _held_blocks(cfg, mesh)]
    share = [_tensor_share(b, m, tensor) for b in blocks]  # of each block's activations, on one device
    weights = [_block_weights_on_device(b, m, tensor, expert_ways(cfg)) for b in blocks]
    working = max(max(weights) * WORKING_BYTES[precision], spec.lm_head.params * 2 / tensor)
    if remat == "none" or (remat in ("save_gemm", "save_gemm_io") and not cfg.train.scan_layers):
        # Without remat every recipe's VJP keeps its cast weight shard as a residual; unrolled
        # blocks under save_gemm keep it by name (maxfp4.model.remat). Scanned save_gemm recasts.
        working += sum(weights) * WORKING_BYTES[precision] / fsdp
    rows = _tokens_per_device(cfg, mesh)
    tokens = rows / cfg.train.microbatches  # one microbatch
    per_token = sum(s * spec.activation_bytes_per_token(b, remat, GEMM_IN_BYTES[precision])
                    for b, s in zip(blocks, share))
    acts = rows * in_flight_share(cfg, mesh) * per_token
    if remat != "none":  # the block being recomputed holds its activations
        acts += tokens * spec.activation_bytes_per_token(blocks[0], "none") * max(share)
    logits = tokens * m.vocab_size * LOGIT_MEMORY_BYTES / tensor / cfg.train.loss_chunks
    state = state_params_per_device(cfg, params, mesh)
    # mesh.shard_optimizer_over_data: each data replica keeps 1/data of the moments (ZeRO-1)
    adam = state * ADAM_BYTES / (mesh.data if mesh.shard_optimizer else 1)
    return {"master": state * MASTER_BYTES, "adam": adam,
            # with microbatches, the FP32 accumulator and one microbatch's gradients (maxfp4.step);
            # stages take every microbatch's gradient in one backward pass, into one buffer
            "grads": state * GRAD_BYTES * (2 if cfg.train.microbatches > 1 and mesh.pipeline == 1 else 1),
            "working_copy": working,
            "gathered_stages": gathered_stage_params(cfg, mesh) * (MASTER_BYTES + GRAD_BYTES),
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


def stage_factor(cfg: Config, mesh, precision: str, gpu: str) -> float:
    """A device's block time with stages over the time of all blocks on its rows: (V M + P - 1)
    ticks, each as long as the costliest chunk on one microbatch
    (:meth:`maxfp4.parallel.pipeline_stages.StageSplit.step_factor`); 1 without stages. The
    chunks are cut by FLOPs and timed by :func:`block_seconds_per_token`."""
    mesh = PlanMesh(*mesh)
    if mesh.pipeline == 1:
        return 1.0
    costs = block_seconds_per_token(cfg, mesh.tensor, precision, gpu)
    return stage_split(cfg, mesh).step_factor(costs, cfg.train.microbatches, mesh.lag)


def comm_seconds(cfg: Config, mesh, params: int, precision: str, gpu: str,
                 gpus_per_node: int = GPUS_PER_NODE) -> tuple[float, float]:
    """Ring collectives per step, bytes per device / link bandwidth, as (exposed, overlappable)
    seconds. Axes are laid out tensor innermost, then fsdp, then pipeline, then data
    (maxfp4.parallel.mesh), so an axis crosses nodes once the product of it and the axes inside
    it exceeds a node.

    Tensor parallelism's activation all-reduces are exposed: each sums a GEMM's output that the
    next operation (a norm, the residual) needs at once, so there is no independent work to hide
    them behind. So are the pipeline's hand-overs: a stage sends its output when the tick ends
    and the next stage waits for it, unless ``mesh.pipeline_overlap`` sends it during the next
    tick (then they overlap like FSDP's, in a longer schedule). FSDP's weight gathers (fetched ahead of the layer that needs
    them) and the gradient reduce-scatters and all-reduces (of finished layers) overlap with
    compute; FSDP gathers and reduce-scatters once a microbatch (with stages, once a tick). With
    the moments split over data (``mesh.shard_optimizer_over_data``) the all-reduce is a
    reduce-scatter and an all-gather of the updated weights, which ends the step: exposed."""
    m, mesh = cfg.model, PlanMesh(*mesh)
    data, fsdp, tensor, stages = mesh.data, mesh.fsdp, mesh.tensor, mesh.pipeline
    micro = cfg.train.microbatches
    exposed = overlappable = 0.0
    state = state_params_per_device(cfg, params, mesh)  # the shard each device keeps
    rows = _tokens_per_device(cfg, mesh)
    if tensor > 1:  # per row-parallel layer: its output forward, its sublayer input's gradient backward
        ar = 2 * (tensor - 1) / tensor * rows * m.d_model * 2
        exposed += (2 * _row_parallel_layers(m) * ar * stage_factor(cfg, mesh, precision, gpu)
                    / (_link_gbs(gpu, tensor, gpus_per_node) * 1e9))
    if stages > 1:  # each tick hands a microbatch's BF16 activations on, and its gradient back
        handed = 2 * ticks(stages, micro, mesh.repeats, mesh.lag) * rows / micro * m.d_model * 2
        if tensor > 1 and m.d_model % tensor == 0:
            # each tensor rank sends 1/tensor of it, and the receiver gathers the rest in the node
            handover = (handed / tensor / (_link_gbs(gpu, stages * fsdp * tensor, gpus_per_node) * 1e9)
                        + handed * (tensor - 1) / tensor / (_link_gbs(gpu, tensor, gpus_per_node) * 1e9))
        else:
            handover = handed / (_link_gbs(gpu, stages * fsdp * tensor, gpus_per_node) * 1e9)
        if mesh.overlap:  # sent (and gathered) during the next tick, beside its compute
            overlappable += handover
        else:
            exposed += handover
    if fsdp > 1:  # weights gathered forward and again backward, FP32 gradients reduce-scattered
        other = (params - _block_matmul_params(m)) / (fsdp * tensor)
        gathers = micro if stages == 1 else ticks(stages, micro, mesh.repeats, mesh.lag) / mesh.repeats
        per_device = ((state - other) * gathers + other * micro) * (fsdp - 1)
        overlappable += per_device * (2 * WORKING_BYTES[precision] + GRAD_BYTES) / (
            _link_gbs(gpu, tensor * fsdp, gpus_per_node) * 1e9)
    if stages > 1:  # the embedding's and LM head's gradients summed over the stages that hold them
        other = (params - _block_matmul_params(m)) / (fsdp * tensor) * GRAD_BYTES
        overlappable += 2 * (stages - 1) / stages * other / (
            _link_gbs(gpu, stages * fsdp * tensor, gpus_per_node) * 1e9)
    experts = cfg.mesh.expert
    if experts > 1 and "E" in m.pattern:  # the E blocks' token all-to-alls, which the experts wait for
        per_token = model_spec(m).moe_dispatch_bytes_per_token(m.moe.top_k)
        a2a = (experts - 1) / experts * _tokens_per_device(cfg, mesh) * per_token
        exposed += a2a / (_link_gbs(gpu, experts * tensor, gpus_per_node) * 1e9)
    if data > 1:  # all-reduce of each device's FP32 gradient shard
        shard = state * GRAD_BYTES
        link = _link_gbs(gpu, mesh.devices, gpus_per_node) * 1e9
        if mesh.shard_optimizer:
            # the same bytes as a reduce-scatter (beside the backward pass) and an all-gather of
            # the updated FP32 weights, which ends the step with nothing left to hide it behind
            overlappable += (data - 1) / data * shard / link
            exposed += (data - 1) / data * state * MASTER_BYTES / link
        else:
            overlappable += 2 * (data - 1) / data * shard / link
    return exposed, overlappable


def block_seconds_per_token(cfg: Config, tensor: int, precision: str, gpu: str) -> tuple[float, ...]:
    """Seconds each block takes a token on one of ``tensor`` devices, training: its GEMMs at the
    precision's rate, attention's products at the rate of the attention the step runs, the SSD's
    at its kernels', its element-wise traffic at HBM bandwidth (the weights that time the
    pipeline's chunks)."""
    return _block_seconds(cfg.model, cfg.data.seq_len, tensor, precision, gpu, runs_xla_attention(cfg))


@functools.lru_cache(maxsize=1024)  # the layout search asks again for every mesh
def _block_seconds(m: ModelConfig, seq_len: int, tensor: int, precision: str, gpu: str,
                   xla: bool) -> tuple[float, ...]:
    spec = model_spec(m)
    rate = gemm_tflops(gpu, "bf16" if precision == "nvfp4" else precision) * 1e12
    out = []
    for b, (gemm, scores, ssd) in zip(spec.blocks, block_flop_parts(spec, seq_len)):
        wide = max(lin.params for lin in b.linears) / m.d_model
        t = (gemm / rate + scores / (attention_tflops(gpu, xla) * 1e12) + ssd / (ssd_tflops(gpu) * 1e12)
             + 6 * (10 * m.d_model + 3 * wide) / (GPUS[gpu]["hbm_tbs"] * 1e12))
        out.append(t * _tensor_share(b, m, tensor))
    return tuple(out)


def stage_whole_params(cfg: Config, mesh, params: int) -> float:
    """Parameters a device holds whole over ``pipeline`` (embedding, LM head, norms; their
    fsdp x tensor shard), each touched every tick: 0 without stages."""
    mesh = PlanMesh(*mesh)
    if mesh.pipeline == 1:
        return 0.0
    return (params - _block_matmul_params(cfg.model)) / (mesh.fsdp * mesh.tensor)


def accumulated_params(cfg: Config, mesh, params: int, state: float) -> float:
    """Parameters whose FP32 gradient a device adds into an accumulator a step: its shard once a
    microbatch (none with one microbatch); with stages, once a tick, the blocks of one chunk."""
    mesh, micro = PlanMesh(*mesh), cfg.train.microbatches
    if mesh.pipeline == 1:
        return state * micro if micro > 1 else 0.0
    other = (params - _block_matmul_params(cfg.model)) / (mesh.fsdp * mesh.tensor)
    n = ticks(mesh.pipeline, micro, mesh.repeats, mesh.lag)
    return (state - other) * n / mesh.repeats + other * n


def compute_parts(cfg: Config, mesh, flops: dict[str, float], params: int,
                  precision: str, gpu: str, utilisation: float | None) -> dict[str, float]:
    """Seconds a step of one device spends in the blocks, the LM head and loss, and the optimizer,
    for all blocks on its rows (:func:`stage_factor` turns the blocks' into a stage's). GEMMs at
    the precision's effective rate (the LM head at BF16), attention at cuDNN's rate, Mamba-2's SSD
    at its kernels' rate, elementwise work at HBM bandwidth; or, given a measured utilisation, all
    FLOPs at that fraction of the peak."""
    m, mesh = cfg.model, PlanMesh(*mesh)
    tensor = mesh.tensor
    rows = _tokens_per_device(cfg, mesh)  # tokens of the rows a device holds
    tokens = rows / tensor  # tensor parallelism splits each token's work over its devices,
    ssd = model_spec(m).ssd_flops_per_token()
    if tensor > 1 and not splits_over_tensor(m, tensor):  # except a Mamba-2 mixer it cannot split
        flops = dict(flops, mamba=flops["mamba"] * tensor)
        ssd *= tensor
    fast, slow = _split_gemm_flops(m, flops, cfg.data.seq_len, precision, ssd)
    scores = model_spec(m).attention_flops_per_token(cfg.data.seq_len)
    lm_head = flops["lm_head"]
    hbm = GPUS[gpu]["hbm_tbs"] * 1e12
    state = state_params_per_device(cfg, params, mesh)
    optimizer = (state * OPTIMIZER_TRAFFIC_BYTES + accumulated_params(cfg, mesh, params, state) * ACCUMULATE_BYTES) / hbm
    # with stages, the parameters every stage holds whole are touched again each tick
    n_ticks = ticks(mesh.pipeline, cfg.train.microbatches, mesh.repeats, mesh.lag)
    optimizer += stage_whole_params(cfg, mesh, params) * n_ticks * WHOLE_PER_TICK_BYTES / hbm
    if utilisation is not None:
        peak = datasheet_tflops(gpu, precision) * 1e12
        bf16 = utilisation * datasheet_tflops(gpu, "bf16") * 1e12
        return {"blocks": tokens * (fast / (utilisation * peak) + (slow - lm_head + scores + ssd) / bf16),
                "head": tokens * lm_head / bf16, "optimizer": 0.0}
    recompute = 4 / 3  # one more forward pass: a third of a layer's training FLOPs
    if cfg.train.remat == "full":  # the blocks' forward runs again
        fast, slow = fast * recompute, lm_head + (slow - lm_head) * recompute
        scores, ssd = scores * recompute, ssd * recompute
    elif cfg.train.remat != "none":  # save_gemm keeps the GEMM outputs; the Mamba-2 kernels run again
        ssd *= recompute
    head = lm_head * (4 / 3 if cfg.train.loss_chunks > 1 else 1)  # chunks re-run each slice's head
    bf16_rate = gemm_tflops(gpu, "bf16") * 1e12
    gemm = tokens * (fast / (gemm_tflops(gpu, precision) * 1e12) + (slow - lm_head) / bf16_rate)
    if precision == "nvfp4" and "fp4" not in DEVICE_PEAKS_TFLOPS[gpu.upper()]:
        gemm += nvfp4_quant_bytes(cfg, tokens) / hbm
    kernels = tokens * (scores / (attention_tflops(gpu, runs_xla_attention(cfg)) * 1e12)
                        + ssd / (ssd_tflops(gpu) * 1e12))
    logits = 4 * LOGIT_BYTES * m.vocab_size / tensor  # bytes a token: the loss's passes over the FP32 logits
    elementwise = rows * (_non_gemm_bytes_per_token(m, cfg.train.remat != "none", tensor) - logits) / hbm
    parts = {"blocks": gemm + kernels + elementwise, "head": tokens * head / bf16_rate + rows * logits / hbm}
    if cfg.train.scan_layers and cfg.train.remat != "full":
        parts = {k: v * SCANNED_BLOCKS_FACTOR for k, v in parts.items()}
    return parts | {"optimizer": optimizer}


def compute_seconds(cfg: Config, mesh, flops: dict[str, float], params: int,
                    precision: str, gpu: str, utilisation: float | None) -> float:
    """A device's compute a step: its stage's blocks (all blocks without stages, :func:`stage_factor`
    with them: ticks as long as the costliest chunk), then the LM head and loss (the last stage's,
    outside the bubble: they run in M of the ticks) and the optimizer on its state."""
    parts = compute_parts(cfg, mesh, flops, params, precision, gpu, utilisation)
    return parts["blocks"] * stage_factor(cfg, mesh, precision, gpu) + parts["head"] + parts["optimizer"]


def step_seconds(compute: float, exposed_comm: float, overlappable_comm: float) -> float:
    hidden = min(OVERLAP * overlappable_comm, compute)
    return compute + exposed_comm + overlappable_comm - hidden


# ----------------------------------------------------------------------------- the plan


def project(cfg: Config, mesh, gpu: str, precision: str,
            utilisation: float | None = None, gpus_per_node: int = GPUS_PER_NODE) -> dict:
    """One precision's memory and step time for ``cfg`` (its batch, remat, microbatches) on ``mesh``
    (a :class:`PlanMesh`, or a (data, fsdp, tensor) triple)."""
    m, mesh = cfg.model, PlanMesh(*mesh)
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
        "precision": precision, "gpu": gpu, "gpus": mesh.devices, "mesh": mesh.as_dict(),
        "params": params, "matmul_params": model_spec(m).matmul_params,
        "flops_per_token": sum(flops.values()), "flops_per_token_by_block": flops,
        "memory_per_device_gb": sum(mem.values()) / 1e9,
        "memory_breakdown_gb": {k: v / 1e9 for k, v in mem.items()},
        "memory_other_remat_gb": sum(memory_per_device(cfg, mesh, params, precision, other_remat).values()) / 1e9,
        "remat": cfg.train.remat, "microbatches": cfg.train.microbatches,
        "pipeline_bubble": bubble_fraction(mesh.pipeline, cfg.train.microbatches, mesh.repeats, mesh.lag),
        "global_batch": cfg.data.global_batch,
        "fits": sum(mem.values()) / 1e9 <= USABLE_MEMORY * GPUS[gpu]["memory_gb"],
        "tokens_per_step": tokens_per_step,
        "compute_s": compute, "comm_s": comm, "step_time_s": step,
        # model FLOPs over the BF16 peak while training (goodput not included), as metrics.py reports MFU
        "mfu": sum(flops.values()) * tokens_per_step / step / mesh.devices / (datasheet_tflops(gpu, "bf16") * 1e12),
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
