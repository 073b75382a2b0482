"""maxfp4's parameters in Hugging Face layouts, both directions: dense models as
``LlamaForCausalLM``, hybrid models as ``NemotronHForCausalLM`` (its ``E`` layers are
mixture-of-experts blocks: Nemotron 3), and attention + mixture-of-experts stacks whose pattern
is ``*E`` repeated with softmax routing and SwiGLU experts as ``MixtralForCausalLM``.

One table (:func:`leaves`) says, for every parameter of the pytree, which Hugging Face tensors
hold it and how a slice converts. Export writes through it (``maxfp4.export``) and
``model.init_from`` reads through it (:func:`read_params`), so the two directions cannot drift.

Layout facts the table encodes:
- ``torch.nn.Linear`` stores [out, in]; maxfp4 stores [in, out]: every projection transposes.
- ``w_qkv`` [D, K, G+2, H] holds, per KV head, its G query heads, then K, then V. Query head
  ``k*G + g`` uses KV head k, which is Hugging Face's ``repeat_kv`` order, so q/k/v_proj are
  plain slices. RoPE rotates halves (pairs (i, i + H/2)) in both, so no row permutation.
- ``w_up`` [D, F, 2] is (gate, up) per hidden unit: gate_proj and up_proj.
- Experts: ``w_up`` [X, D, F, gates] and ``w_down`` [X, F, D] are one tensor per expert in the
  published checkpoints' layout (``experts.{j}.up_proj`` / Mixtral's ``w1``, ``w3``, ``w2``),
  which transformers 5 merges while loading. The router [D, X] is ``gate.weight`` [X, D].
  The aux-loss-free bias lives in the train state, not the parameters (maxfp4.interop.hf_router_bias):
  NemotronH holds it as each E layer's ``gate.e_score_correction_bias`` [X]; Mixtral has none.
- Mamba-2: ``in_proj`` [D, G, P] holds each group's z, x, B, C, dt columns side by side
  (:mod:`maxfp4.model.mamba_layout`); Hugging Face's in_proj has z, x, B, C, dt one after the
  other (each group-major), which ``mamba_layout.columns`` makes; ``conv_w`` [W, C] is conv1d's
  [C, 1, W] (tap w multiplies x[t - W + 1 + w] in both); ``D_skip`` is ``D``.

Dimension letters: D d_model, K kv heads, G query heads per kv head, H head dim, F MLP hidden,
V vocabulary, W conv width, C conv channels.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

import numpy as np

from maxfp4.errors import UserError
from maxfp4.model.mamba_layout import columns, grouped, in_proj_parts
from maxfp4.model_spec import BlockSpec, ModelSpec, mamba_dims, model_spec

LLAMA, NEMOTRON_H, MIXTRAL = "LlamaForCausalLM", "NemotronHForCausalLM", "MixtralForCausalLM"
CONFIG_FILE, INDEX_FILE, SINGLE_FILE = "config.json", "model.safetensors.index.json", "model.safetensors"


class HFError(UserError):
    """A model that does not map onto (or from) a Hugging Face architecture: one line naming it."""


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One parameter of the pytree. ``layers``: for a stacked parameter, the Hugging Face layer
    index of each slice along its first axis (None: not stacked); ``names``: the Hugging Face
    tensors of one slice, ``{i}`` standing for the layer index; ``kind``: how a slice converts;
    ``parts``: for Mamba-2's in_proj (kind ``in_proj``), one group's column widths."""

    path: tuple[str, ...]
    kind: str
    names: tuple[str, ...]
    layers: tuple[int, ...] | None = None
    parts: tuple[int, ...] = ()

    def hf_names(self, layer: int | None) -> tuple[str, ...]:
        return tuple(n.format(i=layer) for n in self.names)


# ----------------------------------------------------------------------------- one slice, both ways

