"""The Hugging Face export loaded by transformers itself (PyTorch on the GPU machine): logits of
a small trained dense and hybrid model against maxfp4's forward on the same token ids, and
AutoTokenizer's ids against the pipeline's on a few thousand documents.

    python -m pytest -m gpu tests/test_gpu_hf.py
"""

import io

import numpy as np
import pytest

from maxfp4.config import load_config
from maxfp4.train import train

pytestmark = pytest.mark.gpu

COMMON = ["data.source=builtin", "data.seq_len=128", "data.global_batch=16", "train.steps=60", "train.log_every=20",
          "optim.lr=3e-3", "optim.warmup_steps=5", "model.vocab_size=2048", "model.d_model=256", "model.n_heads=4",
          "model.n_kv_heads=2", "checkpoint.async=false"]
DENSE = COMMON + ["run.name=dense", "model.n_layers=4", "model.d_ff=768", "model.rope_theta=50000"]
HYBRID = COMMON + ["run.name=hybrid", "model.kind=hybrid", "model.pattern=M*-M-M-", "model.d_ff=512",
                   "model.rope=false", "model.mlp=relu2", "model.mamba.d_state=64", "model.mamba.head_dim=32",
                   "model.mamba.n_groups=2", "model.mamba.chunk_size=64"]


def _trained_export(tmp_path, overrides):
    from maxfp4.interop.export import export
    cfg = load_config(None, overrides + [f"run.output_dir={tmp_path}"])
    train(cfg, stream=io.StringIO())
    out = tmp_path / (cfg.run.name + "_hf")
    export(cfg.run_dir, str(out), dtype="fp32")  # the master weights exactly: only the forwards differ
    return cfg, out


def _maxfp4_logits(cfg, ids):
    import jax
    import jax.numpy as jnp

    from maxfp4.checkpoint import finalized_steps, read_params
    from maxfp4.model import abstract_params, get_model
    from maxfp4.precision import resolve_policy
    model = get_model(cfg.model)
    abstract = abstract_params(cfg.model, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    params = read_params(cfg.run_dir, finalized_steps(cfg.run_dir)[-1], abstract)
    t = ids.shape[1]
    logits = model.forward(params, jnp.asarray(ids), jnp.broadcast_to(jnp.arange(t), ids.shape),
                           jnp.ones(ids.shape, jnp.int32), cfg=cfg.model,
                           policy=resolve_policy(cfg.precision, cfg.model.n_layers))
    return np.asarray(logits, np.float64)


def _transformers_logits(directory, ids):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = model(torch.as_tensor(ids, device="cuda")).logits
    return out.double().cpu().numpy(), type(model).__name__


@pytest.mark.parametrize("overrides, architecture", [(DENSE, "LlamaForCausalLM"), (HYBRID, "NemotronHForCausalLM")])
def test_transformers_loads_the_export_with_maxfp4s_logits(tmp_path, overrides, architecture):
    cfg, directory = _trained_export(tmp_path, overrides)
    ids = np.random.default_rng(0).integers(4, cfg.model.vocab_size, size=(2, 128))
    want = _maxfp4_logits(cfg, ids)
    got, name = _transformers_logits(directory, ids)
    assert name == architecture
    # maxfp4 computes in BF16 (activations and GEMM operands rounded to 8 significant bits, FP32
    # accumulation, BF16 logits) and transformers here in FP32: the difference is maxfp4's
    # rounding, which the CPU test measured at 0.44% of the largest logit for two blocks; 3% leaves
    # room for depth and the Mamba mixers (their BF16 intermediates). A layout error moves the
    # logits by tens of percent.
    scale = np.max(np.abs(got))
    err = np.max(np.abs(got - want))
    print(f"{architecture}: max |transformers - maxfp4| = {err:.4f} = {err / scale:.3%} of max |logit| {scale:.3f}")
    assert err <= 0.03 * scale
    top2 = np.sort(got, -1)[..., -2:]
    clear = top2[..., 1] - top2[..., 0] > 0.05 * scale  # positions where the top token is not a near-tie
    assert np.array_equal(np.argmax(got, -1)[clear], np.argmax(want, -1)[clear])


def test_autotokenizer_ids_equal_the_pipelines_on_thousands_of_documents(tmp_path):
    from transformers import AutoTokenizer

    from maxfp4.data.corpus import tokenize_documents
    from maxfp4.data.sources import builtin_documents
    from maxfp4.data.tokenizer import Tokenizer
    cfg, directory = _trained_export(tmp_path, DENSE + ["train.steps=2", "optim.warmup_steps=1"])
    docs = builtin_documents()
    docs = docs + [p for doc in docs for p in doc.split("\n\n") if p.strip()]
    assert len(docs) > 2000
    sp = Tokenizer(f"{cfg.run_dir}/tokenizer.model")
    hf = AutoTokenizer.from_pretrained(str(directory))
    got = hf(docs).input_ids
    want = [list(map(int, d)) for d in tokenize_documents(docs, sp)]
    mismatched = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    print(f"{len(docs)} documents, {len(mismatched)} tokenized differently")
    assert not mismatched
