"""The FP8 recipes' ``fast_accumulation`` option reaches each GEMM as the dot's precision, which
XLA's GPU backend turns into cuBLASLt's fast accumulation (DEFAULT) or the precise one (HIGHEST):
checked here on the lowered StableHLO of each GEMM, for the plain recipes and for the fused
FP8 paths of the MLP, the q/k/v projection and the Mamba-2 mixer. tests/test_gpu_precision.py
checks the compiled cuBLASLt calls on a GPU."""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.compiler import fast_accumulation as xla_fast_accumulation
from maxfp4.compiler import fp8_gemms
from maxfp4.config import ConfigError, load_config
from maxfp4.model import get_model
from maxfp4.precision import resolve_policy
from maxfp4.precision.recipes.fp8 import fp8_current_dot, fp8_delayed_dot
from maxfp4.precision.state import init_precision_state, scales_of
from maxfp4.step import make_loss_fn

from tests.conftest import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
M, K, N = 64, 48, 80  # distinct, so each GEMM is known by its output shape
_DOT = re.compile(r"stablehlo\.dot_general .*precision = \[(\w+), (\w+)\].*-> tensor<(\d+)x(\d+)x\w+>")


def _policy(recipe: str, *option_overrides: str):
    cfg = load_config(None, [f"precision.default={recipe}", *option_overrides])
    return resolve_policy(cfg.precision, cfg.model.n_layers)


def _gemm_precisions(recipe: str, options) -> dict[str, str]:
    """{fprop, dgrad, wgrad: the operand precision of that GEMM's dot} of one layer's VJP."""
    fn = fp8_delayed_dot if recipe == "fp8_delayed" else fp8_current_dot
    x = jnp.ones((2, M // 2, K), jnp.bfloat16)
    w = jnp.ones((K, N), jnp.float32)
    scales = jnp.ones((3,), jnp.float32)

    def layer(x, w):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, options, scales, None), x, w)
        return (y,) + vjp(jnp.ones_like(y))

    names = {(M, N): "fprop", (M, K): "dgrad", (K, N): "wgrad"}
    found = {}
    for line in jax.jit(layer).lower(x, w).as_text().splitlines():
        m = _DOT.search(line)
        if m:
            assert m.group(1) == m.group(2), line  # both operands carry the same precision
            found[names[int(m.group(3)), int(m.group(4))]] = m.group(1)
    assert sorted(found) == ["dgrad", "fprop", "wgrad"], found
    return found


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current"])
@pytest.mark.parametrize("forward, backward", [(True, False), (True, True), (False, False), (False, True)])
def test_each_gemm_carries_the_configured_precision(recipe, forward, backward):
    policy = _policy(recipe, f"precision.recipes.{recipe}.fast_accumulation="
                             f"{{forward: {str(forward).lower()}, backward: {str(backward).lower()}}}")
    got = _gemm_precisions(recipe, policy.options_tuple(recipe))
    want = {True: "DEFAULT", False: "HIGHEST"}
    assert got == {"fprop": want[forward], "dgrad": want[backward], "wgrad": want[backward]}


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current"])
def test_default_is_transformer_engines_fast_forward_precise_backward(recipe):
    options = _policy(recipe).options_for(recipe)
    assert dict(options["fast_accumulation"]) == {"forward": True, "backward": False}
    assert _gemm_precisions(recipe, _policy(recipe).options_tuple(recipe)) == {
        "fprop": "DEFAULT", "dgrad": "HIGHEST", "wgrad": "HIGHEST"}
    # A recipe called with no options (tests, benchmarks) gets the same default.
    assert _gemm_precisions(recipe, ()) == {"fprop": "DEFAULT", "dgrad": "HIGHEST", "wgrad": "HIGHEST"}
    # One key given: the other keeps its default.
    partial = _policy(recipe, f"precision.recipes.{recipe}.fast_accumulation={{backward: true}}")
    assert dict(partial.options_for(recipe)["fast_accumulation"]) == {"forward": True, "backward": True}


@pytest.mark.parametrize("value", ["true", "{fwd: true}", "{forward: 1}", "[forward]"])
def test_bad_fast_accumulation_is_a_one_line_config_error(value):
    with pytest.raises(ConfigError) as error:
        _policy("fp8_delayed", f"precision.recipes.fp8_delayed.fast_accumulation={value}")
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("precision.recipes.fp8_delayed.fast_accumulation=")
    assert "forward, backward" in message


