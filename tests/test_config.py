import glob
import os
import subprocess
import sys

import pytest

from maxfp4.config import Config, ConfigError, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_defaults_are_valid():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert cfg.model.resolved_head_dim == cfg.model.d_model // cfg.model.n_heads


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "**", "*.yaml"), recursive=True)))
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.train.steps >= 1
    with open(path, encoding="utf-8") as fh:
        first = fh.readline()
    if "/precision/" not in path:
        assert first.startswith("#") and "python -m maxfp4.train" in first, "first line must give the run command"


def test_overrides_are_parsed_as_yaml():
    cfg = load_config(None, ["optim.lr=1e-3", "data.paths=[a.txt,b.txt]", "precision.rules=[]",
                             "run.name=abc", "checkpoint.async=false", "model.n_layers=3"])
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.data.paths == ("a.txt", "b.txt")
    assert cfg.precision.rules == ()
    assert cfg.checkpoint.async_ is False
    assert cfg.model.n_layers == 3


def test_include_merges_presets(tmp_path):
    (tmp_path / "base.yaml").write_text("model: {d_model: 128, n_heads: 4}\ntrain: {steps: 7}\noptim: {warmup_steps: 2}\n")
    (tmp_path / "run.yaml").write_text("include: [base.yaml]\ntrain: {steps: 9}\n")
    cfg = load_config(str(tmp_path / "run.yaml"))
    assert cfg.model.d_model == 128 and cfg.train.steps == 9


@pytest.mark.parametrize("override, fragment", [
    ("model.d_modle=64", "model.d_modle: unknown key"),
    ("bogus=1", "bogus: unknown key"),
    ("train.steps=-5", "train.steps=-5: expected an integer >= 1"),
    ("train.steps=ten", "train.steps='ten': expected an integer"),
    ("model.n_heads=3", "model.n_heads=3: expected a divisor of model.d_model=256"),
    ("model.n_kv_heads=3", "model.n_kv_heads=3: expected a divisor of model.n_heads"),
    ("precision.default=fp9", "precision.default='fp9': unknown recipe"),
    ("precision.rules=[{classes: [mlp_up], recipe: int3}]", "precision.rules[0].recipe='int3': unknown recipe"),
    ("precision.rules=[{classes: [mlp_sideways], recipe: bf16}]", "unknown layer class 'mlp_sideways'"),
    ("precision.rules=[{layers: '10:', recipe: bf16}]", "selects no block"),
    # YAML lists and mappings where a name is expected (unhashable: refused, not a TypeError)
    ("precision.rules={recipe: []}", "precision.rules[0].recipe=[]: unknown recipe"),
    ("precision.rules=[{recipe: {a: 1}}]", "precision.rules[0].recipe={'a': 1}: unknown recipe"),
    ("precision.rules=[{recipe: bf16, classes: 3}]", "precision.rules[0].classes=3: expected a layer class"),
    ("precision.rules=[{recipe: bf16, classes: [[mlp_up]]}]", "unknown layer class ['mlp_up']"),
    ("precision.default=[bf16]", "precision.default=['bf16']: expected a string"),
    ("data.source=parquet", "data.source='parquet': expected one of"),
    ("data.source=text", "data.paths=[]: expected at least one file"),
    ("optim.lr=0", "optim.lr=0.0: expected a positive learning rate"),
    ("checkpoint.async=maybe", "checkpoint.async='maybe': expected true or false"),
    ("mesh.data=-1", None),  # valid: one axis may be -1
    ("train.microbatches=3", "train.microbatches=3: expected a divisor of data.global_batch=16"),
])
def test_bad_values_name_the_key(override, fragment):
    if fragment is None:
        load_config(None, [override])
        return
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_yaml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {d_model: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "missing.yaml"))


def test_cli_error_is_one_line_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml"),
         "model.n_heads=7", f"run.output_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert lines == [lines[-1]] and "model.n_heads=7" in lines[-1]
    assert not os.listdir(tmp_path), "nothing may be written before the config is valid"


def test_precision_presets_resolve_as_documented():
    from maxfp4.precision import resolve_policy
    base = os.path.join(REPO, "configs", "dense-1p3b.yaml")
    fp8 = load_config([base, os.path.join(REPO, "configs", "precision", "fp8.yaml")])
    p = resolve_policy(fp8.precision, fp8.model.n_layers)
    assert p.lm_head == "bf16" and {r for row in p.block_table for r in row} == {"fp8_delayed"}
    # NVFP4 keeps BF16 at both ends as the paper's 12B model (blocks 0-1 and 54-61 of 62), in
    # percentages of the depth rounded up to whole blocks.
    for n_layers, bf16_blocks in ((62, [0, 1, *range(54, 62)]), (52, [0, 1, *range(45, 52)]),
                                  (12, [0, 10, 11])):
        nv = load_config([base, os.path.join(REPO, "configs", "precision", "nvfp4.yaml")],
                         [f"model.n_layers={n_layers}"])
        p = resolve_policy(nv.precision, n_layers)
        assert p.lm_head == "bf16"
        assert [i for i, row in enumerate(p.block_table) if set(row) == {"bf16"}] == bf16_blocks
        assert {r for i, row in enumerate(p.block_table) if i not in bf16_blocks for r in row} == {"nvfp4"}
        assert len(p.block_groups()) == 3
        assert dict(p.options_for("nvfp4"))["rht_bf16"] is True


def test_readme_config_walkthrough_is_a_valid_config(tmp_path):
    """The YAML block of the README's walkthrough names real keys with valid values."""
    text = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    block = text.split("## Config walkthrough", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "walkthrough.yaml").write_text(block)
    cfg = load_config(str(tmp_path / "walkthrough.yaml"))
    assert cfg.train.remat == "none" and cfg.data.source == "builtin"
