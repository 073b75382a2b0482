"""The config's sections: frozen dataclasses whose fields carry a type, a default and a comment,
each with a ``check()`` that refuses its own impossible values in one line naming the key, the
value and what was expected. ``maxfp4.config`` reads YAML into them; this module imports only
errors.py and the JAX-free precision catalog, so anything may import it."""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

from maxfp4.errors import ConfigError, describe
from maxfp4.model_spec import PATTERN_CHARS
from maxfp4.precision.catalog import BF16, validate_precision

DATA_SOURCES = ("builtin", "text", "jsonl", "array_record", "tfds", "synthetic", "mixture")
MIXTURE_SOURCES = ("builtin", "text", "jsonl", "array_record")
MODEL_KINDS = ("dense", "hybrid")
MLP_KINDS = ("swiglu", "relu2")
REMAT_POLICIES = ("none", "full", "save_gemm", "save_gemm_io")
GROUPED_GEMMS = ("auto", "xla", "mosaic")
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "cudnn_mask")
TRACKERS = ("tensorboard", "wandb", "mlflow")


def did_you_mean(value: Any, choices) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` to a mistyped ``value``, else ""."""
    import difflib

    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass(frozen=True)
class RunConfig:
    name: str = "quickstart"  # run directory is <output_dir>/<name>; same name resumes
    output_dir: str = "runs"
    seed: int = 0
    # JAX's persistent compilation cache: a rerun or resume loads its compiled step from here
    # instead of compiling it again ("" = off; JAX_COMPILATION_CACHE_DIR, when set, wins)
    compile_cache_dir: str = "~/.cache/maxfp4/jax"
    # Two runs of the same config and seed give bit-identical losses and parameters on the same
    # GPU model, driver and device count: XLA's deterministic ops (scatter-adds without atomics,
    # cuDNN attention's deterministic backward, no timing-based autotuning). Slower; see
    # docs/RELIABILITY.md "Deterministic runs".
    deterministic: bool = False
    # A run.lock whose flock is free and whose holder's heartbeat (refreshed every
    # min(60, lock_stale_s / 5) s) is older than this is taken over: a job requeued on another
    # node after its node was lost is not stranded. Longer than any stall of a live holder.
    lock_stale_s: float = 300.0
    # Experiment trackers that receive the metrics, the config and the run's files (process 0):
    # tensorboard, wandb, mlflow (maxfp4.trackers; wandb and mlflow are the extras of their name)
    trackers: tuple[str, ...] = ("tensorboard",)
    # Share of each GPU's memory JAX's allocator reserves (XLA_PYTHON_CLIENT_MEM_FRACTION, which
    # wins when set; JAX's own default is 0.75). The rest holds the CUDA context, cuBLAS/cuDNN
    # workspaces and NCCL's buffers: 0.92 leaves 6.4 GB of an 80 GB H100.
    gpu_memory_fraction: float = 0.92

    def check(self) -> None:
        _require(bool(self.name) and "/" not in self.name and self.name not in (".", ".."), "run.name", self.name,
                 "a non-empty name without '/'")
        _require(bool(self.output_dir), "run.output_dir", self.output_dir, "a directory path")
        _require(math.isfinite(self.lock_stale_s) and self.lock_stale_s >= 10, "run.lock_stale_s", self.lock_stale_s,
                 "a number of seconds >= 10")
        for name in self.trackers:
            _require(name in TRACKERS, "run.trackers", list(self.trackers),
                     f"names from {', '.join(TRACKERS)}{did_you_mean(name, TRACKERS)}")
        _require(0.1 <= self.gpu_memory_fraction <= 0.99, "run.gpu_memory_fraction", self.gpu_memory_fraction,
                 "a fraction in [0.1, 0.99]")


@dataclass(frozen=True)
class MambaConfig:
    d_state: int = 128
    head_dim: int = 64
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 128
    expand: int = 2
    # Operands of the SSD's token-length matmuls: bf16 (FP32 accumulation, as Mamba-2's own kernels
    # do) or fp32 (HIGHEST precision). Decays, segment sums and states are FP32 either way.
    ssd_matmul: str = "bf16"
    # Where the mixer's convolution, SSD (with the D skip) and gated norm run: auto (each as a Pallas
    # kernel on GPU when its tile sizes allow, else in XLA), xla (jax.numpy), or pallas (the
    # kernels; interpreted off GPU, slowly).
    kernels: str = "auto"
    # Which Pallas backend the GPU kernels compile for: auto (Mosaic GPU, the backend jax supports,
    # on Hopper for the kernels whose Mosaic form takes the shapes: the SSD's forward, backward
    # and recurrence between chunks and the gated norm's two, each measured faster than its
    # Triton form; the convolution on Triton, whose Mosaic form disagreed with it in a
    # two-GPU hybrid, maxfp4.model.mamba._conv_kernels; Triton elsewhere, interpreted off a GPU),
    # mosaic (every Mosaic form, the convolution's too, and off a GPU Mosaic GPU's interpreter)
    # or triton (every kernel on Triton).
    kernel_backend: str = "auto"
    # With FP8 delayed scaling on in_proj and out_proj and the kernels on: the kernels that
    # write in_proj's output gradient and out_proj's input store them in FP8 themselves (same
    # values as the recipes' casts of the BF16 tensors, one pass less a layer each). false:
    # BF16, then the recipes' casts.
    fp8_in_kernels: bool = True

    def check(self, d_model: int) -> None:
        """Pallas tile sizes are the kernels' own check (maxfp4.kernels.support, at start-up)."""
        _positive(self, "model.mamba", "d_state", "head_dim", "n_groups", "conv_kernel", "chunk_size", "expand")
        _require(self.ssd_matmul in ("bf16", "fp32"), "model.mamba.ssd_matmul", self.ssd_matmul, "bf16 or fp32")
        _require(isinstance(self.fp8_in_kernels, bool), "model.mamba.fp8_in_kernels",
                 self.fp8_in_kernels, "true or false")
        _require(self.kernel_backend in ("auto", "mosaic", "triton"), "model.mamba.kernel_backend",
                 self.kernel_backend, "auto, mosaic or triton")
        _require(self.kernels in ("auto", "xla", "pallas"), "model.mamba.kernels", self.kernels,
                 "auto, xla or pallas")
        inner = self.expand * d_model
        _require(inner % self.head_dim == 0, "model.mamba.head_dim", self.head_dim,
                 f"a divisor of model.mamba.expand x model.d_model = {inner}")
        _require((inner // self.head_dim) % self.n_groups == 0, "model.mamba.n_groups", self.n_groups,
                 f"a divisor of the Mamba head count {inner // self.head_dim}")


ROUTER_SCORES = ("sigmoid", "softmax")


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts block (``E`` in ``model.pattern``; maxfp4.model.moe, docs/MOE.md)."""

    experts: int = 8  # routed experts per block
    top_k: int = 2  # experts each token is sent to
    d_ff: int = 512  # hidden width of each expert (and of each shared expert)
    shared_experts: int = 0  # experts every token passes through (one MLP of shared_experts x d_ff)
    # Per-expert capacity as a multiple of the even share (tokens x top_k / experts); the overflow
    # is dropped and counted. 0: dropless (every token reaches its top_k experts).
    capacity_factor: float = 0.0
    # sigmoid (DeepSeek-V3, Nemotron 3: independent scores, which the aux-loss-free bias needs to
    # shift one expert without moving the others) or softmax (Mixtral, Qwen3-MoE). The top-k
    # scores are normalised to sum to 1 either way.
    score: str = "sigmoid"
    aux_loss_coef: float = 0.0  # load-balancing loss (Switch: experts x sum_e f_e P_e) x this
    # DeepSeek-V3's aux-loss-free balancing: each step bias += rate x sign(mean load - load); the
    # bias moves the top-k choice only, never the weights (0: off)
    bias_update_rate: float = 1e-3
    # The experts' grouped GEMMs: xla (jax.lax.ragged_dot), mosaic (the Mosaic GPU kernels jax
    # ships, Hopper only; BF16 outputs, maxfp4.kernels.grouped_gemm) or auto (mosaic where it runs)
    grouped_gemm: str = "auto"
    # With mesh.expert > 1: each device's send buffer to another holds this multiple of the even
    # share of its token-expert assignments; a step where some device sends one more than that
    # exchanges worst-case buffers instead (every assignment to one device), so nothing is
    # dropped either way (maxfp4.parallel.expert). 0: the worst-case buffers always.
    exchange_slack: float = 1.5
    # With mesh.tensor > 1: each expert's hidden units split over tensor (Megatron's expert tensor
    # parallelism, every tensor rank routing the group's tokens) rather than the tensor group's
    # tokens split over its ranks with every expert whole (maxfp4.parallel.expert)
    expert_tensor_parallel: bool = False

    def check(self) -> None:
        _positive(self, "model.moe", "experts", "top_k", "d_ff")
        _require(isinstance(self.expert_tensor_parallel, bool), "model.moe.expert_tensor_parallel",
                 self.expert_tensor_parallel, "true or false")
        _require(self.grouped_gemm in GROUPED_GEMMS, "model.moe.grouped_gemm", self.grouped_gemm,
                 f"one of {', '.join(GROUPED_GEMMS)}")
        _require(self.top_k <= self.experts, "model.moe.top_k", self.top_k,
                 f"at most model.moe.experts={self.experts}")
        _require(self.shared_experts >= 0, "model.moe.shared_experts", self.shared_experts, "an integer >= 0")
        _require(self.capacity_factor == 0 or self.capacity_factor >= 1.0, "model.moe.capacity_factor",
                 self.capacity_factor, "0 (dropless) or a factor >= 1.0, such as 1.25")
        _require(self.exchange_slack == 0 or self.exchange_slack >= 1.0, "model.moe.exchange_slack",
                 self.exchange_slack, "0 (worst-case buffers) or a factor >= 1.0, such as 1.5")
        _require(self.score in ROUTER_SCORES, "model.moe.score", self.score, f"one of {', '.join(ROUTER_SCORES)}")
        _require(self.aux_loss_coef >= 0, "model.moe.aux_loss_coef", self.aux_loss_coef, "a number >= 0, such as 1e-3")
        _require(self.bias_update_rate >= 0, "model.moe.bias_update_rate", self.bias_update_rate,
                 "a number >= 0, such as 1e-3 (0: off)")


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "dense"
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    head_dim: int = 0  # 0: d_model // n_heads
    d_ff: int = 768
    vocab_size: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    attention: str = "auto"  # auto (cuDNN fused on GPU, XLA elsewhere), xla, cudnn, cudnn_mask
    # cudnn: documents per row the packed kernel takes; a batch with a row of more runs of
    # segment ids (padding counts as one) takes the masked kernel (maxfp4.model.attention)
    attention_max_segments: int = 16
    smooth_swiglu: bool = False  # per-channel scaling around the SwiGLU product (FP8 outliers)
    pattern: str = ""  # hybrid: one character a block, M Mamba-2, * attention, - MLP
    rope: bool = True  # rotary position embeddings in attention (Nemotron-H uses none)
    mlp: str = "swiglu"  # hybrid MLP blocks: swiglu or relu2 (squared ReLU, not gated)
    mamba: MambaConfig = field(default_factory=MambaConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)  # the E blocks of model.pattern
    # A Hugging Face model directory (Llama for dense, Nemotron-H for hybrid) whose weights a new
    # run starts from (maxfp4.interop.hf); empty: random initialisation. A resumed run restores its checkpoint.
    init_from: str = ""

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def check(self) -> None:
        _require(self.kind in MODEL_KINDS, "model.kind", self.kind, f"one of {', '.join(MODEL_KINDS)}")
        if self.kind == "hybrid":
            _require(bool(self.pattern) and set(self.pattern) <= set(PATTERN_CHARS), "model.pattern", self.pattern,
                     "a non-empty string of M (Mamba-2), * (attention), - (MLP) and E (mixture of experts)")
            self.mamba.check(self.d_model)
        else:
            _require(not self.pattern, "model.pattern", self.pattern, "empty for model.kind=dense (set model.kind=hybrid)")
        if "E" in self.pattern:
            self.moe.check()
        else:
            _check_moe_unused(self.moe)
        _require(self.mlp in MLP_KINDS, "model.mlp", self.mlp, f"one of {', '.join(MLP_KINDS)}")
        _positive(self, "model", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size")
        _require(self.n_layers <= MAX_LAYERS, "model.n_layers", self.n_layers, f"at most {MAX_LAYERS} blocks")
        _require(self.head_dim >= 0, "model.head_dim", self.head_dim, "a positive integer (0: d_model // n_heads)")
        _require(self.d_model % self.n_heads == 0, "model.n_heads", self.n_heads,
                 f"a divisor of model.d_model={self.d_model}")
        _require(self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads,
                 f"a divisor of model.n_heads={self.n_heads}")
        _require(self.resolved_head_dim % 2 == 0, "model.head_dim", self.resolved_head_dim,
                 "an even head dimension (RoPE rotates pairs)")
        _require(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "a positive number")
        _require(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "a positive number")
        _require(self.attention in ATTENTION_IMPLS, "model.attention", self.attention,
                 f"one of {', '.join(ATTENTION_IMPLS)}")
        _require(self.attention_max_segments >= 1, "model.attention_max_segments", self.attention_max_segments,
                 "a positive number of segments per row")
        # Far above 1 the first forward pass overflows or saturates and every gradient is 0 or NaN:
        # the run would "train" without learning anything (0.02 is the usual choice).
        _require(0 < self.init_std <= MAX_INIT_STD, "model.init_std", self.init_std,
                 f"a standard deviation in (0, {MAX_INIT_STD}] (0.02 is usual)")


@dataclass(frozen=True)
class DataConfig:
    source: str = "builtin"  # one of DATA_SOURCES; docs/DATA.md describes each
    paths: tuple[str, ...] = ()  # text/jsonl: files or globs; array_record: directories written by prepare
    tokenizer: str = ""  # SentencePiece model or tokenizer.json; empty: train one on the data, kept in the run dir
    seq_len: int = 256
    global_batch: int = 16
    jsonl_field: str = "text"  # jsonl: the key of each line's object that holds the document text
    tfds_name: str = ""  # tfds: dataset name (and version), e.g. "my_dataset:1.0.0"
    tfds_split: str = "train"  # tfds: split to read
    tfds_data_dir: str = ""  # tfds: where the dataset was prepared; empty: TFDS's default directory
    tfds_field: str = "text"  # tfds: the feature holding the document text
    # source=mixture: [{source, paths, weight}, ...]; rows of each source drawn in proportion to weight
    mixture: tuple[dict, ...] = ()
    workers: int = 0  # grain worker processes reading batches; 0 = in the training process
    read_threads: int = 2  # threads reading rows in each reader (process or worker)
    prefetch: int = 4  # batches buffered ahead of the training step
    eval_fraction: float = 0.0  # fraction of documents held out for evaluation (seeded choice)
    eval_paths: tuple[str, ...] = ()  # held-out files/directories of the same source, instead of a fraction
    eval_batches: int = 8  # at most this many global batches in an evaluation

    def check(self) -> None:
        _require(self.source in DATA_SOURCES, "data.source", self.source, f"one of {', '.join(DATA_SOURCES)}")
        if self.source in ("text", "jsonl", "array_record"):
            what = "prepared directory" if self.source == "array_record" else "file or glob"
            _require(len(self.paths) > 0, "data.paths", list(self.paths),
                     f"at least one {what} for data.source={self.source}")
        if self.source == "tfds":
            _require(bool(self.tfds_name), "data.tfds_name", self.tfds_name, "a dataset name for data.source=tfds")
        _require((self.source == "mixture") == bool(self.mixture), "data.mixture", list(self.mixture),
                 "a non-empty list of {source, paths, weight} exactly when data.source=mixture")
        for i, part in enumerate(self.mixture):
            _check_mixture_part(part, f"data.mixture[{i}]")
        _positive(self, "data", "seq_len", "global_batch", "read_threads", "eval_batches")
        _require(self.workers >= 0, "data.workers", self.workers, "an integer >= 0 (0: read in the training process)")
        _require(self.prefetch >= 0, "data.prefetch", self.prefetch, "an integer >= 0")
        _require(0.0 <= self.eval_fraction < 1.0, "data.eval_fraction", self.eval_fraction, "a fraction in [0, 1)")
        _require(not (self.eval_fraction and self.eval_paths), "data.eval_paths", list(self.eval_paths),
                 "empty when data.eval_fraction is set (choose one way to hold out data)")
        _require(not self.eval_paths or self.source in ("text", "jsonl", "array_record"), "data.eval_paths",
                 list(self.eval_paths), "used only with data.source text, jsonl or array_record")
        if self.tokenizer:
            _require(os.path.isfile(self.tokenizer), "data.tokenizer", self.tokenizer,
                     "an existing SentencePiece model or tokenizer.json file")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    log_every: int = 10
    microbatches: int = 1  # gradient accumulation: global_batch is split into this many
    # a resume on another device count may change microbatches (never the global batch) so each
    # device's share divides and stays within the checkpoint's (maxfp4.elastic)
    elastic: bool = True
    # the LM head and loss over this many slices of the sequence, each recomputed in the backward
    # pass: 1/loss_chunks of the [B, T, V] logits live at once (maxfp4.model.loss.chunked_loss_sum)
    loss_chunks: int = 1
    remat: str = "none"  # none | full | save_gemm | save_gemm_io (maxfp4.model.remat)
    # one lax.scan per run of identical blocks (compile time flat in depth), or false: blocks
    # unrolled (no stacked residual buffers; longer compiles) -- maxfp4.model.layer_loop
    scan_layers: bool = True
    compiler_options: dict = field(default_factory=dict)  # XLA options, e.g. {xla_gpu_enable_triton_gemm: true}
    profile_steps: tuple[int, ...] = ()  # [first, last]: JAX profiler trace of these steps in <run>/profile
    eval_every: int = 0  # held-out loss every this many steps and at the end; 0 = off
    # lm-evaluation-harness tasks (names or task YAML files) scored every eval_every steps and at
    # the end, logged beside eval_loss (maxfp4.lm_eval_hook)
    eval_tasks: tuple[str, ...] = ()

    def check(self) -> None:
        _require(self.eval_every >= 0, "train.eval_every", self.eval_every, "an integer >= 0 (0: no evaluation)")
        _require(self.steps >= 1, "train.steps", self.steps, "an integer >= 1")
        _require(all(isinstance(t, str) and t.strip() for t in self.eval_tasks), "train.eval_tasks",
                 list(self.eval_tasks), "a list of lm-eval task names or task YAML files, e.g. [hellaswag]")
        _require(not self.eval_tasks or self.eval_every > 0, "train.eval_tasks", list(self.eval_tasks),
                 "[] unless train.eval_every > 0 (the steps the tasks are scored at), e.g. train.eval_every=1000")
        _require(self.log_every >= 1, "train.log_every", self.log_every, "an integer >= 1")
        _require(self.microbatches >= 1, "train.microbatches", self.microbatches, "an integer >= 1")
        _require(self.remat in REMAT_POLICIES, "train.remat", self.remat, f"one of {', '.join(REMAT_POLICIES)}")
        _check_compiler_options(self.compiler_options)
        _require(self.profile_steps == () or (len(self.profile_steps) == 2
                                              and 1 <= self.profile_steps[0] <= self.profile_steps[1]),
                 "train.profile_steps", list(self.profile_steps), "[] or [first, last] with 1 <= first <= last")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    warmup_steps: int = 100
    schedule_steps: int = 0  # cosine horizon; 0 = train.steps
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0  # global-norm clipping; 0 = off
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8

    def check(self) -> None:
        _require(0 < self.lr <= MAX_LR, "optim.lr", self.lr, f"a learning rate in (0, {MAX_LR}] (AdamW)")
        _require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        _require(self.schedule_steps >= 0, "optim.schedule_steps", self.schedule_steps,
                 "an integer >= 0 (0: train.steps)")
        _require(0.0 <= self.min_lr_ratio <= 1.0, "optim.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        _require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, "a number >= 0")
        _require(self.clip >= 0, "optim.clip", self.clip, "a number >= 0 (0: no clipping)")
        _require(0 <= self.b1 < 1, "optim.b1", self.b1, "a number in [0, 1)")
        _require(0 <= self.b2 < 1, "optim.b2", self.b2, "a number in [0, 1)")
        _require(self.eps > 0, "optim.eps", self.eps, "a positive number")


@dataclass(frozen=True)
class PrecisionConfig:
    """Checked by maxfp4.precision.catalog (names, rules, options; docs/PRECISION.md)."""

    default: str = BF16.name  # the recipe of every layer no rule names
    rules: tuple[dict, ...] = ()  # ordered {classes, layers, recipe}; the first match wins
    recipes: dict = field(default_factory=dict)  # recipe -> {option: value}, over its defaults


@dataclass(frozen=True)
class MeshConfig:
    data: int = -1
    # pipeline stages: each keeps 1/pipeline of the blocks, and train.microbatches (at least
    # this many) stream through them (maxfp4.parallel.pipeline)
    pipeline: int = 1
    # stages a pipeline device holds: the stack is cut into pipeline x pipeline_repeats stages,
    # stage s on device s mod pipeline (the circular schedule; 1: GPipe's)
    pipeline_repeats: int = 1
    # hand each stage's output over during the next tick, beside its compute, rather than
    # waiting for it: 2 ticks a hand-over, a bubble of 2 (P - 1) ticks, groups of 2 x pipeline
    # microbatches with repeats (maxfp4.parallel.pipeline_schedule)
    pipeline_overlap: bool = False
    fsdp: int = 1
    # the optimizer's moments split over data too (ZeRO-1, Megatron's distributed optimizer):
    # each data replica updates its share and the new weights are gathered (maxfp4.train)
    shard_optimizer_over_data: bool = False
    # splits each sequence across devices (long contexts)
    context: int = 1
    # splits a mixture-of-experts block's experts across devices
    expert: int = 1
    tensor: int = 1
    # Megatron's sequence parallelism: the residual stream between blocks split over tensor along
    # the sequence (maxfp4.parallel.mesh, "residual_seq"); no effect at mesh.tensor=1
    sequence_parallel: bool = False

    def check(self) -> None:
        axes = {"data": self.data, "pipeline": self.pipeline, "fsdp": self.fsdp, "context": self.context,
                "expert": self.expert, "tensor": self.tensor}
        for name, v in axes.items():
            _require(v == -1 or v >= 1, f"mesh.{name}", v, "a positive integer or -1 (the remaining devices)")
        _require(self.pipeline_repeats >= 1, "mesh.pipeline_repeats", self.pipeline_repeats,
                 "a positive integer (1: each device one stage)")
        remaining = {name: v for name, v in axes.items() if v == -1}
        _require(len(remaining) <= 1, "mesh", remaining, "at most one axis of size -1")
        _require(isinstance(self.sequence_parallel, bool), "mesh.sequence_parallel", self.sequence_parallel,
                 "true or false")
        # built in a later step: until then an axis that splits nothing would only waste devices


@dataclass(frozen=True)
class DistributedConfig:
    coordinator: str = ""
    num_processes: int = 0
    process_id: int = -1
    # start-up: every process must have joined the coordinator within this many seconds, else each
    # waiting process ends with one line and exit code 2 (JAX's own limit aborts the process)
    init_timeout_s: float = 300.0
    # a process that sends no heartbeat for this long is declared dead by JAX's coordination
    # service, which then aborts every other process (maxfp4.distributed, docs/RELIABILITY.md)
    heartbeat_timeout_s: int = 100

    def check(self) -> None:
        _require(self.num_processes >= 0, "distributed.num_processes", self.num_processes, "an integer >= 0")
        # a timer past ~1e11 s overflows; no start-up waits a day
        _require(0 < self.init_timeout_s <= 86400, "distributed.init_timeout_s", self.init_timeout_s,
                 "a positive number of seconds, at most 86400")
        _require(self.heartbeat_timeout_s >= 1, "distributed.heartbeat_timeout_s", self.heartbeat_timeout_s,
                 "an integer number of seconds >= 1")
        if self.coordinator:
            host, _, port = self.coordinator.rpartition(":")
            _require(bool(host) and port.isdigit() and 1 <= int(port) <= 65535, "distributed.coordinator",
                     self.coordinator, "host:port with a port in [1, 65535]")
            _require(self.num_processes >= 1, "distributed.num_processes", self.num_processes,
                     "the number of processes when distributed.coordinator is set")
            _require(0 <= self.process_id < self.num_processes, "distributed.process_id", self.process_id,
                     f"an integer in [0, {self.num_processes})")


@dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True  # false: never save (throughput benchmarks)
    every: int = 0  # 0: only at the end
    keep: int = 3  # newest saves kept, plus the newest from before a running streak of skipped steps
    async_: bool = field(default=True, metadata={"key": "async"})
    # SHA-256 of the array files, hashed by each process in the background once a save has
    # committed and checked on restore (a mismatch falls back to the previous checkpoint).
    verify: bool = False

    def check(self) -> None:
        _require(self.every >= 0, "checkpoint.every", self.every, "an integer >= 0 (0: only at the end)")
        _require(self.keep >= 1, "checkpoint.keep", self.keep, "an integer >= 1")


@dataclass(frozen=True)
class FaultConfig:
    """Injected failures, for testing the resilience machinery (off by default)."""

    exception_at_step: int = 0  # raise an error after this step (0: never)
    # Steps (1-based, as logged) whose gradients are replaced by NaN inside the jitted step, so
    # the real non-finite guard sees them.
    nonfinite_at_steps: tuple[int, ...] = ()
    # Steps whose gradients are NaN in the step's first evaluation only: a transient hardware
    # fault, which a re-run (resilience.rerun_skipped) computes cleanly, where it reproduces the
    # persistent nonfinite_at_steps.
    transient_nonfinite_at_steps: tuple[int, ...] = ()
    hang_at_step: int = 0  # the loop sleeps forever before this step (0: never); for the watchdog
    slow_process: int = -1  # this process index sleeps slow_seconds every step (-1: none)
    slow_seconds: float = 0.0  # per-step sleep of slow_process; for the straggler report
    # From step loss_scale_at_step on (1-based; 0: never) the loss, and so the gradients, are
    # multiplied by loss_scale inside the jitted step: a lasting level shift, as a change of the
    # data mixture makes, for the spike guard.
    loss_scale: float = 1.0
    loss_scale_at_step: int = 0

    def check(self) -> None:
        p = "resilience.fault"
        _require(self.exception_at_step >= 0, f"{p}.exception_at_step", self.exception_at_step,
                 "an integer >= 0 (0: never)")
        _require(all(s >= 1 for s in self.nonfinite_at_steps), f"{p}.nonfinite_at_steps",
                 list(self.nonfinite_at_steps), "a list of steps >= 1")
        _require(all(s >= 1 for s in self.transient_nonfinite_at_steps), f"{p}.transient_nonfinite_at_steps",
                 list(self.transient_nonfinite_at_steps), "a list of steps >= 1")
        _require(self.hang_at_step >= 0, f"{p}.hang_at_step", self.hang_at_step, "an integer >= 0 (0: never)")
        _require(self.slow_process >= -1, f"{p}.slow_process", self.slow_process, "a process index or -1 (none)")
        # time.sleep overflows past ~1e11 s; an hour per step is already no straggler but a hang
        _require(0 <= self.slow_seconds <= 3600, f"{p}.slow_seconds", self.slow_seconds, "a number of seconds in [0, 3600]")
        _require(math.isfinite(self.loss_scale) and self.loss_scale > 0, f"{p}.loss_scale", self.loss_scale,
                 "a finite factor > 0")
        _require(self.loss_scale_at_step >= 0, f"{p}.loss_scale_at_step", self.loss_scale_at_step,
                 "an integer >= 0 (0: never)")


@dataclass(frozen=True)
class ResilienceConfig:
    # Skip the update of a step whose loss or gradients are non-finite or whose loss spikes
    # (params, optimizer and precision state unchanged; the step counter and data still advance).
    guard: bool = True
    # A spike: loss > (1 + spike_margin) x the median of the last spike_window finite losses
    # (maxfp4.reliability.guard). Healthy runs measured up to 1.58 x the median (docs/RELIABILITY.md).
    spike_margin: float = 1.0  # 0: spikes off, only non-finite steps are skipped
    # Finite losses in the window, skipped ones included, so a lasting level shift is accepted
    # after at most spike_window // 2 + 1 skipped steps (kept below max_consecutive_skips).
    spike_window: int = 12
    spike_warmup: int = 50  # finite steps before spikes are judged (non-finite is judged always)
    # This many skipped steps in a row: reload the last checkpoint from before the streak, keep
    # the data moving (0: never). With no checkpoint to go back to, a streak of finite losses
    # suspends spike judgement for spike_window steps; a non-finite streak stops the run.
    max_consecutive_skips: int = 10
    max_rollbacks: int = 3  # rollbacks in one process's lifetime before it stops (exit code 3)
    # Evaluate a skipped step's loss and gradients once more from the same state and batch and
    # compare bit for bit: the same result is a divergence, a different one a transient hardware
    # fault (maxfp4.reliability.rerun). Needs run.deterministic. Costs a forward and backward pass
    # per skipped step, and on good steps a conditional (docs/RELIABILITY.md).
    rerun_skipped: bool = False
    rerun_drain_after: int = 2  # re-runs with a different result on the same devices before "drain it"
    hang_timeout_s: float = 0.0  # no step completes for this long -> stack dump, exit 124 (0: off)
    straggler_every: int = 0  # gather per-process host time per step every N steps (0: off)
    straggler_threshold: float = 1.2  # report processes slower than this x the median
    preflight: bool = True  # run maxfp4.reliability.preflight's checks at start-up
    preflight_gemm: bool = False  # also time a GEMM on each device off GPU (always on GPU)
    fault: FaultConfig = field(default_factory=FaultConfig)

    def check(self) -> None:
        p = "resilience"
        _require(math.isfinite(self.spike_margin) and self.spike_margin >= 0, f"{p}.spike_margin", self.spike_margin,
                 "a finite fraction of the median loss >= 0 (0: spikes off; 1: a loss above twice the median)")
        _require(self.spike_window >= 3, f"{p}.spike_window", self.spike_window, "an integer >= 3")
        _require(self.spike_warmup >= 1, f"{p}.spike_warmup", self.spike_warmup, "an integer >= 1")
        _require(self.max_consecutive_skips >= 0, f"{p}.max_consecutive_skips", self.max_consecutive_skips,
                 "an integer >= 0 (0: never roll back)")
        if self.guard and self.spike_margin > 0 and self.max_consecutive_skips > 0:
            # A lasting level shift skips up to window // 2 + 1 steps (maxfp4.reliability.guard): never a rollback.
            _require(self.spike_window // 2 + 1 < self.max_consecutive_skips, f"{p}.spike_window", self.spike_window,
                     f"at most {2 * self.max_consecutive_skips - 3} with max_consecutive_skips="
                     f"{self.max_consecutive_skips} (a level shift skips up to spike_window // 2 + 1 steps)")
        _require(self.max_rollbacks >= 0, f"{p}.max_rollbacks", self.max_rollbacks, "an integer >= 0")
        _require(self.rerun_drain_after >= 1, f"{p}.rerun_drain_after", self.rerun_drain_after, "an integer >= 1")
        _require(self.guard or not self.rerun_skipped, f"{p}.rerun_skipped", self.rerun_skipped,
                 "false with resilience.guard=false (only the guard skips steps)")
        _require(self.hang_timeout_s >= 0, f"{p}.hang_timeout_s", self.hang_timeout_s,
                 "a number of seconds >= 0 (0: off)")
        _require(self.straggler_every >= 0, f"{p}.straggler_every", self.straggler_every, "an integer >= 0 (0: off)")
        _require(self.straggler_threshold > 1, f"{p}.straggler_threshold", self.straggler_threshold,
                 "a ratio > 1 (1.2: 20% slower than the median)")
        self.fault.check()


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    resilience: ResilienceConfig = field(default_factory=ResilienceConfig)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.run.output_dir, self.run.name)

    def to_dict(self) -> dict:
        return _to_plain(self)

    def check(self) -> None:
        """Each section checks itself, in file order; then what relates two sections."""
        for section in (self.run, self.model, self.data, self.train, self.optim, self.mesh, self.distributed,
                        self.checkpoint, self.resilience):
            section.check()
        _check_across_sections(self)


# ----------------------------------------------------------------------------- text and plain values


def yaml_key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {yaml_key(f): _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def control_character(text: str) -> int:
    """Index of the first control character (NUL, newline, escape, ...) or lone surrogate, or -1:
    no config string needs one, and in a path or a run name they truncate or corrupt it."""
    for i, ch in enumerate(text):
        if ord(ch) < 32 or 127 <= ord(ch) < 160 or 0xD800 <= ord(ch) <= 0xDFFF:
            return i
    return -1


def check_text(text: str, key: str) -> str:
    i = control_character(text)
    if i >= 0:
        raise ConfigError(f"{key}={describe(text)}: expected text without control characters "
                          f"(found {text[i]!r} at position {i})")
    return text


# ----------------------------------------------------------------------------- checks


MAX_LR = 1.0  # AdamW's step is about lr per parameter: above 1 nothing sensible is left
MAX_INIT_STD = 1.0
# The deepest published stacks have a few hundred blocks; the precision table and the scan are
# built per block, so an absurd count must be refused before anything is laid out for it.
MAX_LAYERS = 4096
_COMPILER_OPTION_VALUES = (bool, int, float, str)


def _check_mixture_part(part: Any, key: str) -> None:
    _require(isinstance(part, dict) and all(isinstance(k, str) for k in part)
             and set(part) <= {"source", "paths", "weight"} and "source" in part,
             key, part, "a mapping with keys source, paths (list) and weight")
    _require(isinstance(part["source"], str) and part["source"] in MIXTURE_SOURCES, f"{key}.source",
             part["source"], f"one of {', '.join(MIXTURE_SOURCES)}")
    paths = part.get("paths", [])
    _require(isinstance(paths, list), f"{key}.paths", paths, "a list of paths")
    for j, path in enumerate(paths):
        _require(isinstance(path, str) and bool(path), f"{key}.paths[{j}]", path, "a file, glob or directory name")
        check_text(path, f"{key}.paths[{j}]")
    weight = part.get("weight", 1.0)
    _require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
             and weight > 0, f"{key}.weight", weight, "a positive finite number")


def _check_compiler_options(options: dict) -> None:
    """XLA options are flat name -> scalar pairs; anything else is refused here, before the
    options are handed to the compiler (or printed in its error)."""
    for name, value in options.items():
        key = f"train.compiler_options.{name}" if isinstance(name, str) else "train.compiler_options"
        _require(isinstance(name, str) and name.isidentifier(), key, name, "option names such as xla_gpu_enable_triton_gemm")
        _require(isinstance(value, _COMPILER_OPTION_VALUES) and not (isinstance(value, float) and not math.isfinite(value)),
                 key, value, "true/false, a finite number or a string")
        if isinstance(value, str):
            check_text(value, key)


def _require(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={describe(value)}: expected {expected}")


def _positive(section: Any, prefix: str, *names: str) -> None:
    for n in names:
        v = getattr(section, n)
        _require(v > 0, f"{prefix}.{n}", v, "a positive integer")


def _check_moe_unused(moe: MoEConfig) -> None:
    """model.moe set on a model without E blocks would decide nothing: refuse the first such key."""
    for f in dataclasses.fields(moe):
        value, default = getattr(moe, f.name), f.default
        _require(value == default, f"model.moe.{f.name}", value,
                 f"the default {default!r} on a model.pattern without E blocks (add E to the pattern)")


def _check_across_sections(cfg: Config) -> None:
    d, t, o = cfg.data, cfg.train, cfg.optim
    _require(not t.eval_every or d.eval_fraction > 0 or d.eval_paths or d.source == "synthetic",
             "train.eval_every", t.eval_every, "0 unless data.eval_fraction > 0 or data.eval_paths is set")
    _require(not t.eval_tasks or d.source != "synthetic", "train.eval_tasks", list(t.eval_tasks),
             "[] with data.source=synthetic (no tokenizer to read the tasks' text)")
    _require(not t.eval_tasks or cfg.mesh.pipeline == 1, "train.eval_tasks", list(t.eval_tasks),
             "[] with mesh.pipeline > 1 (tasks are scored by the unstaged forward pass)")
    _require(d.global_batch % t.microbatches == 0, "train.microbatches", t.microbatches,
             f"a divisor of data.global_batch={d.global_batch}")
    _require(t.loss_chunks >= 1 and d.seq_len % t.loss_chunks == 0, "train.loss_chunks", t.loss_chunks,
             f"an integer >= 1 dividing data.seq_len={d.seq_len}")
    # Without deterministic ops a healthy GPU may sum a re-run in another order: a false fault.
    _require(cfg.run.deterministic or not cfg.resilience.rerun_skipped, "resilience.rerun_skipped",
             cfg.resilience.rerun_skipped, "false unless run.deterministic=true (a re-run must give the same bits "
             "on healthy hardware)")
    if "E" in cfg.model.pattern:
        _check_moe_mesh(cfg)
    _check_context(cfg)
    _check_sequence_parallel(cfg)
    horizon = o.schedule_steps or t.steps
    _require(o.warmup_steps <= horizon, "optim.warmup_steps", o.warmup_steps,
             f"at most the schedule length {horizon}")


def _check_moe_mesh(cfg: Config) -> None:
    experts, ep = cfg.model.moe.experts, cfg.mesh.expert
    t, d_ff = cfg.mesh.tensor, cfg.model.moe.d_ff
    if cfg.model.moe.expert_tensor_parallel and t > 1:
        _require(d_ff % t == 0, "model.moe.d_ff", d_ff,
                 f"a multiple of mesh.tensor={t} with model.moe.expert_tensor_parallel=true, such as {d_ff // t * t or t}")
    if ep > 1:
        fits = [d for d in range(ep, 0, -1) if experts % d == 0][0]
        _require(experts % ep == 0, "mesh.expert", ep, f"a divisor of model.moe.experts={experts}, such as {fits}")


def _check_context(cfg: Config) -> None:
    """mesh.context > 1 cuts each sequence into 2 x context chunks (maxfp4.parallel.context): they
    must be whole, hold whole SSD chunks, and hold the convolution's window."""
    c, seq_len, m = cfg.mesh.context, cfg.data.seq_len, cfg.model
    if c == 1:
        return
    _require(c >= 1, "mesh.context", c, "a positive integer (-1 is not taken for context)")
    unit = 2 * c
    if m.kind == "hybrid" and "M" in m.pattern:
        unit = 2 * c * m.mamba.chunk_size
        _require(m.mamba.conv_kernel - 1 <= seq_len // (2 * c), "mesh.context", c,
                 f"at most {max(seq_len // (2 * (m.mamba.conv_kernel - 1)), 1)} (each of the 2 x mesh.context "
                 f"chunks of data.seq_len={seq_len} must hold model.mamba.conv_kernel - 1 tokens)")
    _require(seq_len % unit == 0, "data.seq_len", seq_len,
             f"a multiple of {unit} (2 x mesh.context={c}" + (f" x model.mamba.chunk_size={m.mamba.chunk_size}"
                                                               if unit != 2 * c else "")
             + f"), e.g. {max(unit, seq_len // unit * unit)}")


def _check_sequence_parallel(cfg: Config) -> None:
    """mesh.sequence_parallel splits each sequence over context x tensor between blocks: the
    tokens must divide into that many equal parts (the zigzag's 2 x context chunks each)."""
    mesh = cfg.mesh
    if not mesh.sequence_parallel or mesh.tensor in (1, -1):
        return
    unit = mesh.tensor * (2 * mesh.context if mesh.context > 1 else 1)
    _require(cfg.data.seq_len % unit == 0, "data.seq_len", cfg.data.seq_len,
             f"a multiple of {unit} with mesh.sequence_parallel=true (mesh.tensor={mesh.tensor}"
             + (f" x 2 x mesh.context={mesh.context}" if mesh.context > 1 else "") + ")")


def validate(cfg: Config) -> None:
    """Every check a config can have without devices: the sections', then the precision policy's.
    (XLA options, kernel tile sizes and the mesh are checked against the devices at start-up.)"""

    cfg.check()
    validate_precision(cfg.precision, n_layers=cfg.model.n_layers)
