"""maxfp4's lm-eval model against lm-eval's own Hugging Face backend (``hf``, transformers +
torch) on the export of the same checkpoint: the same requests, the same log-likelihoods within
BF16 rounding. Marked gpu: torch is not in the CPU test extra (its wheel pulls gigabytes of CUDA
libraries); the GPU image has torch and transformers (``pip install lm-eval`` there). It also runs
on a CPU machine that has torch: ``python -m pytest -m gpu tests/test_lm_eval_hf.py``."""

import io

import pytest

from maxfp4.config import load_config
from tests.conftest import TINY

pytestmark = pytest.mark.gpu

RUN = TINY + ["run.name=hf_parity", "data.source=builtin", "model.vocab_size=512", "train.steps=3", "optim.lr=3e-3",
              "mesh.data=1"]
PAIRS = [("The cat sat on the", " mat"), ("The cat sat on the", " sky above the river"),
         ("Once upon a time", " there was a king"), ("Water is made of hydrogen and", " oxygen"),
         ("One, two, three, four,", " five"), ("", "Hello world"), ("He wrote a letter to his ", "friend")]
TEXTS = ["The sea is calm tonight.", " ".join(["the river flows to the sea"] * 12)]  # the second: several windows


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    import jax

    from maxfp4.interop.export import export
    from maxfp4.train import train

    out = tmp_path_factory.mktemp("lm_eval_hf")
    train(load_config(None, RUN + [f"run.output_dir={out}"]), devices=jax.devices()[:1], stream=io.StringIO())
    export(str(out / "hf_parity"), str(out / "export"), dtype="fp32")  # the FP32 master weights exactly
    return out / "export"


def _hf_lm(export_dir, bos_id: int, max_length: int, add_bos: bool):
    """lm-eval's HFLM over the export in FP32, reading every text after BOS as maxfp4 does. The
    export's tokenizer adds BOS and EOS around a text (a training document); a scored context
    continues, so its EOS is left off. ``add_bos``: BOS before every encoded text (contexts);
    without it, as rolling windows need (their prefix token is BOS already: with it they would
    read BOS twice and score the second)."""
    import torch
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(export_dir), add_bos_token=add_bos, add_eos_token=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return HFLM(pretrained=str(export_dir), tokenizer=tokenizer, dtype="float32", device=device, batch_size=4,
                add_bos_token=add_bos, prefix_token_id=bos_id, max_length=max_length)


def test_log_likelihoods_equal_lm_evals_hugging_face_backend(export_dir):
    from lm_eval.api.instance import Instance

    from maxfp4.lm_eval_adapter import MaxFP4LM
    from maxfp4.lm_eval_cli import load_eval_model

    model = load_eval_model(str(export_dir), bf16=True)
    ours = MaxFP4LM(model.params, model.model_cfg, model.tokenizer, policy=model.policy,
                    max_length=model.max_length, rows=4)
    theirs = _hf_lm(export_dir, model.tokenizer.bos_id, model.max_length, add_bos=True)

    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)]
    got, want = ours.loglikelihood(requests), theirs.loglikelihood(requests)
    for pair, (g, _), (w, _) in zip(PAIRS, got, want):
        n_tokens = len(ours._encode_pair(*pair)[1]) if pair[0] else len(ours.tok_encode(pair[1], add_special_tokens=False))
        # maxfp4 runs BF16 GEMMs (operands and activations rounded to 8 significant bits, FP32
        # accumulation); the hf backend runs the same weights in FP32: each scored token's
        # log-probability within 0.02 nats (measured on CPU: at most 0.0005, rolling windows
        # included). A token, position or BOS off by one moves it by nats.
        assert abs(g - w) <= 0.02 * n_tokens, (pair, g, w)
    rolling = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate(TEXTS)]
    theirs = _hf_lm(export_dir, model.tokenizer.bos_id, model.max_length, add_bos=False)
    for text, g, w in zip(TEXTS, ours.loglikelihood_rolling(rolling), theirs.loglikelihood_rolling(rolling)):
        n_tokens = len(ours.tok_encode(text, add_special_tokens=False))
        assert abs(g - w) <= 0.02 * n_tokens, (text[:20], g, w)
