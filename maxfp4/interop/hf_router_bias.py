"""The routers' aux-loss-free bias in Hugging Face checkpoints: written by the export, read back
by ``model.init_from`` and the sampler (maxfp4.interop.hf holds the weights' map)."""

from __future__ import annotations

import numpy as np

from maxfp4.interop.hf import NEMOTRON_H, NEMOTRON_PREFIX, HFError, ModelDir, architecture
from maxfp4.model_spec import model_spec

# DeepSeek-V3's aux-loss-free bias, added to the sigmoid scores to choose experts and not to
# weight them, in transformers' NemotronH router as in maxfp4.model.moe.choose_experts. maxfp4
# keeps it in the train state (maxfp4.model.router_state) as f32[L, X], a row per block; block i
# is Nemotron-H layer i. transformers keeps the buffer in FP32 whatever the model's dtype, and
# the export writes it in FP32: BF16 would move it by up to 2^-9 of itself, enough to flip the
# choice between two experts whose biased scores are that close.
ROUTER_BIAS = "mixer.gate.e_score_correction_bias"


def router_bias_names(model_cfg) -> list[tuple[int, str]]:
    """(block, Hugging Face tensor) of every E layer's router bias: NemotronH's; none for Mixtral,
    whose router has no bias, and for models without E blocks."""
    if model_cfg.kind != "hybrid" or "E" not in model_cfg.pattern or architecture(model_cfg) != NEMOTRON_H:
        return []
    return [(i, f"{NEMOTRON_PREFIX}layers.{i}.{ROUTER_BIAS}") for i in model_spec(model_cfg).blocks_with("moe")]


def hf_router_bias(model_cfg, bias_LX: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """(name, f32[X]) of every E layer's row of the train state's bias."""
    return [(name, np.asarray(bias_LX[i], np.float32)) for i, name in router_bias_names(model_cfg)]


def read_router_bias(model_cfg, model_dir: ModelDir) -> np.ndarray | None:
    """The train state's f32[L, X] from the directory; None for a model without E blocks. A layer
    whose file has no bias (a Mixtral, an export that predates it) gets zeros, as transformers
    starts a missing buffer."""
    if "E" not in model_cfg.pattern:
        return None
    bias_LX = np.zeros((len(model_cfg.pattern), model_cfg.moe.experts), np.float32)
    for i, name in router_bias_names(model_cfg):
        if model_dir.shape(name) is not None:
            bias_LX[i] = model_dir.read(name)
    return bias_LX


def with_router_bias(model_cfg, path: str, precision: dict, shardings: dict) -> dict:
    """``precision`` (the train state's) with the routers' bias of the Hugging Face model at
    ``path`` (:func:`read_router_bias`) placed onto its sharding; unchanged without E blocks."""
    import jax

    from maxfp4.model.router_state import STATE_KEY

    if "E" not in model_cfg.pattern:
        return precision
    bias_LX = read_router_bias(model_cfg, ModelDir(path))
    placed = jax.make_array_from_callback(bias_LX.shape, shardings[STATE_KEY]["bias"], lambda idx: bias_LX[idx])
    return {**precision, STATE_KEY: {**precision[STATE_KEY], "bias": placed}}


def check_router_bias(model_cfg, model_dir: ModelDir, where: str) -> None:
    """One line for a router bias of the wrong length (its absence is allowed: zeros)."""
    for _, name in router_bias_names(model_cfg):
        got = model_dir.shape(name)
        if got is not None and tuple(got) != (model_cfg.moe.experts,):
            raise HFError(f"model.init_from={where}: tensor {name} has shape {list(got)}; expected "
                          f"[{model_cfg.moe.experts}] (model.moe.experts)")
