"""Mesh shapes and the logical-axis rules: every layout trains the same; shardings follow the
rules table; impossible meshes fail with a clear error."""

import io
import math

import jax
import pytest
from jax.sharding import PartitionSpec as P

from maxfp4.config import ConfigError
from maxfp4.parallel.mesh import logical_to_spec, make_mesh, resolve_mesh_shape, tree_shardings
from maxfp4.model.decoder import init_params, param_axes
from maxfp4.train import train


@pytest.fixture(scope="module")
def one_device_losses(tmp_path_factory):
    from maxfp4.config import load_config
    from tests.conftest import TINY
    out = tmp_path_factory.mktemp("one")
    cfg = load_config(None, TINY + ["train.steps=3", f"run.output_dir={out}", "mesh.data=1"])
    return [r["loss"] for r in train(cfg, devices=jax.devices()[:1], stream=io.StringIO())]


@pytest.mark.parametrize("mesh", [["mesh.data=8", "mesh.fsdp=1"], ["mesh.data=1", "mesh.fsdp=8"],
                                  ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]])
def test_every_mesh_shape_gives_the_same_losses(tiny_cfg, one_device_losses, mesh):
    losses = [r["loss"] for r in train(tiny_cfg("train.steps=3", *mesh), stream=io.StringIO())]
    # BF16 GEMMs summed in another order: 2e-3 relative.
    for a, b in zip(one_device_losses, losses):
        assert abs(a - b) <= 2e-3 * a, (one_device_losses, losses)


