"""Downstream tasks through lm-evaluation-harness (maxfp4.lm_eval_*): the real lm-eval on the tiny
local tasks in tests/data/lm_eval (JSON lines read offline), scored by maxfp4's forward pass during
training (train.eval_tasks) and from the command line (python -m maxfp4.evaluate); its
log-likelihoods checked against a float64 NumPy forward of the export. tests/test_lm_eval_hf.py
compares them with lm-eval's Hugging Face backend (it needs torch)."""

import io
import json
import math
import os

import numpy as np
import pytest

from maxfp4.config import load_config
from tests.conftest import TINY

TASKS = os.path.join(os.path.dirname(__file__), "data", "lm_eval")
CLOZE, TEXT, ECHO = (os.path.join(TASKS, f"{name}.yaml") for name in ("tiny_cloze", "tiny_text", "tiny_echo"))
# The tiny dense model on the builtin corpus (it needs a tokenizer), two steps on a two-device
# mesh, the cloze task scored at step 2 (the last) beside the held-out loss.
RUN = TINY + ["run.name=tasks", "data.source=builtin", "model.vocab_size=512", "train.steps=2", "optim.lr=3e-3",
              "data.eval_fraction=0.1", "train.eval_every=2", f"train.eval_tasks=[{CLOZE}]"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    import jax

    from maxfp4.train import train

    out = tmp_path_factory.mktemp("lm_eval")
    stream = io.StringIO()
    train(load_config(None, RUN + [f"run.output_dir={out}"]), devices=jax.devices()[:2], stream=stream)
    return out / "tasks"


def test_training_logs_the_task_scores_beside_the_held_out_loss(run_dir):
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    last = records[-1]
    assert last["step"] == 2 and "eval_loss" in last
    # 8 questions: acc is a multiple of 1/8 (a score lm-eval computed, not a default).
    assert 0 <= last["lm_eval/tiny_cloze/acc"] <= 1 and (8 * last["lm_eval/tiny_cloze/acc"]).is_integer()
    assert "lm_eval/tiny_cloze/acc_norm" in last
    assert not any(k.startswith("lm_eval/") for k in records[0])  # step 1 was not evaluated
    saved = json.loads((run_dir / "evals" / "step_2.json").read_text())
    assert saved["results"]["tiny_cloze"]["acc,none"] == last["lm_eval/tiny_cloze/acc"]
    assert saved["maxfp4"] == {"source": str(run_dir), "step": 2, "precision": "bf16"}
    # TensorBoard got them through the metrics' scalar path.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [e.value for e in events.Scalars("lm_eval/tiny_cloze/acc")] == pytest.approx([last["lm_eval/tiny_cloze/acc"]])
    # The plot draws them on the held-out loss panel.
    from matplotlib.lines import Line2D

    from maxfp4.plot import draw

    fig = draw([str(run_dir)])
    lines = {line.get_gid(): line for line in fig.findobj(Line2D)}
    assert list(lines["tasks:lm_eval/tiny_cloze/acc"].get_xdata()) == [2]
    assert "tasks:eval_loss" in lines


def test_the_command_scores_the_newest_checkpoint_as_training_did(run_dir, capsys):
    from maxfp4.lm_eval_cli import main

    (run_dir / "evals" / "step_2.json").unlink()
    assert main([str(run_dir), "--tasks", f"{CLOZE},{TEXT},{ECHO}", "--rows", "4"]) == 0
    out, err = capsys.readouterr()
    assert "tiny_cloze" in out and "bits_per_byte" in out and "exact_match" in out  # lm-eval's table
    assert f"evaluating {run_dir} step 2 with bf16" in err
    saved = json.loads((run_dir / "evals" / "step_2.json").read_text())
    assert saved["maxfp4"] == {"source": str(run_dir), "step": 2, "precision": "bf16"}
    results = saved["results"]
    # Same parameters, same policy as the training hook's step-2 evaluation: the same scores.
    logged = json.loads(open(run_dir / "metrics.jsonl").readlines()[-1])
    assert results["tiny_cloze"]["acc,none"] == logged["lm_eval/tiny_cloze/acc"]
    assert results["tiny_cloze"]["acc_norm,none"] == logged["lm_eval/tiny_cloze/acc_norm"]
    # A barely trained model of 512 tokens: bits per byte near log2 of its vocabulary per token.
    assert 0.5 < results["tiny_text"]["bits_per_byte,none"] < 20
    assert results["tiny_echo"]["exact_match,none"] in (0.0, 0.5, 1.0)


def test_log_likelihoods_match_a_float64_forward_of_the_export(run_dir, tmp_path):
    """The adapter's (context, continuation) and rolling log-likelihoods against a float64 NumPy
    Llama forward on the FP32 export of the same checkpoint (tests/test_hf.py's reference)."""
    from transformers import LlamaConfig

    from maxfp4.interop.export import export
    from maxfp4.lm_eval_adapter import MaxFP4LM
    from maxfp4.lm_eval_cli import load_eval_model
    from lm_eval.api.instance import Instance
    from tests.test_hf import _llama_reference_logits, _tensors

    out = tmp_path / "hf"
    export(str(run_dir), str(out), dtype="fp32")
    model = load_eval_model(str(out), bf16=True)
    assert model.step == 2
    lm = MaxFP4LM(model.params, model.model_cfg, model.tokenizer, policy=model.policy, max_length=model.max_length,
                  rows=4)
    tensors, hf_config = _tensors(out), LlamaConfig.from_pretrained(str(out))
    bos = model.tokenizer.bos_id

    def reference(tokens, n_scored):
        logits = _llama_reference_logits(tensors, hf_config, np.asarray(tokens[:-1]))
        logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        rows = np.arange(len(tokens) - 1 - n_scored, len(tokens) - 1)
        return float(np.sum(logp[rows, np.asarray(tokens)[rows + 1]]))

    pairs = [("The cat sat on the", " mat"), ("Once upon a time", " there was a king"), ("", "Hello world")]
    requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = [logprob for logprob, _ in lm.loglikelihood(requests)]
    for (context, continuation), value in zip(pairs, got):
        context_ids = [bos] + model.tokenizer.encode(context) if context else [bos]
        whole = [bos] + model.tokenizer.encode(context + continuation)
        n = len(whole) - len(context_ids)
        want = reference(whole, n)
        # BF16 GEMM operands and activations (8 significant bits) against float64: each scored
        # token's log-probability within 0.02 nats (measured: at most 0.0005); a wrong
        # position, token or BOS shifts it by whole nats.
        assert abs(value - want) <= 0.02 * n, (context, continuation, value, want)
    text = "The sea is calm tonight."
    (rolled,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    ids = model.tokenizer.encode(text)
    assert abs(rolled - reference([bos] + ids, len(ids))) <= 0.02 * len(ids)
    long_text = " ".join(["the river flows to the sea"] * 12)  # several windows of 32 tokens
    (long_rolled,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long_text,), 0)])
    assert math.isfinite(long_rolled) and long_rolled < 0