def to_hf(kind: str, a: np.ndarray, parts: tuple[int, ...] = ()) -> list[np.ndarray]:
    """One maxfp4 slice -> its Hugging Face tensors (in ``Leaf.names`` order)."""
    if kind == "same":
        return [a]
    if kind == "linear":
        return [a.T]
    if kind == "in_proj":
        return [columns(a, parts).T]
    if kind == "qkv":
        d, k, g2, h = a.shape
        g = g2 - 2
        return [a[:, :, :g].reshape(d, k * g * h).T, a[:, :, g].reshape(d, k * h).T, a[:, :, g + 1].reshape(d, k * h).T]
    if kind == "gate_up":
        return [a[:, :, 0].T, a[:, :, 1].T]
    if kind == "up":
        return [a[:, :, 0].T]
    if kind == "conv":
        return [a.T[:, None, :]]
    if kind == "experts":  # [X, K, N] -> X tensors [N, K]
        return [e.T for e in a]
    if kind == "experts_up":  # [X, D, F, 1]
        return [e[:, :, 0].T for e in a]
    if kind == "experts_gate_up":  # [X, D, F, 2] -> X gates, then X ups
        return [e[:, :, 0].T for e in a] + [e[:, :, 1].T for e in a]
    raise AssertionError(kind)


def from_hf(kind: str, tensors: list[np.ndarray], shape: tuple[int, ...], parts: tuple[int, ...] = ()) -> np.ndarray:
    """Hugging Face tensors (already checked against :func:`hf_shapes`) -> one maxfp4 slice."""
    if kind == "same":
        return tensors[0]
    if kind == "linear":
        return tensors[0].T
    if kind == "in_proj":
        return grouped(tensors[0].T, parts, shape[1])
    if kind == "qkv":
        d, k, g2, h = shape
        q, kk, v = (t.T.reshape(d, k, -1, h) for t in tensors)
        return np.concatenate([q, kk, v], axis=2)
    if kind == "gate_up":
        return np.stack([tensors[0].T, tensors[1].T], axis=-1)
    if kind == "up":
        return tensors[0].T[:, :, None]
    if kind == "conv":
        return tensors[0][:, 0, :].T
    if kind == "experts":
        return np.stack([t.T for t in tensors])
    if kind == "experts_up":
        return np.stack([t.T for t in tensors])[..., None]
    if kind == "experts_gate_up":
        x = shape[0]
        return np.stack([np.stack([g.T, u.T], axis=-1) for g, u in zip(tensors[:x], tensors[x:])])
    raise AssertionError(kind)


