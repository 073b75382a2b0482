"""Mixture-of-experts models in and out of Hugging Face layouts: hybrid MoE as NemotronH (its E
layers), attention + MoE as Mixtral; sampling from a trained MoE run. The GPU test loads the
export with transformers (PyTorch) and compares logits with maxfp4's forward.

    python -m pytest -m gpu tests/test_moe_hf.py
"""

import io

import jax
import numpy as np
import pytest

from maxfp4.config import load_config
from maxfp4.interop import hf

NEMOTRON_H_MOE = ["model.mlp=relu2"]
MIXTRAL = ["model.pattern=*E*E", "model.moe.score=softmax", "model.moe.shared_experts=0", "model.rope=true"]


@pytest.mark.parametrize("overrides, architecture, model_type", [
    (NEMOTRON_H_MOE, "NemotronHForCausalLM", "nemotron_h"), (MIXTRAL, "MixtralForCausalLM", "mixtral")])
def test_moe_parameters_round_trip_through_the_hugging_face_layout(overrides, architecture, model_type):
    """Every parameter to its Hugging Face tensors and back, bit for bit; the shapes from shapes
    alone agree; transformers' config class reads the config (E layers as ``moe``)."""
    from transformers import AutoConfig

    from maxfp4.model import get_model
    cfg = load_config("configs/tiny-moe.yaml", overrides).model
    assert hf.architecture(cfg) == architecture
    params = get_model(cfg).init_params(cfg, jax.random.key(0))
    hf.check_covers(cfg, params)
    tensors = dict(hf.hf_tensors(cfg, params))
    assert {k: v.shape for k, v in tensors.items()} == dict(hf.hf_tensor_shapes(cfg, jax.eval_shape(lambda: params)))
    for leaf, j, layer in hf.ordered_slices(cfg):
        a = np.asarray(hf.leaf_of(params, leaf.path))
        a = a if j is None else a[j]
        np.testing.assert_array_equal(
            hf.from_hf(leaf.kind, [tensors[n] for n in leaf.hf_names(layer)], a.shape, leaf.parts), a)
    c = hf.hf_config(cfg, max_positions=64, dtype="float32", bos_id=1, eos_id=2, pad_id=0, provenance={})
    read = AutoConfig.for_model(model_type, **{k: v for k, v in c.items() if k not in ("model_type", "architectures")})
    assert read.num_experts_per_tok == 2 and read.num_local_experts == 8
    if model_type == "nemotron_h":
        assert read.layers_block_type.count("moe") == 2
        assert "backbone.layers.5.mixer.experts.7.down_proj.weight" in tensors
        assert read.moe_shared_expert_intermediate_size == cfg.moe.d_ff
    else:
        assert read.num_hidden_layers == 2 and "model.layers.1.block_sparse_moe.experts.7.w3.weight" in tensors


@pytest.mark.parametrize("overrides, message", [
    (["model.moe.shared_experts=0", "model.mlp=relu2"], "model.moe.shared_experts=0: NemotronH's MoE layers"),
    (["model.moe.score=softmax", "model.mlp=relu2"], "model.moe.score=softmax: NemotronH routes by sigmoid"),
    (MIXTRAL[:3] + ["model.rope=false"], "model.rope=false: Mixtral's attention rotates"),
])
def test_moe_models_hugging_face_cannot_hold_are_refused_in_one_line(overrides, message):
    with pytest.raises(hf.HFError, match=message):
        hf.check_maps(load_config("configs/tiny-moe.yaml", overrides).model)


def test_sample_runs_on_a_trained_moe_run(tmp_path):
    from maxfp4.interop.sample import main as sample_main
    from maxfp4.train import train
    cfg = load_config("configs/tiny-moe.yaml", [
        "model.pattern=*E", "model.d_model=32", "model.moe.d_ff=32", "data.seq_len=32", "data.global_batch=4",
        "train.steps=2", "optim.warmup_steps=1", "resilience.preflight=false", "checkpoint.async=false",
        f"run.output_dir={tmp_path}"])
    train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    # The routers' aux-loss-free bias comes from the checkpoint's train state: two steps moved the
    # E block's row by the rate (1e-3) each step, the attention block's row stays 0.
    from maxfp4.interop.sample import load_run
    bias = np.asarray(load_run(cfg.run_dir, jax.devices()[0]).params["router_bias"])
    assert np.all(bias[0] == 0) and 0 < np.max(np.abs(bias[1])) <= 2e-3 * (1 + 1e-6)
    assert sample_main([cfg.run_dir, "--max-tokens", "4", "--prompt", "The"]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("overrides, architecture", [
    (NEMOTRON_H_MOE, "NemotronHForCausalLM"), (MIXTRAL, "MixtralForCausalLM")])
def test_transformers_loads_the_moe_export_with_maxfp4s_logits(tmp_path, overrides, architecture):
    """Trained without the aux-loss-free bias (it is train state, not exported): transformers'
    logits within 3% of the largest of maxfp4's BF16 forward (tests/test_gpu_hf.py's bound)."""
    from tests.test_gpu_hf import _maxfp4_logits, _transformers_logits

    from maxfp4.interop.export import export
    from maxfp4.train import train
    cfg = load_config("configs/tiny-moe.yaml", overrides + [
        "model.moe.bias_update_rate=0", "train.steps=40", "checkpoint.async=false", f"run.output_dir={tmp_path}"])
    train(cfg, stream=io.StringIO())
    out = tmp_path / "hf"
    export(cfg.run_dir, str(out), dtype="fp32")
    ids = np.random.default_rng(0).integers(4, cfg.model.vocab_size, size=(2, 64))
    want = _maxfp4_logits(cfg, ids)
    got, name = _transformers_logits(out, ids)
    assert name == architecture
    assert np.max(np.abs(got - want)) <= 0.03 * np.max(np.abs(got))
