"""Which config changes a resumed run may make (maxfp4.config_diff)."""

import pytest

from maxfp4.config import Config, ConfigError, load_config
from maxfp4.config_diff import HARMLESS_KEYS, MATH_KEYS, _matches, flatten, math_differences, refuse_changed_math

BASE = ["run.name=r", "run.output_dir=/runs", "optim.schedule_steps=100", "train.steps=50", "optim.warmup_steps=5"]


def _diff(old, new):
    a, b = load_config(None, BASE + old), load_config(None, BASE + new)
    return math_differences(a.to_dict(), b.to_dict(), a.run_dir)


def test_every_config_key_is_classified_exactly_once():
    # A new config key must be put in one list on purpose (unlisted keys count as math-changing).
    for key in flatten(Config().to_dict()):
        if key in ("model.attention", "model.attention_max_segments", "model.mamba.kernels",
                   "model.moe.exchange_slack"):  # harmless in a math section
            assert _matches(key, HARMLESS_KEYS)
            continue
        assert _matches(key, MATH_KEYS) != _matches(key, HARMLESS_KEYS), key


def test_math_changes_are_listed_with_old_and_new_values():
    rigid = ["train.elastic=false"]  # with train.elastic, microbatches follow the device count
    diffs = _diff(rigid, rigid + ["model.d_model=512", "optim.lr=1e-3", "run.seed=3", "data.seq_len=128",
                       "train.microbatches=2", "precision.default=fp8_current",
                       "precision.rules=[{classes: [lm_head], recipe: bf16}]"])
    assert diffs == [
        "data.seq_len: 256 -> 128", "model.d_model: 256 -> 512", "optim.lr: 0.0003 -> 0.001",
        "precision.default: 'bf16' -> 'fp8_current'",
        "precision.rules: [] -> [{'classes': ['lm_head'], 'recipe': 'bf16'}]",
        "run.seed: 0 -> 3", "train.microbatches: 1 -> 2"]


def test_harmless_changes_pass():
    assert _diff([], ["train.steps=80", "train.log_every=1", "checkpoint.every=5", "checkpoint.keep=1",
                      "mesh.data=2", "mesh.fsdp=4", "model.attention=xla", "model.mamba.kernels=xla", "train.remat=full",
                      "resilience.fault.exception_at_step=3", "distributed.num_processes=2"]) == []


def test_train_steps_matters_only_through_the_schedule():
    unpinned = ["optim.schedule_steps=0"]
    diffs = _diff(unpinned, unpinned + ["train.steps=60"])
    assert len(diffs) == 1 and diffs[0].startswith("train.steps: 50 -> 60 (the learning-rate schedule length")
    # Pinning the schedule at the old length is the same math, whatever train.steps becomes.
    assert _diff(unpinned, ["optim.schedule_steps=50", "train.steps=70"]) == []
    assert _diff([], ["optim.schedule_steps=120"])[0].startswith("optim.schedule_steps: 100 -> 120")


def test_free_form_entries_and_older_configs():
    recipes = ["precision.default=fp8_delayed", "precision.recipes={fp8_delayed: {amax_history: 4}}"]
    assert _diff(recipes, ["precision.default=fp8_delayed"]) == [
        "precision.recipes: {'fp8_delayed': {'amax_history': 4}} -> {}"]
    # A config saved before a key existed takes its default; a key that is gone is ignored.
    cfg = load_config(None, BASE)
    old = cfg.to_dict()
    del old["model"]["rope_theta"]
    old["model"]["retired_key"] = 1
    assert math_differences(old, cfg.to_dict(), cfg.run_dir) == []
    old["model"]["norm_eps"] = 1e-6
    assert math_differences(old, cfg.to_dict(), cfg.run_dir) == ["model.norm_eps: 1e-06 -> 1e-05"]


def test_tokenizer_of_the_run_directory_named_explicitly_is_the_same():
    a = load_config(None, BASE)
    b = a.to_dict()
    b["data"]["tokenizer"] = "/runs/r/tokenizer.model"  # as if the file existed (validation checks it)
    assert math_differences(a.to_dict(), b, a.run_dir) == []
    b["data"]["tokenizer"] = "/elsewhere/tokenizer.model"
    assert math_differences(a.to_dict(), b, a.run_dir) == [
        "data.tokenizer: '/runs/r/tokenizer.model' -> '/elsewhere/tokenizer.model'"]


def test_refusal_is_one_line_naming_every_key():
    old = load_config(None, BASE)
    new = load_config(None, BASE + ["model.n_layers=6", "optim.warmup_steps=10"])
    refuse_changed_math(None, new, "nowhere")  # no saved run: nothing to compare
    refuse_changed_math(old.to_dict(), old, "step 5")
    with pytest.raises(ConfigError) as info:
        refuse_changed_math(old.to_dict(), new, "step 5")
    message = str(info.value)
    assert "\n" not in message and "step 5" in message and "/runs/r" in message
    assert "model.n_layers: 4 -> 6" in message and "optim.warmup_steps: 5 -> 10" in message


def test_guard_window_is_refused_on_resume_as_it_shapes_the_checkpoint():
    # The guard's window of losses is an array in the checkpoint: another length could not restore.
    assert _diff([], ["resilience.spike_window=8"]) == ["resilience.spike_window: 12 -> 8"]
    assert _diff([], ["resilience.spike_margin=0.5", "resilience.spike_warmup=10"]) == []