def _count_precisions(cfg) -> dict[str, int]:
    """Operand precisions of the dots of the loss gradient of ``cfg``'s model, with the FP8
    delayed-scaling state, so the fused FP8 paths (MLP, q/k/v, Mamba-2) are traced."""
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    model = get_model(cfg.model)
    params = jax.eval_shape(lambda k: model.init_params(cfg.model, k), jax.random.key(0))
    scales = scales_of(init_precision_state(policy, model.block_layer_classes))
    b, t = cfg.data.global_batch, cfg.data.seq_len
    ints = jax.ShapeDtypeStruct((b, t), jnp.int32)
    batch = {"inputs": ints, "targets": ints, "positions": ints, "segment_ids": ints, "loss_mask": ints}
    grad = jax.grad(make_loss_fn(cfg, policy), argnums=(0, 1))
    text = jax.jit(grad).lower(params, scales, batch, jax.random.key(0), jnp.float32(1.0)).as_text()
    counts: dict[str, int] = {}
    for p in re.findall(r"stablehlo\.dot_general .*precision = \[(\w+), \w+\]", text):
        counts[p] = counts.get(p, 0) + 1
    return counts


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_the_fused_fp8_paths_take_the_option_too(model):
    """Every FP8 layer of a block (dense: q/k/v, out, MLP up and down; hybrid: also the Mamba-2
    in and out projections) is traced once in the scanned body: its fprop with DEFAULT and its
    dgrad and wgrad with HIGHEST by default, none of them with fast backward, all three with
    precise forward."""
    base = TINY + ["precision.default=fp8_delayed", "precision.rules=[{classes: [lm_head], recipe: bf16}]"]
    files = [os.path.join(REPO, "configs", "hybrid-tiny.yaml")] if model == "hybrid" else None
    if model == "hybrid":
        base = [o for o in base if not o.startswith(("model.", "data.seq_len"))] + ["model.pattern=M*-"]
    layers = 6 if model == "hybrid" else 4

    def counts(option):
        option = f"precision.recipes.fp8_delayed.fast_accumulation={option}"
        return _count_precisions(load_config(files, base + [option]))

    # The SSD's FP32 matmuls of the Mamba-2 mixer ask for HIGHEST whatever the option.
    other = counts("{forward: true, backward: true}").get("HIGHEST", 0)
    if model == "dense":
        assert other == 0
    te = counts("{forward: true, backward: false}")
    assert te.get("HIGHEST", 0) - other == 2 * layers, te
    assert counts("{forward: false, backward: false}").get("HIGHEST", 0) - other == 3 * layers


def test_xla_fast_accumulation_rule_and_the_compiled_hlo_reader():
    """The rule XLA applies to a cuBLASLt FP8 GEMM's precision config, and the reader of the
    compiled HLO line (as XLA prints it, backend config as JSON) that the GPU tests use."""
    assert xla_fast_accumulation({"operand_precision": ["DEFAULT", "DEFAULT"], "algorithm": "ALG_UNSET"})
    assert not xla_fast_accumulation({"operand_precision": ["HIGHEST", "HIGHEST"], "algorithm": "ALG_UNSET"})
    assert not xla_fast_accumulation({"operand_precision": ["DEFAULT", "HIGH"]})
    assert xla_fast_accumulation({"operand_precision": ["HIGHEST", "HIGHEST"],
                                  "algorithm": "ALG_DOT_ANY_F8_ANY_F8_F32_FAST_ACCUM"})
    assert not xla_fast_accumulation({"operand_precision": ["DEFAULT", "DEFAULT"],
                                      "algorithm": "ALG_DOT_ANY_F8_ANY_F8_F32"})
    line = ('  %cublas-lt-matmul.2 = (bf16[64,80]{1,0}, s8[33554432]{0}) custom-call(f8e4m3fn[64,48]{1,0} %a, '
            'f8e4m3fn[80,48]{1,0} %b, f32[] %sa, f32[] %sb), custom_call_target="__cublas$lt$matmul$f8", '
            'backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,'
            '"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"]},'
            '"precision_config":{"operand_precision":["HIGHEST","HIGHEST"],"algorithm":"ALG_UNSET"},'
            '"epilogue":"DEFAULT"},"force_earliest_schedule":false}')
    (gemm,) = fp8_gemms("HloModule m\n" + line + "\n  %other = f32[] add(f32[] %x, f32[] %y)\n")
    assert gemm["name"] == "cublas-lt-matmul.2" and gemm["dtype"] == "bf16" and gemm["shape"] == (64, 80)
    assert gemm["fast_accumulation"] is False
    assert gemm["dims"]["lhs_contracting_dimensions"] == ["1"]
    # A GEMM line without a precision config is an error that shows the line, not a guess.
    with pytest.raises(ValueError, match="cublas-lt-matmul.2"):
        fp8_gemms(line.replace('"precision_config"', '"other_config"'))


def test_precise_and_fast_accumulation_give_the_same_values_off_gpu():
    """Off the GPU the precision changes nothing (XLA's CPU backend accumulates FP32 either
    way), so CPU results and their tests do not depend on the option."""
    x = jax.random.normal(jax.random.key(0), (2, M // 2, K), jnp.bfloat16)
    w = 0.1 * jax.random.normal(jax.random.key(1), (K, N), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (2, M // 2, N), jnp.bfloat16)
    scales = jnp.asarray([30.0, 2000.0, 500.0], jnp.float32)

    def run(option):
        opts = _policy("fp8_delayed", f"precision.recipes.fp8_delayed.fast_accumulation={option}"
                       ).options_tuple("fp8_delayed")
        y, vjp = jax.vjp(lambda x, w: fp8_delayed_dot(x, w, opts, scales, None), x, w)
        return [np.asarray(a, np.float32) for a in (y, *vjp(dy)[:2])]

    for a, b in zip(run("{forward: true, backward: true}"), run("{forward: false, backward: false}")):
        np.testing.assert_array_equal(a, b)