def test_a_run_is_scored_with_its_own_precision_and_fp8_scales(run_dir, tmp_path):
    """An fp8_delayed run (the trained parameters, its checkpoint's delayed scales set to 7): the
    command reads the policy and those scales, and --bf16 scores the same parameters in BF16."""
    import jax
    import jax.numpy as jnp

    from maxfp4.checkpoint import Checkpointer
    from maxfp4.lm_eval_adapter import MaxFP4LM
    from maxfp4.lm_eval_cli import load_eval_model
    from maxfp4.optim import make_optimizer
    from maxfp4.parallel.mesh import make_mesh
    from maxfp4.train import init_state

    cfg = load_config(None, TINY + ["run.name=fp8", "data.source=builtin", "model.vocab_size=512", "mesh.data=1",
                                    "precision.default=fp8_delayed", f"run.output_dir={tmp_path}"])
    state, _ = init_state(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), make_optimizer(cfg))
    trained = load_eval_model(str(run_dir), bf16=True).params
    precision = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.full_like(x, 7.0) if "scale" in jax.tree_util.keystr(path) else x, state.precision)
    checkpointer = Checkpointer(cfg.run_dir, cfg.checkpoint)
    checkpointer.save(2, state.replace(params=trained, precision=precision), {"step": 2, "global_batch": 8},
                      cfg.to_dict())
    checkpointer.close()
    (tmp_path / "fp8" / "tokenizer.model").write_bytes((run_dir / "tokenizer.model").read_bytes())

    fp8, bf16 = (load_eval_model(str(tmp_path / "fp8"), bf16=flag) for flag in (False, True))
    assert (fp8.precision, bf16.precision, bf16.scales) == ("fp8_delayed", "bf16", {})
    scales = np.concatenate([np.ravel(s) for s in jax.tree.leaves(fp8.scales)])
    assert scales.size >= 5 and np.all(scales == 7.0), scales  # four block classes and the head
    pair = [([fp8.tokenizer.bos_id] + fp8.tokenizer.encode("The cat sat on the"), fp8.tokenizer.encode(" mat"))]
    (got_fp8, _), = MaxFP4LM(fp8.params, fp8.model_cfg, fp8.tokenizer, policy=fp8.policy, scales=fp8.scales,
                             max_length=fp8.max_length, rows=1).score_pairs(pair)
    (got_bf16, _), = MaxFP4LM(bf16.params, bf16.model_cfg, bf16.tokenizer, policy=bf16.policy,
                              max_length=bf16.max_length, rows=1).score_pairs(pair)
    # E4M3 operands (4 significant bits) move the log-likelihood, but not by whole nats.
    assert got_fp8 != got_bf16 and abs(got_fp8 - got_bf16) < 0.5, (got_fp8, got_bf16)


