"""The recipe catalog and records: one set of facts per recipe that the registry, policy, metrics,
planner and state read; MXFP8 as a first-class recipe; rules that match no layer of a model."""

import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.config import ConfigError, PrecisionConfig, load_config
from maxfp4.metrics import DEVICE_PEAKS_TFLOPS, policy_peak_tflops
from maxfp4.model_spec import model_spec
from maxfp4.precision import catalog, formats as F
from maxfp4.precision.policy import resolve_policy, unmatched_rules
from maxfp4.precision.recipes.fp8_block import FP8_BLOCK_TILE
from maxfp4.precision.registry import RECIPES

from tests.conftest import TINY

MXFP8_PRESET = "configs/precision/mxfp8.yaml"


def test_registry_holds_one_record_per_catalog_entry():
    assert tuple(RECIPES) == catalog.RECIPE_NAMES
    for name, record in RECIPES.items():
        assert record.name == name and record.spec is catalog.SPECS[name]
        assert record.spec.peak in catalog.PEAK_CLASSES
        assert (record.init_state is not None) == record.spec.stateful
    # Only delayed scaling keeps state, only it offers fused operand hooks today.
    assert [n for n, r in RECIPES.items() if r.spec.stateful] == ["fp8_delayed"]
    assert [n for n, r in RECIPES.items() if r.fused is not None] == ["fp8_delayed"]
    assert RECIPES["fp8_delayed"].fused.recipe == "fp8_delayed"


def test_catalog_block_sizes_are_the_formats_blocks():
    assert catalog.NVFP4.block == F.NVFP4_BLOCK
    assert catalog.MXFP8.block == catalog.MXFP4.block == F.MX_BLOCK
    assert catalog.FP8_BLOCK.block == FP8_BLOCK_TILE
    assert [n for n, s in catalog.SPECS.items() if not s.block] == ["bf16", "fp32", "fp8_delayed", "fp8_current"]


