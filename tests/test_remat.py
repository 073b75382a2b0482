"""What each remat policy keeps for the backward pass, read from JAX's own list of the saved
residuals of the tiny model's loss, and that keeping more does not change the gradients."""

import collections
import contextlib
import io
import re

import jax
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from maxfp4.parallel.mesh import make_mesh
from maxfp4.model import remat
from maxfp4.optim import make_optimizer
from maxfp4.precision import GEMM_WEIGHT, resolve_policy
from maxfp4.precision.state import scales_of
from maxfp4.step import make_loss_fn
from maxfp4.train import init_state
from tests.test_step import _batch

FP8 = "f8_e4m3fn"


def _loss_and_params(cfg):
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    state, _ = init_state(cfg, mesh, make_optimizer(cfg))
    loss_fn = make_loss_fn(cfg, resolve_policy(cfg.precision, cfg.model.n_layers), mesh)
    batch = _batch(cfg)
    scales = scales_of(state.precision)  # the delayed-scaling state's scales ({} for the others)
    return (lambda p: loss_fn(p, scales, batch, jax.random.key(0), 1.0)), state.params


def _residuals(loss, params) -> collections.Counter:
    """(dtype, shape) of each residual JAX saves for the backward pass, counted. Its public report
    is printed, one line a residual: "dtype[shape] <why> from <where>"."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss, params)
    found = re.findall(r"^(\w+)\[([\d,]*)\] ", out.getvalue(), re.MULTILINE)
    return collections.Counter((dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in found)


@pytest.mark.parametrize("recipe,dtype", [("fp8_delayed", FP8), ("bf16", "bf16")])
def test_save_gemm_io_keeps_each_linear_input_in_its_recipes_format(tiny_cfg, recipe, dtype):
    """Beyond what save_gemm keeps, save_gemm_io keeps exactly the four block GEMMs' activation
    operands (qkv, attention output, MLP up, MLP down; [blocks, tokens, in features], the scanned
    blocks' stacked residuals) as the recipe's backward reads them: FP8 bytes for FP8, BF16 for
    BF16. The gradients agree with save_gemm's (the same math; 1e-2 relative L2 for BF16 chains
    that XLA fuses differently)."""
    kept, grads = {}, {}
    for remat in ("save_gemm", "save_gemm_io"):
        cfg = tiny_cfg("mesh.data=1", f"train.remat={remat}", f"precision.default={recipe}")
        loss, params = _loss_and_params(cfg)
        kept[remat] = _residuals(loss, params)
        grads[remat] = jax.device_get(jax.jit(jax.grad(loss))(params))
    m, tokens = cfg.model, cfg.data.global_batch * cfg.data.seq_len
    inputs = (m.d_model, m.n_heads * m.resolved_head_dim, m.d_model, m.d_ff)
    expected = collections.Counter((dtype, (m.n_layers, tokens, k)) for k in inputs)
    assert kept["save_gemm_io"] - kept["save_gemm"] == expected, kept["save_gemm_io"] - kept["save_gemm"]
    for a, b in zip(jax.tree.leaves(grads["save_gemm_io"]), jax.tree.leaves(grads["save_gemm"])):
        assert np.linalg.norm(a - b) <= 1e-2 * max(np.linalg.norm(b), 1e-30)


def test_save_gemm_keeps_the_fp8_amaxes(tiny_cfg):
    """save_gemm keeps each per-tensor amax the FP8 recipe reduces in the forward pass (a float32
    a block, stacked over the scanned blocks): recomputing one would re-read its whole operand in
    the backward pass. At least one a linear layer's activation operand (qkv, attention output,
    MLP up, MLP down); BF16 reduces none. The gradients are full remat's bit for bit: there the
    backward pass recomputes every amax from its operand."""
    kept, grads = {}, {}
    for recipe, remat in (("fp8_delayed", "save_gemm"), ("bf16", "save_gemm"), ("fp8_delayed", "full")):
        cfg = tiny_cfg("mesh.data=1", f"train.remat={remat}", f"precision.default={recipe}")
        loss, params = _loss_and_params(cfg)
        kept[recipe, remat] = _residuals(loss, params)
        grads[recipe, remat] = jax.device_get(jax.jit(jax.grad(loss))(params))
    per_block = ("f32", (cfg.model.n_layers,))
    assert kept["fp8_delayed", "save_gemm"][per_block] - kept["bf16", "save_gemm"][per_block] >= 4, kept
    for a, b in zip(jax.tree.leaves(grads["fp8_delayed", "save_gemm"]), jax.tree.leaves(grads["fp8_delayed", "full"])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("recipe,dtype", [("fp8_delayed", FP8), ("bf16", "bf16")])
def test_unrolled_blocks_keep_the_cast_weights_not_fp32_copies(tiny_cfg, monkeypatch, recipe, dtype):
    """Unrolled blocks (scan_layers=false) under save_gemm keep, beyond what scanned blocks keep,
    exactly each block's four linear weights as the recipe's backward reads them (E4M3 for FP8,
    BF16 for BF16; [in, out]), and no FP32 weight: those are slices of the stacked parameters,
    and one kept for the backward pass to cast again is a copy of it. The gradients are bit for
    bit those of the same policy without the weights (the name renamed away), which casts them
    again in the backward pass."""
    m = tiny_cfg().model
    inner = m.n_heads * m.resolved_head_dim
    weights = ((m.d_model, inner + 2 * m.n_kv_heads * m.resolved_head_dim), (inner, m.d_model),
               (m.d_model, 2 * m.d_ff), (m.d_ff, m.d_model))
    kept, grads = {}, {}
    for scan, weight_name in (("false", remat.GEMM_WEIGHT), ("true", remat.GEMM_WEIGHT), ("false", "no such name")):
        monkeypatch.setattr(remat, "GEMM_WEIGHT", weight_name)
        cfg = tiny_cfg("mesh.data=1", "train.remat=save_gemm", f"precision.default={recipe}",
                       f"train.scan_layers={scan}")
        loss, params = _loss_and_params(cfg)
        kept[scan, weight_name] = _residuals(loss, params)
        grads[scan, weight_name] = jax.device_get(jax.jit(jax.grad(loss))(params))
    unrolled, scanned = kept["false", GEMM_WEIGHT], kept["true", GEMM_WEIGHT]
    expected = collections.Counter({(dtype, shape): m.n_layers for shape in weights})
    assert collections.Counter({k: n for k, n in (unrolled - scanned).items() if k in expected}) == expected, unrolled
    assert not [k for k in unrolled if k[0] == "f32" and k[1] in weights], unrolled
    recast = kept["false", "no such name"]
    assert [k for k in recast if k[0] == "f32" and k[1] in weights], recast  # the copies the test is about
    for a, b in zip(jax.tree.leaves(grads["false", GEMM_WEIGHT]), jax.tree.leaves(grads["false", "no such name"])):
        np.testing.assert_array_equal(a, b)