def hf_shapes(kind: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The Hugging Face tensor shapes of a maxfp4 slice of ``shape``."""
    if kind == "same":
        return [tuple(shape)]
    if kind == "linear":
        return [tuple(shape[::-1])]
    if kind == "in_proj":
        d, g, p = shape
        return [(g * p, d)]
    if kind == "qkv":
        d, k, g2, h = shape
        return [(k * (g2 - 2) * h, d), (k * h, d), (k * h, d)]
    if kind in ("gate_up", "up"):
        d, f, n = shape
        return [(f, d)] * n
    if kind == "conv":
        w, c = shape
        return [(c, 1, w)]
    if kind == "experts":
        x, k, n = shape
        return [(n, k)] * x
    if kind in ("experts_up", "experts_gate_up"):
        x, d, f, gates = shape
        return [(f, d)] * (x * gates)
    raise AssertionError(kind)


# ----------------------------------------------------------------------------- the tables

def _mixtral_pattern(pattern: str) -> bool:
    return len(pattern) % 2 == 0 and pattern == "*E" * (len(pattern) // 2)


def architecture(model_cfg) -> str:
    if model_cfg.kind != "hybrid":
        return LLAMA
    return MIXTRAL if _mixtral_pattern(model_cfg.pattern) and model_cfg.moe.score == "softmax" else NEMOTRON_H


def check_maps(model_cfg) -> None:
    """Refuse, in one line naming the feature, a model the Hugging Face architecture cannot hold."""
    if model_cfg.kind != "hybrid":
        return  # every dense config is a Llama: RoPE, GQA, SwiGLU, RMSNorm, untied head
    moe = model_cfg.moe
    if architecture(model_cfg) == MIXTRAL:
        for ok, what in ((model_cfg.mlp == "swiglu", f"model.mlp={model_cfg.mlp}: Mixtral's experts are SwiGLU"),
                         (moe.shared_experts == 0, f"model.moe.shared_experts={moe.shared_experts}: Mixtral has none"),
                         (model_cfg.rope, "model.rope=false: Mixtral's attention rotates (RoPE)")):
            if not ok:
                raise HFError(f"{what}; export with --format native")
        return
    present = set(model_cfg.pattern)
    if "E" in present:
        for ok, what in ((moe.score == "sigmoid", f"model.moe.score={moe.score}: NemotronH routes by sigmoid scores "
                                                  f"(a *E-repeated softmax model exports as Mixtral)"),
                         (moe.shared_experts >= 1, "model.moe.shared_experts=0: NemotronH's MoE layers have a "
                                                   "shared expert"),
                         (model_cfg.mlp == "relu2", f"model.mlp={model_cfg.mlp}: NemotronH's experts are "
                                                    f"squared-ReLU (relu2)")):
            if not ok:
                raise HFError(f"{what}; export with --format native")
    if "*" in present and model_cfg.rope:
        raise HFError("model.rope=true: NemotronHForCausalLM's attention has no rotary position embedding; "
                      "export with --format native")
    if "-" in present and model_cfg.mlp != "relu2":
        raise HFError(f"model.mlp={model_cfg.mlp}: NemotronHForCausalLM's MLP blocks are squared-ReLU (relu2), "
                      "not gated; export with --format native")


# Each block's parameters in the order a Hugging Face layer lists them: a linear layer by its
# precision class (its name and group come from maxfp4.model_spec), any other by its name; then
# how a slice converts and its tensors under the layer's prefix. The dense model's decoder block
# maps onto a Llama layer, each hybrid mixer onto a Nemotron-H layer.
LLAMA_LAYER = (
    ("attn_norm", "same", ("input_layernorm.weight",)),
    ("attn_qkv", "qkv", tuple(f"self_attn.{x}_proj.weight" for x in "qkv")),
    ("attn_out", "linear", ("self_attn.o_proj.weight",)),
    ("mlp_norm", "same", ("post_attention_layernorm.weight",)),
    ("mlp_up", "gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp_down", "linear", ("mlp.down_proj.weight",)),
)
NEMOTRON_H_LAYERS = {
    "mamba": (("pre_norm", "same", ("norm.weight",)), ("mamba_in", "in_proj", ("mixer.in_proj.weight",)),
              ("conv_w", "conv", ("mixer.conv1d.weight",)), ("conv_b", "same", ("mixer.conv1d.bias",)),
              ("A_log", "same", ("mixer.A_log",)), ("D_skip", "same", ("mixer.D",)),
              ("dt_bias", "same", ("mixer.dt_bias",)), ("norm", "same", ("mixer.norm.weight",)),
              ("mamba_out", "linear", ("mixer.out_proj.weight",))),
    "attention": (("pre_norm", "same", ("norm.weight",)),
                  ("attn_qkv", "qkv", tuple(f"mixer.{x}_proj.weight" for x in "qkv")),
                  ("attn_out", "linear", ("mixer.o_proj.weight",))),
    "mlp": (("pre_norm", "same", ("norm.weight",)), ("mlp_up", "up", ("mixer.up_proj.weight",)),
            ("mlp_down", "linear", ("mixer.down_proj.weight",))),
}


def _nemotron_h_moe(experts: int) -> tuple:
    return (("pre_norm", "same", ("norm.weight",)), ("router", "linear", ("mixer.gate.weight",)),
            ("expert_up", "experts_up", tuple(f"mixer.experts.{j}.up_proj.weight" for j in range(experts))),
            ("expert_down", "experts", tuple(f"mixer.experts.{j}.down_proj.weight" for j in range(experts))),
            ("mlp_up", "up", ("mixer.shared_experts.up_proj.weight",)),
            ("mlp_down", "linear", ("mixer.shared_experts.down_proj.weight",)))


# Mixtral: a layer is an attention block and the mixture-of-experts block after it.
MIXTRAL_ATTENTION = (("pre_norm", "same", ("input_layernorm.weight",)),) + LLAMA_LAYER[1:3]


def _mixtral_moe(experts: int) -> tuple:
    return (("pre_norm", "same", ("post_attention_layernorm.weight",)),
            ("router", "linear", ("block_sparse_moe.gate.weight",)),
            ("expert_up", "experts_gate_up", tuple(f"block_sparse_moe.experts.{j}.w{n}.weight"
                                                    for n in (1, 3) for j in range(experts))),
            ("expert_down", "experts", tuple(f"block_sparse_moe.experts.{j}.w2.weight" for j in range(experts))))


def _block_leaves(block: BlockSpec, rows, prefix: str, layers: tuple[int, ...], parts: tuple[int, ...] = ()
                  ) -> list[Leaf]:
    names = {lin.layer_class: lin.name for lin in block.linears}
    return [Leaf((block.group, names.get(name, name)), kind, tuple(prefix + t for t in tensors), layers,
                 parts if kind == "in_proj" else ())
            for name, kind, tensors in rows]


def leaves(model_cfg) -> list[Leaf]:
    """Every parameter of ``model_cfg``'s pytree with its Hugging Face tensors."""
    spec = model_spec(model_cfg)
    if architecture(model_cfg) == MIXTRAL:
        pairs = tuple(range(len(spec.blocks) // 2))
        return [Leaf(("embed",), "same", ("model.embed_tokens.weight",)),
                *_block_leaves(spec.blocks[0], MIXTRAL_ATTENTION, "model.layers.{i}.", pairs),
                *_block_leaves(spec.blocks[1], _mixtral_moe(model_cfg.moe.experts), "model.layers.{i}.", pairs),
                Leaf(("final_norm",), "same", ("model.norm.weight",)),
                Leaf(("lm_head",), "linear", ("lm_head.weight",))]
    if model_cfg.kind == "hybrid":
        return _nemotron_h_leaves(spec, in_proj_parts(model_cfg), model_cfg.moe.experts)
    return [Leaf(("embed",), "same", ("model.embed_tokens.weight",)),
            *_block_leaves(spec.blocks[0], LLAMA_LAYER, "model.layers.{i}.", tuple(range(len(spec.blocks)))),
            Leaf(("final_norm",), "same", ("model.norm.weight",)),
            Leaf(("lm_head",), "linear", ("lm_head.weight",))]


# Nemotron-H's published checkpoints name the trunk "backbone"; transformers 5 renames it to
# "model" while loading, and older versions expect "backbone": writing "backbone" suits both.
NEMOTRON_PREFIX = "backbone."


def _nemotron_h_leaves(spec: ModelSpec, mamba_in_parts: tuple[int, ...], experts: int) -> list[Leaf]:
    out = [Leaf(("embed",), "same", (NEMOTRON_PREFIX + "embeddings.weight",))]
    layers = {**NEMOTRON_H_LAYERS, "moe": _nemotron_h_moe(experts)}
    for mixer in ("mamba", "attention", "mlp", "moe"):
        at = spec.blocks_with(mixer)
        if at:
            out += _block_leaves(spec.blocks[at[0]], layers[mixer], NEMOTRON_PREFIX + "layers.{i}.", at,
                                 mamba_in_parts)
    return out + [Leaf(("final_norm",), "same", (NEMOTRON_PREFIX + "norm_f.weight",)),
                  Leaf(("lm_head",), "linear", ("lm_head.weight",))]


def leaf_of(tree: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def check_covers(model_cfg, params: Any) -> None:
    """The table and the model's pytree (arrays or shapes) name the same parameters: a renamed
    parameter fails here, not as a silently missing tensor."""
    import jax

    param_paths = {tuple(str(getattr(k, "key", k)) for k in path)
                   for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    table = {leaf.path for leaf in leaves(model_cfg)}
    if table != param_paths:
        extra = sorted(".".join(p) for p in param_paths - table) or sorted(".".join(p) for p in table - param_paths)
        raise HFError(f"parameter {extra[0]}: no Hugging Face name for it in maxfp4.interop.hf.leaves")


def ordered_slices(model_cfg) -> list[tuple[Leaf, int | None, int | None]]:
    """(leaf, index along its stacked axis or None, Hugging Face layer or None) of every slice:
    the embedding, then layer by layer (table order within a layer), then the final norm and
    the head, the order a reader of the files meets them in."""
    items = []
    for leaf in leaves(model_cfg):
        if leaf.layers is None:
            items.append((-1 if leaf.path == ("embed",) else 2**31, (leaf, None, None)))
        else:
            items += [(layer, (leaf, j, layer)) for j, layer in enumerate(leaf.layers)]
    return [item for _, item in sorted(items, key=lambda it: it[0])]  # a stable sort


def hf_tensors(model_cfg, params: Any) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of every Hugging Face tensor in :func:`ordered_slices` order, one slice
    converted at a time."""
    for leaf, j, layer in ordered_slices(model_cfg):
        a = np.asarray(leaf_of(params, leaf.path))
        yield from zip(leaf.hf_names(layer), to_hf(leaf.kind, a if j is None else a[j], leaf.parts))


def hf_tensor_shapes(model_cfg, param_shapes: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every Hugging Face tensor in :func:`ordered_slices` order, from shapes only."""
    out = []
    for leaf, j, layer in ordered_slices(model_cfg):
        shape = tuple(leaf_of(param_shapes, leaf.path).shape)
        out += zip(leaf.hf_names(layer), hf_shapes(leaf.kind, shape if j is None else shape[1:]))
    return out


# ----------------------------------------------------------------------------- config.json

def hf_config(model_cfg, *, max_positions: int, dtype: str, bos_id: int, eos_id: int, pad_id: int,
              provenance: dict) -> dict:
    """The config.json of the exported model. ``provenance``: the run, checkpoint and step."""
    check_maps(model_cfg)
    head_dim = model_cfg.resolved_head_dim
    common = {
        "architectures": [architecture(model_cfg)],
        "vocab_size": model_cfg.vocab_size, "hidden_size": model_cfg.d_model,
        "intermediate_size": model_cfg.d_ff,
        "num_attention_heads": model_cfg.n_heads, "num_key_value_heads": model_cfg.n_kv_heads,
        "head_dim": head_dim, "max_position_embeddings": max_positions,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "initializer_range": model_cfg.init_std, "use_cache": True,
        "bos_token_id": bos_id if bos_id >= 0 else None, "eos_token_id": eos_id if eos_id >= 0 else None,
        "pad_token_id": pad_id if pad_id >= 0 else None,
        # transformers 5 reads "dtype", older versions "torch_dtype".
        "dtype": dtype, "torch_dtype": dtype,
        "maxfp4": provenance,
    }
    moe = model_cfg.moe
    if architecture(model_cfg) == MIXTRAL:
        theta = model_cfg.rope_theta
        return {"model_type": "mixtral", **common, "num_hidden_layers": len(model_cfg.pattern) // 2,
                "intermediate_size": moe.d_ff, "num_local_experts": moe.experts,
                "num_experts_per_tok": moe.top_k, "hidden_act": "silu", "rms_norm_eps": model_cfg.norm_eps,
                "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False,
                "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                "sliding_window": None}
    if model_cfg.kind != "hybrid":
        theta = model_cfg.rope_theta
        return {"model_type": "llama", **common, "num_hidden_layers": model_cfg.n_layers, "hidden_act": "silu",
                "rms_norm_eps": model_cfg.norm_eps, "pretraining_tp": 1,
                # transformers 5 reads rope_parameters, older versions rope_theta and rope_scaling.
                "rope_theta": theta, "rope_scaling": None,
                "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    mb, md = model_cfg.mamba, mamba_dims(model_cfg)
    return {
        "model_type": "nemotron_h", **common, "num_hidden_layers": len(model_cfg.pattern),
        "hybrid_override_pattern": model_cfg.pattern, "mlp_hidden_act": "relu2", "use_bias": False,
        "layer_norm_epsilon": model_cfg.norm_eps, "residual_in_fp32": False,
        "ssm_state_size": mb.d_state, "mamba_num_heads": md["H"], "mamba_head_dim": mb.head_dim,
        "mamba_hidden_act": "silu", "mamba_proj_bias": False,
        # Each Mamba field under both spellings: the attribute names transformers 5 keeps and
        # the constructor names older versions take (transformers 5 maps the latter as well).
        "attention_head_dim": head_dim,
        "n_groups": mb.n_groups, "mamba_n_groups": mb.n_groups,
        "conv_kernel": mb.conv_kernel, "mamba_d_conv": mb.conv_kernel,
        "expand": mb.expand, "mamba_expand": mb.expand,
        "chunk_size": mb.chunk_size, "mamba_chunk_size": mb.chunk_size,
        "use_conv_bias": True, "mamba_conv_bias": True,
        # transformers 5 clamps dt from below at time_step_min; maxfp4 does not clamp.
        "time_step_min": 0.0, "mamba_dt_min": 0.0,
        # Mixture-of-experts layers (E): sigmoid scores, top-k normalised, no scaling, one group;
        # the shared expert is one MLP of shared_experts x d_ff.
        "n_routed_experts": moe.experts, "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.d_ff,
        "n_shared_experts": 1, "moe_shared_expert_intermediate_size": max(moe.shared_experts, 1) * moe.d_ff,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
    }


# ----------------------------------------------------------------------------- reading a model directory

class ModelDir:
    """A Hugging Face model directory: config.json and one or several safetensors files. Tensors
    are read one at a time (memory-mapped), never the whole model."""

    def __init__(self, path: str):
        self.path = path
        config = os.path.join(path, CONFIG_FILE)
        if not os.path.isfile(config):
            raise HFError(f"model.init_from={path}: no {CONFIG_FILE}; expected a Hugging Face model directory")
        try:
            with open(config, encoding="utf-8") as fh:
                self.config = json.load(fh)
        except (OSError, ValueError) as e:
            raise HFError(f"{config}: not readable JSON ({e})") from None
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as fh:
                    self.files = dict(json.load(fh)["weight_map"])
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise HFError(f"{index}: not a safetensors index (expected JSON with a weight_map; {e!r})") from None
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            self.files = {name: SINGLE_FILE for name in self._header(SINGLE_FILE)}
        else:
            raise HFError(f"model.init_from={path}: no {SINGLE_FILE} or {INDEX_FILE}")
        self._headers: dict[str, dict] = {}

    def _header(self, file: str) -> dict:
        path = os.path.join(self.path, file)
        try:
            with open(path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n))
        except (OSError, ValueError) as e:
            raise HFError(f"{path}: not a safetensors file ({e})") from None
        header.pop("__metadata__", None)
        return header

    def name(self, name: str) -> str:
        """``name`` as this directory spells it (Nemotron-H: ``backbone.`` or ``model.``)."""
        if name not in self.files and name.startswith(NEMOTRON_PREFIX):
            other = "model." + name[len(NEMOTRON_PREFIX):]
            if other in self.files:
                return other
        return name

    def shape(self, name: str) -> tuple[int, ...] | None:
        name = self.name(name)
        file = self.files.get(name)
        if file is None:
            return None
        if file not in self._headers:
            self._headers[file] = self._header(file)
        return tuple(self._headers[file][name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """One tensor as float32 (BF16 and F16 files widened exactly)."""
        import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy for safetensors' numpy reader
        from safetensors import safe_open

        name = self.name(name)
        with safe_open(os.path.join(self.path, self.files[name]), framework="np") as fh:
            return np.asarray(fh.get_tensor(name), np.float32)


def _source_of(model_dir: ModelDir, name: str) -> str:
    """The tensor to read for ``name``: a model with tied embeddings has no lm_head.weight and
    reads its embedding, which has the same [V, D] layout."""
    if name == "lm_head.weight" and model_dir.shape(name) is None and model_dir.config.get("tie_word_embeddings"):
        return ("model.embed_tokens.weight" if "model.embed_tokens.weight" in model_dir.files
                else NEMOTRON_PREFIX + "embeddings.weight")
    return name


def check_model_dir(model_cfg, model_dir: ModelDir, param_shapes: Any) -> None:
    """Refuse a directory whose architecture or any tensor's shape does not match ``model_cfg``:
    one line naming the tensor. Reads only the headers."""
    check_maps(model_cfg)
    where = model_dir.path
    want_arch = architecture(model_cfg)
    arch = (model_dir.config.get("architectures") or [""])[0]
    if arch != want_arch:
        raise HFError(f"model.init_from={where}: architectures={model_dir.config.get('architectures')}; "
                      f"expected [{want_arch!r}] for model.kind={model_cfg.kind}")
    if model_cfg.kind == "hybrid":
        pattern = model_dir.config.get("hybrid_override_pattern") or "".join(
            {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-",
             "moe": "E"}.get(t, "?") for t in model_dir.config.get("layers_block_type") or [])
        if pattern != model_cfg.pattern:
            raise HFError(f"model.init_from={where}: hybrid_override_pattern={pattern!r}; expected "
                          f"model.pattern={model_cfg.pattern!r}")
    _check_scalars(model_cfg, model_dir.config, where)
    for leaf in leaves(model_cfg):
        shape = leaf_of(param_shapes, leaf.path).shape
        slice_shape = shape if leaf.layers is None else shape[1:]
        for layer in leaf.layers or (None,):
            for name, want in zip(leaf.hf_names(layer), hf_shapes(leaf.kind, slice_shape)):
                got = model_dir.shape(_source_of(model_dir, name))
                if got is None:
                    raise HFError(f"model.init_from={where}: tensor {name} is missing; expected shape {list(want)}")
                if tuple(got) != tuple(want):
                    raise HFError(f"model.init_from={where}: tensor {name} has shape {list(got)}; expected "
                                  f"{list(want)} from the model config")
    from maxfp4.interop.hf_router_bias import check_router_bias  # that module builds on this one
    check_router_bias(model_cfg, model_dir, where)


def _check_scalars(model_cfg, hf_cfg: dict, where: str) -> None:
    """The values that change the math without changing a shape: RoPE, norm epsilon, activations."""
    def differs(name, got, key, want):
        if got is not None and not np.isclose(float(got), float(want), rtol=1e-9, atol=0):
            raise HFError(f"model.init_from={where}: {name}={got} in {CONFIG_FILE}; expected {key}={want} "
                          f"(set {key}={got} to use this model)")

    if model_cfg.kind != "hybrid" or architecture(model_cfg) == MIXTRAL:
        rope = dict(hf_cfg.get("rope_parameters") or hf_cfg.get("rope_scaling") or {})
        kind = rope.get("rope_type") or rope.get("type") or "default"
        if kind != "default":
            raise HFError(f"model.init_from={where}: rope_type={kind} in {CONFIG_FILE}; maxfp4 has plain RoPE "
                          "(rope_type=default) only")
        differs("rope_theta", hf_cfg.get("rope_theta", rope.get("rope_theta")), "model.rope_theta", model_cfg.rope_theta)
        differs("rms_norm_eps", hf_cfg.get("rms_norm_eps"), "model.norm_eps", model_cfg.norm_eps)
        activations = {"hidden_act": hf_cfg.get("hidden_act", "silu")}
    else:
        differs("layer_norm_epsilon", hf_cfg.get("layer_norm_epsilon"), "model.norm_eps", model_cfg.norm_eps)
        activations = {"mlp_hidden_act": hf_cfg.get("mlp_hidden_act", "relu2"),
                       "mamba_hidden_act": hf_cfg.get("mamba_hidden_act", "silu")}
    for key, value in activations.items():
        if value != ("relu2" if key == "mlp_hidden_act" else "silu"):
            raise HFError(f"model.init_from={where}: {key}={value} in {CONFIG_FILE}; maxfp4's model has "
                          f"{'relu2' if key == 'mlp_hidden_act' else 'silu'} there")
    for key in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"):
        if hf_cfg.get(key):
            raise HFError(f"model.init_from={where}: {key}=true in {CONFIG_FILE}; maxfp4's layers have no biases")


def read_slice(model_dir: ModelDir, leaf: Leaf, layer: int | None, slice_shape: tuple[int, ...]) -> np.ndarray:
    """One maxfp4 slice (float32) read from the directory."""
    tensors = [model_dir.read(_source_of(model_dir, name)) for name in leaf.hf_names(layer)]
    return np.ascontiguousarray(from_hf(leaf.kind, tensors, slice_shape, leaf.parts), np.float32)


def read_params(model_cfg, path: str, shardings: Any, param_shapes: Any, *, replacing: bool = False) -> Any:
    """The parameters of the Hugging Face model at ``path``, converted and placed onto
    ``shardings`` one tensor (one layer of a stacked parameter) at a time: no process holds more
    than one layer of one parameter on the host. Stacked parameters are assembled on the devices
    by an in-place (donated) update per layer. ``replacing``: ``param_shapes`` are the arrays
    these replace and nothing else holds; each is freed once its successor is placed, so the
    devices never hold two copies of the model."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    check_covers(model_cfg, param_shapes)
    model_dir = ModelDir(path)
    check_model_dir(model_cfg, model_dir, param_shapes)
    out: dict = {}
    for leaf in leaves(model_cfg):
        sharding, shape = leaf_of(shardings, leaf.path), leaf_of(param_shapes, leaf.path)
        if leaf.layers is None:
            host = read_slice(model_dir, leaf, None, shape.shape)
            array = jax.make_array_from_callback(shape.shape, sharding, lambda idx, h=host: h[idx])
        else:
            # One layer at a time, laid out as the stack is without its layer axis (which only
            # the pipeline axis splits), then written into its row of the stack.
            spec = tuple(sharding.spec) + (None,) * (len(shape.shape) - len(sharding.spec))
            layer_sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]))
            array = jax.jit(lambda: jnp.zeros(shape.shape, jnp.float32), out_shardings=sharding)()
            put = jax.jit(lambda a, x, j: jax.lax.dynamic_update_index_in_dim(a, x, j, 0),
                          donate_argnums=0, out_shardings=sharding)
            for j, layer in enumerate(leaf.layers):
                host = read_slice(model_dir, leaf, layer, shape.shape[1:])
                piece = jax.make_array_from_callback(host.shape, layer_sharding, lambda idx, h=host: h[idx])
                array = put(array, piece, j)
        node = out
        for key in leaf.path[:-1]:
            node = node.setdefault(key, {})
        node[leaf.path[-1]] = array
        if replacing:
            shape.delete()
    return out


def check_init_from(cfg) -> None:
    """Before a run touches its directory: ``model.init_from`` names a Hugging Face directory whose
    architecture and tensor shapes match ``cfg.model`` (headers only). A run that will resume
    from its own checkpoint does not read the directory, so it is not checked then."""
    if not cfg.model.init_from:
        return
    from maxfp4.checkpoint import finalized_steps
    from maxfp4.model import abstract_params

    if finalized_steps(cfg.run_dir):
        return
    if not os.path.isdir(cfg.model.init_from):
        raise HFError(f"model.init_from={cfg.model.init_from}: not a directory; expected a Hugging Face model "
                      "directory (config.json and safetensors)")
    check_model_dir(cfg.model, ModelDir(cfg.model.init_from), abstract_params(cfg.model))
