"""Mamba-2's in_proj stored group by group ([D, G, P], maxfp4.model.mamba_layout): split over the
tensor axis with the same losses as without it, exported to Hugging Face exactly as the former
[D, I] layout was, and a checkpoint of that former layout resumed on the same loss curve."""

import io
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from maxfp4.checkpoint import Checkpointer, saved_config
from maxfp4.checkpoint_layout import from_former_layout
from maxfp4.config import load_config
from maxfp4.interop import hf
from maxfp4.model import abstract_params
from maxfp4.model_spec import mamba_dims
from maxfp4.optim import make_optimizer
from maxfp4.parallel.mesh import batch_sharding, make_mesh
from maxfp4.precision import resolve_policy
from maxfp4.step import make_loss_fn
from maxfp4.train import init_state, train
from tests.conftest import TINY
from tests.test_step import _batch

# 4 groups of 6 heads (head dim 8, E = 3 x 64, apart from every other width of the model), so
# tensor=2 gives each rank two groups (reordered in place) and tensor=4 one; an MLP block beside
# the mixer (kv heads would not split 4 ways).
HYBRID = ["model.kind=hybrid", "model.pattern=M-", "model.mamba.n_groups=4", "model.mamba.head_dim=8",
          "model.mamba.expand=3", "model.mamba.d_state=8", "model.mamba.chunk_size=8"]