@pytest.mark.parametrize("name", ["nvfp4", "mxfp8", "mxfp4", "fp8_block"])
def test_each_block_recipe_refuses_what_its_catalog_block_forbids(name):
    """The block the policy checks layers against (catalog) is the one the dot needs: a layer of
    one block's width runs, half a block more does not tile."""
    record = RECIPES[name]
    block = record.spec.block
    options = tuple(sorted(catalog.with_defaults(record.spec.defaults, {}).items()))
    policy = resolve_policy(PrecisionConfig(default=name), 1)
    x = jnp.ones((block, block), jnp.bfloat16)
    y = record.dot(x, jnp.ones((block, block), jnp.float32), options, None, jax.random.key(0))
    assert y.shape == (block, block) and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
    with pytest.raises(ConfigError, match=f"multiples of {block}"):
        from maxfp4.precision.policy import check_block_divisibility
        check_block_divisibility(policy, {"mlp_up": (block, block + block // 2)})


def test_option_schema_comes_from_the_catalog():
    cfg = PrecisionConfig(default="fp8_delayed", recipes={"fp8_delayed": {"amax_history": 8}})
    opts = resolve_policy(cfg, 2).options_for("fp8_delayed")
    assert opts["amax_history"] == 8 and opts["margin"] == catalog.FP8_DELAYED.defaults["margin"]
    with pytest.raises(ConfigError, match=r"precision\.recipes\.fp8_delayed\.amax_history=0: expected an integer >= 1"):
        load_config(None, ["precision.recipes={fp8_delayed: {amax_history: 0}}"])
    with pytest.raises(ConfigError, match=r"precision\.recipes\.mxfp8\.block: unknown option; expected one of none"):
        load_config(None, ["precision.recipes={mxfp8: {block: 16}}"])


# ----------------------------------------------------------------------------- MXFP8 first-class


def test_mxfp8_preset_resolves_and_is_charged_its_own_peak():
    cfg = load_config(MXFP8_PRESET, TINY)
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    assert {r for row in policy.block_table for r in row} == {"mxfp8"} and policy.lm_head == "bf16"
    # Hopper has no block-scaled FP8 GEMM: every GEMM is charged at BF16, as the emulation runs.
    h100 = DEVICE_PEAKS_TFLOPS["H100"]
    assert policy_peak_tflops(cfg.model, cfg.data.seq_len, policy, h100) == pytest.approx(h100["bf16"], rel=1e-12)
    # Blackwell: the blocks' GEMMs at the MXFP8 peak, the rest at BF16 (harmonic mix by FLOPs).
    b200 = DEVICE_PEAKS_TFLOPS["B200"]
    blocks = 6.0 * sum(sum(b.values()) for b in model_spec(cfg.model).block_linear_params())
    total = 6.0 * (sum(sum(b.values()) for b in model_spec(cfg.model).block_linear_params())
                   + cfg.model.d_model * cfg.model.vocab_size)
    other = total - blocks + model_spec(cfg.model).attention_flops_per_token(cfg.data.seq_len)
    want = (blocks + other) / (blocks / b200["mxfp8"] + other / b200["bf16"])
    assert policy_peak_tflops(cfg.model, cfg.data.seq_len, policy, b200) == pytest.approx(want, rel=1e-12)


def test_planner_reads_mxfp8_bytes_from_the_catalog():
    from maxfp4.plan.cost import GEMM_IN_BYTES, WORKING_BYTES, memory_per_device
    assert WORKING_BYTES["mxfp8"] == 1 + 1 / 32 and GEMM_IN_BYTES["mxfp8"] == 2.0
    assert WORKING_BYTES["fp8"] == catalog.FP8_DELAYED.weight_bytes and WORKING_BYTES["bf16"] == 2.0
    # Unrolled blocks under save_gemm keep every block's working shard: the bytes show in the total.
    cfg = load_config("configs/dense-1p3b.yaml", ["train.scan_layers=false"])
    m = cfg.model
    working = {p: memory_per_device(cfg, (1, 8, 1), 1_300_000_000, p, "save_gemm")["working_copy"]
               for p in ("bf16", "mxfp8", "fp8")}
    largest = max(sum(b.values()) for b in model_spec(m).block_linear_params())
    want = max(largest * (1 + 1 / 32), m.d_model * m.vocab_size * 2) + model_spec(m).block_matmul_params * (1 + 1 / 32) / 8
    assert working["mxfp8"] == pytest.approx(want, rel=1e-12)
    assert working["fp8"] < working["mxfp8"] < working["bf16"], working


def test_mxfp8_preset_trains_on_cpu(tmp_path):
    """A few steps of the tiny model under configs/precision/mxfp8.yaml: every loss finite, and
    falling (measured 6.23 -> 5.70 over 8 steps of the builtin corpus at lr 3e-3)."""
    from maxfp4.train import train
    cfg = load_config(MXFP8_PRESET, TINY + ["data.source=builtin", "model.vocab_size=512", "train.steps=8",
                                            "optim.lr=3e-3", "optim.warmup_steps=2", f"run.output_dir={tmp_path}"])
    recs = train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    losses = [r["loss"] for r in recs]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.3, losses
    table = (tmp_path / cfg.run.name / "precision_table.txt").read_text()
    assert "mxfp8" in table and "lm_head: bf16" in table and "warning" not in table


# ----------------------------------------------------------------------------- rules that match nothing

DENSE = [{"attn_qkv", "attn_out", "mlp_up", "mlp_down"}] * 4
HYBRID = [{"mamba_in", "mamba_out"}, {"attn_qkv", "attn_out"}, {"mlp_up", "mlp_down"}, {"mamba_in", "mamba_out"}]


def test_shipped_presets_match_every_model_they_name():
    """The presets are shared by dense and hybrid models: none of their rules is reported."""
    for preset in ("bf16", "fp8", "fp8-pow2", "nvfp4", "mxfp8"):
        cfg = load_config(f"configs/precision/{preset}.yaml", TINY)
        for blocks in (DENSE, HYBRID):
            assert unmatched_rules(cfg.precision, len(blocks), blocks) == [], preset


def test_rule_for_absent_classes_is_reported_not_refused():
    cfg = PrecisionConfig(default="fp8_current", rules=(
        {"classes": ["lm_head"], "recipe": "bf16"},
        {"classes": ["mamba_in", "mamba_out"], "recipe": "bf16"},  # Mamba stays BF16 where there is one
        {"layers": [1], "classes": ["mamba_in"], "recipe": "bf16"},  # block 1 of HYBRID is attention
        {"layers": "-1:", "classes": ["mamba_out", "mlp_down"], "recipe": "bf16"}))
    dense = unmatched_rules(cfg, 4, DENSE)
    assert [line.split(" ")[0] for line in dense] == ["precision.rules[1]", "precision.rules[2]"]
    assert "matches no layer of this model" in dense[0] and "mamba_in" in dense[0]
    assert "attn_qkv, attn_out, mlp_up, mlp_down, lm_head" in dense[0]
    hybrid = unmatched_rules(cfg, 4, HYBRID)
    assert [line.split(" ")[0] for line in hybrid] == ["precision.rules[2]"]
    assert all("\n" not in line for line in dense + hybrid)
    # Resolution is unchanged: the rule simply decides nothing.
    with_rules, without = (resolve_policy(c, 4) for c in (cfg, PrecisionConfig("fp8_current", cfg.rules[:1] + cfg.rules[3:])))
    assert all(with_rules.recipe_for(c, i) == without.recipe_for(c, i) for i, classes in enumerate(DENSE) for c in classes)


def test_slice_selecting_no_block_is_an_error_percentages_fit_every_depth():
    with pytest.raises(ConfigError, match=r"precision\.rules\[0\]\.layers='4:': selects no block of 2"):
        load_config(None, TINY + ["precision.rules=[{layers: '4:', recipe: bf16}]"])
    load_config(None, TINY + ["precision.rules=[{layers: '-12%:', recipe: bf16}]"])


def test_training_shows_the_unmatched_rule(tmp_path, capfd):
    """On a dense model a Mamba rule is printed as a warning on stderr and kept in the saved
    precision table; the run goes on."""
    from maxfp4.train import train
    cfg = load_config(None, TINY + ["train.steps=1", f"run.output_dir={tmp_path}",
                                    "precision.rules=[{classes: [mamba_in, mamba_out], recipe: fp8_current}]"])
    recs = train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    assert len(recs) == 1 and np.isfinite(recs[0]["loss"])
    err = capfd.readouterr().err
    assert "warning: precision.rules[0] (classes ['mamba_in', 'mamba_out']) matches no layer" in err
    assert "warning: precision.rules[0]" in (tmp_path / cfg.run.name / "precision_table.txt").read_text()
