"""Mamba-2's in_proj stored group by group ([D, G, P], maxfp4.model.mamba_layout): split over the
tensor axis with the same losses as without it, exported to Hugging Face exactly as the former
[D, I] layout was, and a checkpoint of that former layout resumed on the same loss curve."""

import io
import json
import os

import jax
import numpy as np
import pytest

from maxfp4.checkpoint import Checkpointer, saved_config
from maxfp4.config import load_config
from maxfp4.interop import hf
from maxfp4.model import abstract_params
from maxfp4.model_spec import mamba_dims
from maxfp4.optim import make_optimizer
from maxfp4.parallel.mesh import make_mesh
from maxfp4.train import init_state, train
from tests.conftest import TINY
from tests.test_step import _loss_and_gradients, _rel

# 4 groups of 4 heads (head dim 8, E = 128), so tensor=2 gives each rank two groups (reordered in
# place) and tensor=4 one; an MLP block beside the mixer (kv heads would not split 4 ways).
HYBRID = ["model.kind=hybrid", "model.pattern=M-", "model.mamba.n_groups=4", "model.mamba.head_dim=8",
          "model.mamba.d_state=8", "model.mamba.chunk_size=8"]


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
    """Loss, gradients and initial state of the tiny hybrid at fsdp=2 with tensor 1, 2 and 4."""
    out = {}
    for t in (1, 2, 4):
        cfg = load_config(None, TINY + HYBRID + [f"run.output_dir={tmp_path_factory.mktemp(f't{t}')}",
                                                 "mesh.data=1", "mesh.fsdp=2", f"mesh.tensor={t}"])
        devices = jax.devices()[:2 * t]
        state, _ = init_state(cfg, make_mesh(cfg.mesh, devices), make_optimizer(cfg))
        _, _, loss, grads = _loss_and_gradients(cfg, devices, state.params)
        out[t] = cfg, state, loss, grads
    return out


@pytest.mark.parametrize("t", [2, 4])
def test_in_proj_splits_over_tensor_and_the_loss_is_unchanged(split_runs, t):
    """in_proj [L, D, G, P]: D over fsdp=2, G over tensor, so each device holds 1 / (2 t) of it
    (and of its Adam moments), t times less than at tensor=1. Loss equal to tensor=1 to 1e-5
    relative, each gradient leaf to 1e-2 relative L2: only out_proj's sum over tensor and the
    BF16 GEMMs' reduction order move (measured: loss 0, gradients below 2e-3)."""
    cfg1, state1, loss1, grads1 = split_runs[1]
    cfg, state, loss, grads = split_runs[t]
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
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(grads1)):
        assert np.abs(b).max() > 0 and _rel(a, b) <= 1e-2, (jax.tree_util.keystr(path), _rel(a, b))


def test_hugging_face_in_proj_is_the_former_layout_and_reads_back(split_runs):
    """The exported mixer.in_proj.weight of every Mamba-2 layer is [I, D] with the former column
    order (z, x, B, C, dt, each group-major), computed here from the sizes alone, bit for bit; and
    reading it back (model.init_from) gives the stored [D, G, P] slab for slab."""
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
    """A run saved at step 2, its checkpoint rewritten with in_proj (and its Adam moments) in the
    former [L, D, I] layout, resumes to step 4: one start-up line says it was converted, the
    config comparison lets it through, and steps 3 and 4 have the losses of the same run resumed
    from its own checkpoint (same program, same state after the conversion: to 1e-6), and
    export-side reads (checkpoint.read_params) convert it too."""
    base = TINY + HYBRID + [f"run.output_dir={tmp_path}", "mesh.data=1", "optim.schedule_steps=4",
                            "checkpoint.every=2"]
    dev = jax.devices()[:1]
    first = load_config(None, base + ["run.name=now", "train.steps=2"])
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

    capsys.readouterr()
    for name in ("now", "former"):
        train(load_config(None, base + [f"run.name={name}", "train.steps=4"]), devices=dev, stream=io.StringIO())
        said = capsys.readouterr().out
        assert ("converted to [D, G, P]" in said) == (name == "former"), said
    now, resumed = _losses(tmp_path / "now"), _losses(tmp_path / "former")
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert abs(now[step] - resumed[step]) <= 1e-6 * now[step], (step, now[step], resumed[step])