def _former_columns(w_DGP, cfg):
    """The former in_proj layout, from the model's sizes alone: column c of [D, I] is part k
    (z, x, B, C, dt, each G x width wide, group-major) of group g at offset j within the part,
    which the grouped layout stores at [g, (widths before k) + j]."""
    d = mamba_dims(cfg)
    g = d["G"]
    widths = [d["E"] // g, d["E"] // g, d["N"], d["N"], d["H"] // g]
    index = []
    for k, width in enumerate(widths):
        for c in range(g * width):
            index.append((c // width, sum(widths[:k]) + c % width))
    groups, offsets = np.array(index).T
    return w_DGP[..., groups, offsets]


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    """Config, initial state and loss of the tiny hybrid at fsdp=2 with tensor 1, 2 and 4 (the
    forward only: compiling the gradient three times would triple the cost; the backward through
    the split is compared in tests/test_step.py)."""
    out = {}
    for t in (1, 2, 4):
        cfg = load_config(None, TINY + HYBRID + [f"run.output_dir={tmp_path_factory.mktemp(f't{t}')}",
                                                 "mesh.data=1", "mesh.fsdp=2", f"mesh.tensor={t}"])
        mesh = make_mesh(cfg.mesh, jax.devices()[:2 * t])
        state, _ = init_state(cfg, mesh, make_optimizer(cfg))
        loss_fn = make_loss_fn(cfg, resolve_policy(cfg.precision, cfg.model.n_layers), mesh)
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in _batch(cfg).items()}
        compiled = jax.jit(lambda p, b: loss_fn(p, {}, b, jax.random.key(0), 1.0)).lower(state.params, batch).compile()
        out[t] = cfg, state, float(compiled(state.params, batch)), compiled.as_text()
    return out


@pytest.mark.parametrize("t", [2, 4])
def test_in_proj_splits_over_tensor_and_the_loss_is_unchanged(split_runs, t):
    """in_proj [L, D, G, P]: D over fsdp=2, G over tensor, so each device holds 1 / (2 t) of it
    (and of its Adam moments), t times less than at tensor=1. Loss equal to tensor=1 to 1e-5
    relative: only out_proj's sum over tensor and the BF16 GEMMs' reduction order move. The compiled mixer holds its [B, T, E] arrays as half the batch and 1 / t of the
    channels, never all of them (the core really runs split), and in_proj's weight reaches its
    GEMM as [D, I / t]: each device reorders the columns it holds, FSDP gathers the rows, and no
    device ever holds all I columns."""
    _, state1, loss1, _ = split_runs[1]
    cfg, state, loss, hlo = split_runs[t]
    e, b, seq = cfg.model.mamba.expand * cfg.model.d_model, cfg.data.global_batch, cfg.data.seq_len
    assert f"[{b // 2},{seq},{e // t}]" in hlo and f"[{b // 2},{seq},{e}]" not in hlo
    d, i = cfg.model.d_model, mamba_dims(cfg.model)["in"]
    assert f"f32[{d},{i // t}]" in hlo and f"[{d},{i}]" not in hlo and f"[{d // 2},{i}]" not in hlo
    w = state.params["mamba"]["in_proj"]
    L, D, G, P = w.shape
    assert (G, P) == (4, mamba_dims(cfg.model)["in"] // 4)
    assert w.sharding.spec[1:3] == ("fsdp", "tensor")
    for moment in (state.opt_state[1][0].mu, state.opt_state[1][0].nu):
        assert moment["mamba"]["in_proj"].sharding.spec[1:3] == ("fsdp", "tensor")
    shards = w.addressable_shards
    assert len(shards) == 2 * t and all(s.data.shape == (L, D // 2, G // t, P) for s in shards)
    one = state1.params["mamba"]["in_proj"].addressable_shards[0].data.nbytes
    assert one == w.nbytes // 2 and shards[0].data.nbytes * t == one
    # The rank's columns are its groups: tensor rank r holds groups [r G/t, (r+1) G/t).
    host, mesh = np.asarray(w), w.sharding.mesh
    for s in shards:
        rank = int(np.argwhere(mesh.devices == s.device)[0][mesh.axis_names.index("tensor")])
        assert s.index[2] == slice(G // t * rank, G // t * (rank + 1))
        assert np.array_equal(np.asarray(s.data), host[s.index])
    assert abs(loss - loss1) <= 1e-5 * abs(loss1), (loss, loss1)


def test_hugging_face_in_proj_is_the_former_layout_and_reads_back(split_runs):
    """The exported mixer.in_proj.weight of every Mamba-2 layer is [I, D] with the former column
    order (z, x, B, C, dt, each group-major), computed here from the sizes alone, bit for bit;
    reading it back (model.init_from) gives the stored [D, G, P] slab for slab; and a native
    export's in_proj of the former layout reads back as the stored one."""
    cfg, state, _, _ = split_runs[1]
    params = jax.device_get(state.params)
    exported = dict(hf.hf_tensors(cfg.model, params))
    leaf = next(leaf for leaf in hf.leaves(cfg.model) if leaf.path == ("mamba", "in_proj"))
    for j, layer in enumerate(leaf.layers):
        w_DGP = params["mamba"]["in_proj"][j]
        (name,) = leaf.hf_names(layer)
        assert exported[name].shape == (mamba_dims(cfg.model)["in"], cfg.model.d_model)
        assert np.array_equal(exported[name].view(np.uint32), _former_columns(w_DGP, cfg.model).T.view(np.uint32))
        back = hf.from_hf(leaf.kind, [exported[name]], w_DGP.shape, leaf.parts)
        assert np.array_equal(back.view(np.uint32), w_DGP.view(np.uint32))
    # A native export of the former layout, as maxfp4.sample reads it: converted, BF16 included.
    stacked = params["mamba"]["in_proj"].astype(ml_dtypes.bfloat16)
    former = _former_columns(stacked, cfg.model)
    read = from_former_layout(("mamba", "in_proj"), former, stacked.shape, cfg.model)
    assert read.dtype == stacked.dtype and np.array_equal(read.view(np.uint16), stacked.view(np.uint16))
    assert from_former_layout(("mamba", "out_proj"), former, stacked.shape, cfg.model) is former


def _former_layout(state, cfg):
    """``state`` with every in_proj array (parameters, Adam moments) in the former [.., D, I] layout."""
    def convert(path, x):
        if jax.tree_util.keystr(path).endswith("['in_proj']"):
            return jax.device_put(_former_columns(np.asarray(x), cfg.model), next(iter(x.devices())))
        return x
    return state.replace(params=jax.tree_util.tree_map_with_path(convert, state.params),
                         opt_state=jax.tree_util.tree_map_with_path(convert, state.opt_state))


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return {r["step"]: r["loss"] for r in map(json.loads, fh)}


def test_checkpoint_of_the_former_layout_resumes_on_the_same_curve(tmp_path, capsys):
    """A run's step-2 checkpoint rewritten with in_proj (and its Adam moments) in the former
    [L, D, I] layout resumes to step 4: one start-up line says it was converted, the config
    comparison lets it through, and steps 3 and 4 have the losses of the run that wrote it (same
    program, same state after the conversion: to 1e-6, as tests/test_checkpoint.py resumes);
    the reads of export and sample (checkpoint.read_params) convert it too, bit for bit."""
    base = TINY + HYBRID + [f"run.output_dir={tmp_path}", "mesh.data=1", "optim.schedule_steps=4",
                            "checkpoint.every=2"]
    dev = jax.devices()[:1]
    first = load_config(None, base + ["run.name=now", "train.steps=4"])
    train(first, devices=dev, stream=io.StringIO())
    mesh = make_mesh(first.mesh, dev)
    like, _ = init_state(first, mesh, make_optimizer(first))
    ck = Checkpointer(first.run_dir, first.checkpoint)
    state, data_state = ck.restore(2, like)
    ck.close()

    former = load_config(None, base + ["run.name=former", "train.steps=2"])
    old = _former_layout(state, former)
    assert old.params["mamba"]["in_proj"].shape == (1, 64, mamba_dims(former.model)["in"])
    ck = Checkpointer(former.run_dir, former.checkpoint)
    ck.save(2, old, data_state, saved_config(first.run_dir)[0] | {"run": former.to_dict()["run"]})
    ck.close()

    from maxfp4.checkpoint import read_params
    shapes = abstract_params(former.model, jax.sharding.SingleDeviceSharding(dev[0]))
    read = read_params(former.run_dir, 2, shapes)
    assert np.array_equal(np.asarray(read["mamba"]["in_proj"]), np.asarray(state.params["mamba"]["in_proj"]))

    assert "converted" not in capsys.readouterr().out  # today's layout restores as it is
    train(load_config(None, base + ["run.name=former", "train.steps=4"]), devices=dev, stream=io.StringIO())
    said = [line for line in capsys.readouterr().out.splitlines() if "converted to [D, G, P]" in line]
    assert len(said) == 1 and "former/checkpoints/2/state" in said[0] and "3 arrays" in said[0], said
    now, resumed = _losses(tmp_path / "now"), _losses(tmp_path / "former")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(now[step] - resumed[step]) <= 1e-6 * now[step], (step, now[step], resumed[step])