def test_parameter_shardings_follow_the_rules(tiny_cfg):
    cfg = tiny_cfg("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    mesh = make_mesh(cfg.mesh)
    shapes = jax.eval_shape(lambda k: init_params(cfg.model, k), jax.random.key(0))
    sh = tree_shardings(param_axes(cfg.model), shapes, mesh)
    assert sh["embed"].spec == P("tensor", "fsdp")  # (vocab, embed)
    assert sh["lm_head"].spec == P("fsdp", "tensor")  # (embed, vocab)
    assert sh["blocks"]["w_qkv"].spec == P(None, "fsdp", "tensor", None, None)  # kv heads split
    # w_o and w_down shard their leading dim over tensor and fsdp, so FSDP gathers them and
    # reduce-scatters their gradients along contiguous rows; d_model stays whole.
    assert sh["blocks"]["w_o"].spec == P(None, ("tensor", "fsdp"), None)
    assert sh["blocks"]["w_up"].spec == P(None, "fsdp", "tensor", None)
    assert sh["blocks"]["w_down"].spec == P(None, ("tensor", "fsdp"), None)
    assert sh["blocks"]["attn_norm"].spec == P(None, None)


def test_a_dim_keeps_the_leading_mesh_axes_that_divide_it(tiny_cfg):
    mesh = make_mesh(tiny_cfg("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2").mesh)
    # 6 rows: tensor (2) divides them, tensor x fsdp (4) does not; fsdp then goes to d_model.
    assert logical_to_spec(("layers", "mlp", "embed"), (3, 6, 8), mesh) == P(None, "tensor", "fsdp")
    assert logical_to_spec(("layers", "mlp", "embed"), (3, 5, 8), mesh) == P(None, None, "fsdp")
    assert logical_to_spec(("batch", "seq"), (2, 16), mesh) == P("data", None)
    assert logical_to_spec(("batch", "seq"), (8, 16), mesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("inner", "embed"), (8, 8), mesh) == P(("tensor", "fsdp"), None)


def test_impossible_meshes_fail_clearly(tiny_cfg):
    with pytest.raises(ConfigError, match="product is the device count 8"):
        resolve_mesh_shape(tiny_cfg("mesh.data=3", "mesh.fsdp=1").mesh, 8)
    with pytest.raises(ConfigError, match="do not divide the 8 devices"):
        resolve_mesh_shape(tiny_cfg("mesh.data=-1", "mesh.fsdp=3").mesh, 8)
    assert resolve_mesh_shape(tiny_cfg("mesh.data=-1", "mesh.tensor=2").mesh, 8) == (4, 1, 2, 1)
    with pytest.raises(ConfigError, match="model.n_kv_heads=2: expected a multiple of mesh.tensor=4"):
        train(tiny_cfg("mesh.data=2", "mesh.tensor=4"), stream=io.StringIO())
    with pytest.raises(ConfigError, match="data.global_batch=8: expected a multiple"):
        train(tiny_cfg("mesh.data=8", "train.microbatches=2"), stream=io.StringIO())


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_weight_axes_table_matches_the_models_linear_parameters(tiny_cfg, kind):
    """mesh.WEIGHT_AXES (a layer class's weight as its [K, N] GEMM takes it) against every Linear
    parameter of the models: the tensor axis lands on K, on N or on neither, as the parameter's
    own sharding puts it on its first dim, on a later one, or nowhere."""
    from flax import nnx

    from maxfp4.parallel.mesh import gathered_weight_spec
    from maxfp4.model_spec import WEIGHT_AXES
    from maxfp4.model import get_model
    from maxfp4.model.layers import Linear

    extra = ["model.kind=hybrid", "model.pattern=M*-M", "model.mlp=relu2", "model.mamba.d_state=16",
             "model.mamba.head_dim=8", "model.mamba.chunk_size=16",
             "model.mamba.n_groups=2"] if kind == "hybrid" else []  # whole groups per tensor rank
    cfg = tiny_cfg("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", *extra)
    mesh = make_mesh(cfg.mesh)
    model = nnx.eval_shape(lambda: get_model(cfg.model).module(cfg.model, jax.random.key(0)))
    linears = list(nnx.to_flat_state(nnx.state(model, Linear)))
    moe = {"router", "expert_up", "expert_down"}  # no E blocks here; tests/test_moe.py runs those
    assert {v.layer_class for _, v in linears} == set(WEIGHT_AXES) - moe - ({"mamba_in", "mamba_out"} if kind == "dense"
                                                                            else set())
    for path, v in linears:
        axes, shape = v.logical_axes, v.get_value().shape
        if axes[0] == "layers":
            axes, shape = axes[1:], shape[1:]
        spec = logical_to_spec(axes, shape, mesh)
        on = [i for i, entry in enumerate(spec) if "tensor" in (entry if isinstance(entry, tuple) else (entry,))]
        expected = P("tensor", None) if on == [0] else P(None, "tensor") if on else P(None, None)
        shape_KN = (shape[0], math.prod(shape[1:]))
        assert gathered_weight_spec(v.layer_class, shape_KN, mesh) == expected, (path, axes, spec)


def test_a_tensor_axis_says_when_it_leaves_the_mamba_mixers_whole():
    """Tensor parallelism splits a Mamba-2 mixer only into whole groups; start-up says when it
    cannot (maxfp4.model.mamba.tensor_note) and says nothing otherwise."""
    from maxfp4.config import load_config
    from maxfp4.model.mamba import tensor_note

    two_groups = load_config("configs/hybrid-tiny.yaml").model
    one_group = load_config("configs/hybrid-tiny.yaml", ["model.mamba.n_groups=1"]).model
    dense = load_config("configs/quickstart.yaml").model
    note = tensor_note(one_group, 2)
    assert note is not None and "model.mamba.n_groups=1" in note and "mesh.tensor=2" in note
    assert tensor_note(two_groups, 2) is None
    assert tensor_note(one_group, 1) is None
    assert tensor_note(dense, 2) is None


@pytest.mark.parametrize("mesh", [["mesh.data=2", "mesh.fsdp=2"], ["mesh.fsdp=2", "mesh.context=2", "data.seq_len=64"]])
def test_the_embedding_lookup_gathers_neither_the_rows_nor_the_table(mesh):
    """The table's d_model is split over fsdp (and context) and the rows' batch over fsdp: the
    lookup runs where the table's part lives and all-to-alls move the rows. Before, XLA's
    partitioner gathered the looked-up [B, T, D] rows whole on every device (data 2 x fsdp 2)
    or the whole table (fsdp 2 x context 2), and their gradients back. (With context the
    blocks gather [B/2, T, D] activations over the sequence, which is the attention's own.)"""
    import re
    import numpy as np
    from maxfp4.config import load_config
    from maxfp4.optim import make_optimizer, make_schedule
    from maxfp4.precision import resolve_policy
    from maxfp4.train import init_state, jit_train_step
    from tests.conftest import TINY
    cfg = load_config(None, TINY + ["mesh.data=1", *mesh])
    m = make_mesh(cfg.mesh, jax.devices()[:4])
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    optimizer = make_optimizer(cfg)
    state, state_sh = init_state(cfg, m, optimizer, policy)
    step = jit_train_step(cfg, policy, optimizer, make_schedule(cfg), m, state_sh, {})
    b, t, d, v = cfg.data.global_batch, cfg.data.seq_len, cfg.model.d_model, cfg.model.vocab_size
    batch = {k: np.zeros((b, t), np.float32 if k == "loss_mask" else np.int32)
             for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
    hlo = step.lower(state, batch).compile().as_text()
    gathered = set(re.findall(r"= f32\[([\d,]+)\]\S* all-gather", hlo))
    assert f"{v},{d}" not in gathered  # the table
    if cfg.mesh.context == 1:  # all or half of the rows, whole or half d_model
        assert not gathered & {f"{r},{t},{w}" for r in (b, b // 2) for w in (d, d // 2)}, gathered
