"""What the dense and hybrid models share: the embedding, the final norm and the LM head, and
the functional face the trainer uses.

The trainer keeps the parameters as a pure pytree (its state, optimizer masks, checkpoints and
the export read it by name). :func:`init_params` is a fresh module's state as that pytree,
:func:`param_axes` the logical axes its ``Param`` metadata carries, and :func:`apply` merges a
pytree into the module inside the traced function, so the jitted step stays one pure function.

Dimension letters: B batch, T sequence, D d_model, V vocabulary.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import jax
from flax import nnx

from maxfp4.config import ModelConfig
from maxfp4.parallel.mesh import constrain
from maxfp4.model.layers import Embedding, head_precision, linear, norm_scale, normal_init, param
from maxfp4.model_spec import lm_head_linear
from maxfp4.precision import PrecisionPolicy

Params = dict[str, Any]


class LanguageModel(nnx.Module):
    """embed -> the blocks (a subclass's ``from_embedded``) -> final norm -> untied LM head."""

    def __init__(self, cfg: ModelConfig, key_embed: jax.Array, key_head: jax.Array):
        d, v, std = cfg.d_model, cfg.vocab_size, cfg.init_std
        self.cfg = cfg
        self.embed = param(normal_init(key_embed, (v, d), std), ("vocab", "embed"), Embedding)
        self.final_norm = norm_scale((d,), ("norm",))
        self.lm_head = linear(key_head, lm_head_linear(cfg), None, std=std)

    def __call__(self, inputs_BT: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
                 **options) -> jax.Array:
        """Logits [B, T, V] in BF16 (the options: :meth:`from_embedded`'s)."""
        return self.from_embedded(self.embed(inputs_BT), positions_BT, segment_ids_BT, **options)

    def from_embedded(self, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array, **options):
        raise NotImplementedError

    def logits(self, x_BTD: jax.Array, *, policy: PrecisionPolicy, scales: dict, key: jax.Array) -> jax.Array:
        """Final RMSNorm and the LM head (class ``lm_head``, not a block): logits [B, T, V]."""
        x_BTD = self.final_norm(x_BTD, self.cfg.norm_eps)
        head = head_precision(self.cfg, policy, scales, key)
        return constrain(self.lm_head(x_BTD, head), ("batch", "seq", "vocab"))


def init_params(model_type: type[LanguageModel], cfg: ModelConfig, key: jax.Array) -> Params:
    """A new model's FP32 master weights as a pure pytree (``embed``, ``blocks/w_qkv`` ...)."""
    return nnx.to_pure_dict(nnx.state(model_type(cfg, key)))


def param_axes(model_type: type[LanguageModel], cfg: ModelConfig) -> Params:
    """The logical axes of every parameter, from its metadata, in the pytree's layout."""
    abstract = nnx.eval_shape(lambda: model_type(cfg, jax.random.key(0)))
    return nnx.to_pure_dict(nnx.state(abstract), extract_fn=lambda v: v.logical_axes)


@lru_cache(maxsize=32)
def graphdef(model_type: type[LanguageModel], cfg: ModelConfig) -> nnx.GraphDef:
    """The model's structure (no arrays), built once per config."""
    return nnx.split(nnx.eval_shape(lambda: model_type(cfg, jax.random.key(0))))[0]


def apply(model_type: type[LanguageModel], params: Params, cfg: ModelConfig) -> LanguageModel:
    """The module over ``params`` (arrays or tracers), for use inside a traced function."""
    return nnx.merge(graphdef(model_type, cfg), params)
