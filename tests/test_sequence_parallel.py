"""Megatron's sequence parallelism (mesh.sequence_parallel): the residual stream between blocks
split over tensor along the sequence. Same loss and gradients as the tensor split without it,
for a dense model, a Mamba-2 hybrid (with context parallelism too) and attention + MoE; the compiled step holds the stream as 1/tensor of the
tokens and moves it over tensor by all-gathers and reduce-scatters instead of all-reducing it;
bad input fails in one line."""

import re

import jax
import numpy as np
import pytest

from maxfp4.config import ConfigError
from tests.test_step import _PALLAS_MIXER, _gradients, _rel

HYBRID = ["model.kind=hybrid", "model.pattern=M*-", "model.mamba.head_dim=16", "model.mamba.n_groups=2",
          *_PALLAS_MIXER]
MOE = ["model.kind=hybrid", "model.pattern=*E", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.d_ff=64"]


def _activation_gathers(hlo: str, b: int, t: int, d: int) -> int:
    """All-gathers in the compiled step whose result is a [b, t, d] activation: the residual
    stream's sequence gathered over tensor before a column-parallel GEMM."""
    return len(re.findall(rf"= \w+\[{b},{t},{d}\]\{{[^}}]*\}} all-gather(-start)?\(", hlo))


@pytest.mark.parametrize("kind, context", [("dense", 1), ("hybrid", 1), ("hybrid", 2), ("moe", 1)])
def test_sequence_parallel_gives_the_tensor_splits_loss_and_gradients(tiny_cfg, kind, context):
    """tensor=2 x fsdp=2 with and without mesh.sequence_parallel: loss equal to 1e-5 relative and
    every gradient leaf to 5e-3 relative L2 (only the sums over tensor change order: a
    reduce-scatter then an all-gather instead of an all-reduce; BF16 GEMMs). With it, the
    compiled gradient holds the stream as [B/2, T/2, D] shards and gathers it over tensor for
    the column-parallel GEMMs, more often than without it (never, but for the experts'
    exchange). XLA's CPU build sums a row-parallel GEMM's output by an all-reduce and keeps its
    half; XLA's GPU passes make that a reduce-scatter. Under mesh.context=2 too (8 devices, 64
    tokens: each context rank's tokens split again over tensor), the Mamba-2 state passing and
    the attention exchange included."""
    extra = {"dense": [], "hybrid": HYBRID, "moe": MOE}[kind]
    mesh = ("mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", f"mesh.context={context}", f"data.seq_len={32 * context}")
    devices = jax.devices()[:4 * context]
    (_, _, m1, g1), hlo1 = _gradients(tiny_cfg(*mesh, *extra), devices)
    cfg = tiny_cfg(*mesh, *extra, "mesh.sequence_parallel=true")
    (_, _, m2, g2), hlo2 = _gradients(cfg, devices)
    assert abs(m1["loss"] - m2["loss"]) <= 1e-5 * abs(m1["loss"])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(g1)):
        assert np.abs(b).max() > 0 and _rel(a, b) <= 5e-3, (jax.tree_util.keystr(path), _rel(a, b))
    b, t, d = cfg.data.global_batch // 2, cfg.data.seq_len // context, cfg.model.d_model
    assert f"[{b},{t // 2},{d}]" in hlo2
    assert _activation_gathers(hlo2, b, t, d) > _activation_gathers(hlo1, b, t, d)


@pytest.mark.parametrize("overrides, key", [
    (["mesh.tensor=2", "mesh.sequence_parallel=true", "data.seq_len=33"], "data.seq_len=33"),
    (["mesh.sequence_parallel=2"], "mesh.sequence_parallel=2"),
])
def test_bad_sequence_parallel_input_is_one_line(tiny_cfg, overrides, key):
    with pytest.raises(ConfigError) as err:
        tiny_cfg(*overrides)
    message = str(err.value)
    assert "\n" not in message and message.startswith(key) and "expected" in message, message