@pytest.mark.parametrize("tasks, expected", [
    ("tiny_clozee", "task tiny_clozee: not an lm-eval task, group or tag; did you mean"),
    ("{bad}.yaml", "task file {bad}.yaml: does not parse (ParserError: while parsing a flow mapping"),
    ("{missing}.yaml", "task file {missing}.yaml: not found; expected an lm-eval task YAML file"),
])
def test_a_bad_task_is_one_line_before_anything_is_written(run_dir, tmp_path, capsys, tasks, expected):
    from maxfp4.lm_eval_cli import main

    bad = tmp_path / "bad"
    bad.with_suffix(".yaml").write_text("task: x\ndoc_to_text: {{a}\n  : - [\n")
    tasks, expected = (s.format(bad=bad, missing=tmp_path / "missing") for s in (tasks, expected))
    before = sorted(os.listdir(run_dir))
    assert main([str(run_dir), "--tasks", tasks]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: " + expected) and "\n" not in err, err
    assert sorted(os.listdir(run_dir)) == before


def test_a_run_without_checkpoints_is_one_line(tmp_path, capsys):
    from maxfp4.lm_eval_cli import main

    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--tasks", CLOZE]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: run directory {tmp_path / 'empty'}: no complete checkpoint") and "\n" not in err
    assert os.listdir(tmp_path / "empty") == []


@pytest.mark.parametrize("override, expected", [
    ("train.eval_tasks=[tiny_cloze]", "train.eval_tasks=['tiny_cloze']: expected [] unless train.eval_every > 0"),
    ("train.eval_tasks=['']", "train.eval_tasks=['']: expected a list of lm-eval task names or task YAML files"),
])
def test_train_eval_tasks_is_checked_with_the_config(override, expected):
    from maxfp4.config import ConfigError

    with pytest.raises(ConfigError) as error:
        load_config(None, TINY + ["data.source=builtin", override])
    assert str(error.value).startswith(expected), str(error.value)


def test_train_eval_tasks_need_a_tokenizer():
    from maxfp4.config import ConfigError

    with pytest.raises(ConfigError, match=r"train.eval_tasks=\['tiny_cloze'\]: expected \[\] with data.source=synthetic"):
        load_config(None, TINY + ["train.eval_every=1", "train.eval_tasks=[tiny_cloze]"])


def test_a_bad_task_in_train_eval_tasks_is_refused_before_the_run_directory_is_made(tmp_path):
    import jax

    from maxfp4.lm_eval_tasks import TaskError
    from maxfp4.train import train

    cfg = load_config(None, RUN + [f"run.output_dir={tmp_path}", f"train.eval_tasks=[{tmp_path / 'missing.yaml'}]"])
    with pytest.raises(TaskError, match=r"task file .*missing.yaml: not found"):
        train(cfg, devices=jax.devices()[:2], stream=io.StringIO())
    assert os.listdir(tmp_path) == []
