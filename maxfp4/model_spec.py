"""What a model is made of, written once and without JAX: its pattern of blocks, each block
type's linear layers as records (precision class, stored shape, logical axes, GEMM [K, N], column-
or row-parallel), and what they cost (matmul parameters, FLOPs and activation bytes per token).

To the model what :mod:`maxfp4.precision.catalog` is to recipes. The modules build their
``Linear`` parameters from these records (:mod:`maxfp4.model`); the precision catalog's class
list, the sharding table (``mesh.WEIGHT_AXES``), MFU (:mod:`maxfp4.metrics`), the planner,
preflight's memory check, start-up checks and the Hugging Face map read them. A new block type is
its module and its entry in :data:`MIXERS` / :func:`mixer_linears`.

The dense (Llama-style) model is a pattern too: the ``decoder`` block (attention, then an MLP)
repeated ``model.n_layers`` times. Its two mixers share one block and one parameter group
(``blocks``), so its parameter names (``blocks/w_qkv`` ...) are those every checkpoint and export
already holds. A hybrid's pattern (``model.pattern``) is one mixer a block, each block type's
parameters stacked in a group of its own name (``mamba``, ``attention``, ``mlp``).

JAX-free and config-free on purpose: the precision catalog (which the config imports) takes its
class list from here, so this module reads a ``ModelConfig`` by its attributes and imports
nothing of maxfp4.

Dimension letters: D d_model, K kv heads, G query heads per kv head, H head dim, F MLP hidden,
V vocabulary, E Mamba-2 inner width, T sequence, X routed experts.

A mixture-of-experts block (``moe``, ``E`` in the pattern) holds a router [D, X] and its
experts' weights stacked on a leading ``experts`` axis: its :class:`LinearSpec` records count
``params`` as the weights one token passes through (top_k experts: what FLOPs and MFU charge)
and ``params_total`` as all of them (what memory holds). Its shared experts, if any, are an MLP
of classes ``mlp_up`` / ``mlp_down`` inside the block.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

# Each mixer's linear layers: (parameter name, precision class, logical axes of the stored
# weight, tensor parallelism), in the order the precision table prints them. Shapes: _shapes.
LAYOUT: dict[str, tuple[tuple[str, str, tuple[str | None, ...], str], ...]] = {
    # w_qkv [D, K, G+2, H]: per kv head its G query heads, then its key and value, so splitting
    # K over devices keeps each head group's q, k and v together.
    "attention": (("w_qkv", "attn_qkv", ("embed", "kv_heads", None, "head_dim"), "column"),
                  ("w_o", "attn_out", ("heads", "embed"), "row")),
    # w_up [D, F, gates]: SwiGLU's gate and up side by side per hidden unit.
    "mlp": (("w_up", "mlp_up", ("embed", "mlp", None), "column"),
            ("w_down", "mlp_down", ("mlp", "embed"), "row")),
    # in_proj [D, G, P]: per Mamba group its z, x, B, C and dt columns (maxfp4.model.mamba_layout),
    # so splitting G over tensor gives each rank whole groups, as the mixer's tensor split needs.
    "mamba": (("in_proj", "mamba_in", ("embed", "ssm_groups", None), "column"),
              ("out_proj", "mamba_out", ("inner", "embed"), "row")),
    # The router runs in FP32 by default (maxfp4.precision.policy); the experts' weights are
    # [X, D, F, gates] and [X, F, D], the expert dim split over mesh.expert.
    "moe": (("router", "router", ("embed", None), "column"),
            ("w_up", "expert_up", ("experts", "embed", "mlp", None), "column"),
            ("w_down", "expert_down", ("experts", "mlp", "embed"), "row")),
}
# A precision rule may name both expert GEMMs at once as the class ``expert``.
CLASS_GROUPS: dict[str, tuple[str, ...]] = {"expert": ("expert_up", "expert_down")}
# Classes a rule without ``classes`` leaves alone: the router stays FP32 unless a rule names it.
EXPLICIT_ONLY_CLASSES = ("router",)
MIXERS: dict[str, tuple[str, ...]] = {m: tuple(c for _, c, _, _ in rows) for m, rows in LAYOUT.items()}
LM_HEAD_AXES = ("embed", "vocab")
# model.pattern's characters -> the mixer of that block (the dense model's blocks are "decoder").
PATTERN_CHARS: dict[str, str] = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
BLOCK_CLASSES: tuple[str, ...] = tuple(c for classes in MIXERS.values() for c in classes)
LAYER_CLASSES: tuple[str, ...] = BLOCK_CLASSES + ("lm_head",)
DENSE_BLOCK = "decoder"
DENSE_GROUP = "blocks"  # the dense model's parameter group

# Activations the backward pass keeps, bytes per token per block (flash attention), counted from
# what autodiff and the recipes' VJPs hold (docs/PLANNING.md, "Memory per device").
ACT_BYTES_FULL_REMAT = 2  # x d_model: only the block input
# Without remat, each mixer's norm input (the BF16 residual stream: its backward needs it).
NORM_IN_BYTES = 2  # x d_model a mixer
GEMM_OUT_BYTES = 2  # per output feature kept: a linear layer's BF16 output
# Mamba-2 without remat also keeps its kernels' residuals a token: the conv's BF16 output
# (x, B, C), the scan's BF16 output before the gated norm, and the FP32 chunk states
# (H x P x N a chunk of Q tokens).
MAMBA_CONV_OUT_BYTES, MAMBA_SCAN_OUT_BYTES, MAMBA_STATE_BYTES = 2, 2, 4


@dataclasses.dataclass(frozen=True)
class LinearSpec:
    """One linear layer of one block: the parameter ``name`` its module holds, its precision
    ``layer_class``, its stored ``shape`` (K first, the rest flattened into N by the GEMM) with a
    logical axis per dim, and how tensor parallelism splits it (``column``: N, ``row``: K)."""

    name: str
    layer_class: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    parallel: str  # "column" or "row"
    # Experts: the leading dim of ``shape`` stacks this many copies, of which a token uses
    # ``active`` (0: an ordinary layer, one copy)
    experts: int = 0
    active: int = 0

    @property
    def _lead(self) -> int:
        return 1 if self.experts else 0

    @property
    def k(self) -> int:
        return self.shape[self._lead]

    @property
    def n(self) -> int:
        return math.prod(self.shape[self._lead + 1:])

    @property
    def params(self) -> int:
        """Parameters a token passes through (an expert layer: its top_k experts')."""
        return self.k * self.n * (self.active if self.experts else 1)

    @property
    def params_total(self) -> int:
        return self.k * self.n * (self.experts or 1)

    @property
    def weight_axes(self) -> tuple[str | None, str | None]:
        """The weight as its [K, N] GEMM takes it: K's axis, then the first of the dims flattened
        into N (the one its sharding follows)."""
        return self.axes[self._lead], self.axes[self._lead + 1]


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """One block: its type (a mixer, or ``decoder``), its mixers in order, the parameter group
    its stacked parameters live in, and its linear layers."""

    type: str
    mixers: tuple[str, ...]
    group: str
    linears: tuple[LinearSpec, ...]

    @property
    def classes(self) -> tuple[str, ...]:
        return tuple(lin.layer_class for lin in self.linears)

    @property
    def linear_params(self) -> dict[str, int]:
        """Matmul parameters by layer class."""
        return {lin.layer_class: lin.params for lin in self.linears}

    @property
    def matmul_params(self) -> int:
        return sum(lin.params for lin in self.linears)

    @property
    def matmul_params_total(self) -> int:
        return sum(lin.params_total for lin in self.linears)


def mamba_dims(cfg: Any) -> dict[str, int]:
    """Mamba-2's sizes: E inner width, H heads, P head dim, G groups, N state, W conv width,
    ``conv`` channels (x, B, C) and ``in`` in_proj's outputs (z, x, B, C, dt)."""
    mb = cfg.mamba
    e = mb.expand * cfg.d_model
    h = e // mb.head_dim
    return {"E": e, "H": h, "P": mb.head_dim, "G": mb.n_groups, "N": mb.d_state, "W": mb.conv_kernel,
            "conv": e + 2 * mb.n_groups * mb.d_state, "in": 2 * e + 2 * mb.n_groups * mb.d_state + h}


def mamba_splits_over_tensor(cfg: Any, t: int) -> bool:
    """Whether ``t`` tensor ranks split the Mamba-2 mixer: each takes whole groups (their heads
    with them) and 1 / t of d_model's expansion. Otherwise each runs the whole mixer on its rows."""
    return cfg.mamba.n_groups % t == 0 and cfg.d_model % t == 0


def _mlp_gates(cfg: Any) -> int:
    """2 for SwiGLU (gate and up side by side per hidden unit), 1 for the squared ReLU."""
    return 2 if cfg.kind == "dense" or cfg.mlp == "swiglu" else 1


def _shapes(cfg: Any, mixer: str) -> tuple[tuple[int, ...], ...]:
    d = cfg.d_model
    if mixer == "attention":
        h, heads, kv = cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads
        return (d, kv, heads // kv + 2, h), (heads * h, d)
    if mixer == "mlp":
        return (d, cfg.d_ff, _mlp_gates(cfg)), (cfg.d_ff, d)
    if mixer == "moe":
        x, f = cfg.moe.experts, cfg.moe.d_ff
        return (d, x), (x, d, f, _mlp_gates(cfg)), (x, f, d)
    md = mamba_dims(cfg)
    return (d, md["G"], md["in"] // md["G"]), (md["E"], d)


def mixer_linears(cfg: Any, mixer: str) -> tuple[LinearSpec, ...]:
    """The linear layers of one ``mixer`` of ``cfg``'s model, in :data:`LAYOUT` order (a
    mixture-of-experts block's shared experts after them)."""
    out = []
    for (name, cls, axes, parallel), shape in zip(LAYOUT[mixer], _shapes(cfg, mixer)):
        experted = axes[0] == "experts"
        out.append(LinearSpec(name, cls, shape, axes, parallel, experts=shape[0] if experted else 0,
                              active=cfg.moe.top_k if experted else 0))
    if mixer == "moe" and cfg.moe.shared_experts:
        f = cfg.moe.shared_experts * cfg.moe.d_ff
        (_, _, up_axes, up_par), (_, _, down_axes, down_par) = LAYOUT["mlp"]
        out += [LinearSpec("shared_up", "mlp_up", (d := cfg.d_model, f, _mlp_gates(cfg)), up_axes, up_par),
                LinearSpec("shared_down", "mlp_down", (f, d), down_axes, down_par)]
    return tuple(out)


def lm_head_linear(cfg: Any) -> LinearSpec:
    return LinearSpec("lm_head", "lm_head", (cfg.d_model, cfg.vocab_size), LM_HEAD_AXES, "column")


# Each class's weight as its [K, N] GEMM takes it (mesh.WEIGHT_AXES): sizes do not matter.
WEIGHT_AXES: dict[str, tuple[str | None, str | None]] = {
    cls: (axes[lead], axes[lead + 1]) for rows in LAYOUT.values() for _, cls, axes, _ in rows
    for lead in [int(axes[0] == "experts")]} | {"lm_head": LM_HEAD_AXES}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model as blocks (one record a block index) and its LM head, with what they cost."""

    blocks: tuple[BlockSpec, ...]
    lm_head: LinearSpec
    d_model: int
    vocab_size: int
    n_heads: int
    head_dim: int
    ssd_forward_flops: float  # per token per Mamba-2 block (0 without Mamba-2)
    mamba_kernel_bytes: float = 0.0  # per token per Mamba-2 block: its kernels' residuals without remat

    @property
    def types(self) -> tuple[str, ...]:
        """The block types present, each once, in block order."""
        return tuple(dict.fromkeys(b.type for b in self.blocks))

    @property
    def block_classes(self) -> tuple[str, ...]:
        """The precision classes the blocks have, in :data:`BLOCK_CLASSES` order."""
        present = {c for b in self.blocks for c in b.classes}
        return tuple(c for c in BLOCK_CLASSES if c in present)

    def linear(self, layer_class: str) -> LinearSpec:
        """The linear layer of a class (every block of a model has the same shape for it)."""
        if layer_class == "lm_head":
            return self.lm_head
        for b in self.blocks:
            for lin in b.linears:
                if lin.layer_class == layer_class:
                    return lin
        raise KeyError(f"{layer_class}: no such linear layer in this model")

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """[K, N] of each layer class of this model, the LM head included."""
        return {c: (self.linear(c).k, self.linear(c).n) for c in self.block_classes + ("lm_head",)}

    def blocks_with(self, mixer: str) -> tuple[int, ...]:
        """Indices of the blocks that hold ``mixer``."""
        return tuple(i for i, b in enumerate(self.blocks) if mixer in b.mixers)

    def block_linear_params(self) -> list[dict[str, int]]:
        """Matmul parameters of each block's linear layers, by layer class."""
        return [b.linear_params for b in self.blocks]

    @property
    def block_matmul_params(self) -> int:
        """Matmul parameters of all blocks' linear layers (the LM head not included)."""
        return sum(b.matmul_params for b in self.blocks)

    @property
    def matmul_params(self) -> int:
        """Active matmul parameters (a mixture-of-experts block counts the top_k experts a token uses)."""
        return self.block_matmul_params + self.lm_head.params

    @property
    def matmul_params_total(self) -> int:
        """Every matmul parameter stored (all experts)."""
        return sum(b.matmul_params_total for b in self.blocks) + self.lm_head.params

    def moe_dispatch_bytes_per_token(self, top_k: int, operand_bytes: float = 2.0) -> float:
        """Bytes a token sends through expert parallelism's all-to-alls in a training step, over
        all E blocks: to its top_k experts and back, forward and backward (4 x top_k x D)."""
        return 4.0 * top_k * self.d_model * operand_bytes * len(self.blocks_with("moe"))

    # ------------------------------------------------------------------------- FLOPs per token

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Score and value products, forward and backward (12 x T x d_attn a layer), halved
        because causal attention skips half."""
        return 6.0 * len(self.blocks_with("attention")) * seq_len * self.n_heads * self.head_dim

    def ssd_flops_per_token(self) -> float:
        """Matmul FLOPs of the chunked SSD, forward and backward (3 x forward), over the Mamba-2 blocks."""
        return 3.0 * self.ssd_forward_flops * len(self.blocks_with("mamba"))

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs a token of training (docs/METRICS.md): 6 x matmul parameters (the LM head
        included, the embedding lookup not) + attention's products + the SSD's."""
        return 6.0 * self.matmul_params + self.attention_flops_per_token(seq_len) + self.ssd_flops_per_token()

    def flops_by_mixer(self, seq_len: int) -> dict[str, float]:
        """:meth:`flops_per_token` split by where it is spent: each mixer's GEMMs (attention's
        products with attention, the SSD's with Mamba-2) and the LM head."""
        out = {"attention": self.attention_flops_per_token(seq_len), "mlp": 0.0,
               "mamba": self.ssd_flops_per_token(), "moe": 0.0, "lm_head": 6.0 * self.lm_head.params}
        mixer_of = {c: m for m, classes in MIXERS.items() for c in classes}
        for b in self.blocks:
            for lin in b.linears:
                out[mixer_of[lin.layer_class]] += 6.0 * lin.params
        return out

    # ------------------------------------------------------------------------- activations

    def activation_bytes_per_token(self, block: BlockSpec, remat: str, operand_bytes: float = 2.0) -> float:
        """Bytes a token of ``block`` keeps for the backward pass under ``train.remat``.

        ``none``: each mixer's norm input, each linear layer's activation operand as its recipe's
        VJP keeps it (``operand_bytes``: 1 for FP8, 2 for BF16 and NVFP4) and the BF16 output of
        every layer a nonlinearity or attention reads (not the row-parallel ones: o, down,
        out_proj feed only the residual add, whose backward needs nothing), plus Mamba-2's kernel
        residuals. ``full``: the block input. ``save_gemm``: the block input, the same kept GEMM
        outputs and attention's output (the policy names the row-parallel outputs too, but no
        backward reads them, so nothing keeps them). ``save_gemm_io``: also each layer's operand."""
        def rows(lin: LinearSpec) -> int:  # an expert layer's rows: each token's top_k copies
            return lin.active or 1

        kept_out = GEMM_OUT_BYTES * sum(lin.n * rows(lin) for lin in block.linears if lin.parallel != "row")
        operands = operand_bytes * sum(lin.k * rows(lin) for lin in block.linears)
        if remat == "none":
            mamba = self.mamba_kernel_bytes if "mamba" in block.mixers else 0.0
            return NORM_IN_BYTES * self.d_model * len(block.mixers) + operands + kept_out + mamba
        total = ACT_BYTES_FULL_REMAT * self.d_model
        if remat in ("save_gemm", "save_gemm_io"):
            attention_out = sum(lin.k for lin in block.linears if lin.layer_class == "attn_out")
            total += kept_out + GEMM_OUT_BYTES * attention_out
        if remat == "save_gemm_io":
            total += operands
        return total


def _block(cfg: Any, block_type: str) -> BlockSpec:
    if block_type == DENSE_BLOCK:
        mixers, group = ("attention", "mlp"), DENSE_GROUP
    else:
        mixers, group = (block_type,), block_type
    return BlockSpec(block_type, mixers, group, tuple(lin for m in mixers for lin in mixer_linears(cfg, m)))


def _block_types(cfg: Any) -> tuple[str, ...]:
    """The type of each block: the dense model's ``decoder`` repeated, or the hybrid's pattern."""
    if cfg.kind == "hybrid":
        return tuple(PATTERN_CHARS[c] for c in cfg.pattern)
    return (DENSE_BLOCK,) * cfg.n_layers


@functools.lru_cache(maxsize=256)
def model_spec(cfg: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a ``ModelConfig``."""
    types = _block_types(cfg)
    built = {t: _block(cfg, t) for t in dict.fromkeys(types)}
    ssd = kernel_bytes = 0.0
    if "mamba" in built:
        md, q = mamba_dims(cfg), cfg.mamba.chunk_size
        # Causal C.B^T within a chunk (G*Q*N), its product with x (H*Q*P), chunk states and
        # state-to-output (2 x 2*N*P per head); the inter-chunk recurrence is negligible.
        ssd = float(md["G"] * q * md["N"] + md["H"] * (q * md["P"] + 4 * md["N"] * md["P"]))
        kernel_bytes = (MAMBA_CONV_OUT_BYTES * md["conv"] + MAMBA_SCAN_OUT_BYTES * md["E"]
                        + MAMBA_STATE_BYTES * md["H"] * md["P"] * md["N"] / q)
    return ModelSpec(blocks=tuple(built[t] for t in types), lm_head=lm_head_linear(cfg), d_model=cfg.d_model,
                     vocab_size=cfg.vocab_size, n_heads=cfg.n_heads, head_dim=cfg.resolved_head_dim,
                     ssd_forward_flops=ssd, mamba_kernel_bytes=kernel_bytes)
