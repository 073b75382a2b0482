"""What a new user meets on the first day: one text file, the defaults, and the one-line errors."""

import numpy as np
import pytest

from maxfp4.config import load_config
from maxfp4.data import make_batches, make_eval_batches
from maxfp4.data.sources import builtin_documents


@pytest.fixture(scope="module")
def one_text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "input.txt"
    path.write_text("\n\n".join(builtin_documents()[:40]), encoding="utf-8")
    return path


def text_cfg(path, tmp_path, *overrides):
    return load_config(None, ["data.source=text", f"data.paths=[{path}]", "data.eval_fraction=0.05",
                              "model.vocab_size=512", "data.seq_len=64", "data.global_batch=8",
                              "data.eval_batches=1000", f"run.output_dir={tmp_path}", *overrides])


def test_one_text_file_holds_out_whole_sequences_that_training_never_sees(one_text_file, tmp_path):
    cfg = text_cfg(one_text_file, tmp_path)
    data = make_batches(cfg, str(tmp_path / "r"))
    (note,) = data.notes
    assert note.startswith("data.eval_fraction=0.05: the text data has 1 document(s), too few to hold some out; "
                           "holding out ") and "sequence(s) of 65 tokens instead" in note
    _, (part,) = data.corpus
    slices = part.documents
    assert (slices.doc_S == 0).all()  # one file, one document
    spans = sorted(zip(slices.start_S.tolist(), slices.stop_S.tolist()))
    assert all(stop <= next_start for (_, stop), (next_start, _) in zip(spans, spans[1:]))  # disjoint
    held = set(part.held_N.tolist())
    held_tokens = sum(int(part.lengths_N[i]) for i in held)
    total = int(part.lengths_N.sum())
    # round(0.05 x tokens / 65) windows of 65 tokens: the fraction up to one window.
    assert abs(held_tokens / total - 0.05) <= 65 / total + 1e-9 and all(part.lengths_N[i] == 65 for i in held)
    # Every held-out window is one evaluated row of 64 pairs; none of its pairs is a training pair.
    evals = make_eval_batches(cfg, str(tmp_path / "r"), corpus=data.corpus)
    eval_rows = [r for b in evals for r, m in zip(b["inputs"], b["loss_mask"]) if m.any()]
    assert len(eval_rows) == len(held) and sum(int(b["loss_mask"].sum()) for b in evals) == 64 * len(held)
    document = np.asarray(slices.documents[0])
    held_positions = {p for i in held for p in range(int(slices.start_S[i]), int(slices.stop_S[i]))}
    trained_positions = {p for i in range(len(slices)) if i not in held
                         for p in range(int(slices.start_S[i]), int(slices.stop_S[i]))}
    assert not held_positions & trained_positions and len(document) - len(held_positions | trained_positions) < 2 * len(slices)
    assert data.num_rows >= 8 * 4  # training keeps the rest
    # The same seed holds out the same windows; another seed others.
    again = make_batches(cfg, str(tmp_path / "r"))
    assert set(again.corpus[1][0].held_N.tolist()) == held
    other = make_batches(text_cfg(one_text_file, tmp_path, "run.seed=1"), str(tmp_path / "r"))
    held_starts = {int(slices.start_S[i]) for i in held}
    other_part = other.corpus[1][0]
    assert {int(other_part.documents.start_S[i]) for i in other_part.held_N} != held_starts


def test_bad_first_tries_get_one_line_with_what_would_work(tmp_path, capsys):
    from maxfp4.config import ConfigError
    from maxfp4.train import main

    with pytest.raises(ConfigError, match=r"precision.default='fp8': unknown recipe; .* \(did you mean 'fp8_delayed' "
                                          r"or .* or the preset configs/precision/fp8.yaml\?\)"):
        load_config(None, ["precision.default=fp8"])
    with pytest.raises(ConfigError, match=r"fp9.yaml: not found; .*configs/precision has fp8.yaml, .*nvfp4.yaml"):
        load_config(["configs/precision/fp9.yaml"])
    # A config without run.name runs under its own file's name, not in another config's run.
    mine = tmp_path / "my-experiment.yaml"
    mine.write_text("model: {d_model: 64}\n")
    assert load_config([str(mine)]).run.name == "my-experiment"
    assert load_config([str(mine)], ["run.name=other"]).run.name == "other"
    assert load_config(["configs/quickstart.yaml"]).run.name == "quickstart"
    # No arguments: the usage, exit code 2.
    assert main([]) == 2
    assert "usage: python -m maxfp4.train" in capsys.readouterr().err


def test_rerunning_a_finished_run_says_nothing_was_trained(tiny_cfg, tmp_path, capsys):
    import io

    import jax

    from maxfp4.train import train

    # The config of tests/test_goodput.py's run: its compiled step is reused.
    cfg = tiny_cfg("run.name=done", "train.steps=2", "optim.schedule_steps=8", "checkpoint.async=false")
    train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    capsys.readouterr()
    assert train(cfg, devices=jax.devices()[:1], stream=io.StringIO()) == []
    assert "nothing to train: the run finished at step 2 (train.steps=2)" in capsys.readouterr().out

    # Export without --out: beside the run; nothing in it names this machine's directories.
    from maxfp4.interop.export import main as export_main

    assert export_main([str(tmp_path / "done")]) == 0
    out = tmp_path / "done-step2-hf"
    assert f"wrote {out / 'config.json'}" in capsys.readouterr().out
    for path in out.iterdir():
        if path.suffix in (".json", ".txt", ".yaml", ".model"):
            assert str(tmp_path) not in path.read_text(errors="replace"), path
    assert export_main([str(tmp_path / "done")]) == 2  # a second export of the same step is refused in one line


def test_a_gpu_sized_config_on_a_cpu_is_refused_by_the_host_memory_check(tiny_cfg):
    import jax

    from maxfp4.reliability.preflight import check_memory, host_memory_bytes, memory_per_device

    cfg = tiny_cfg()
    devices = jax.devices()
    mesh = {"data": 8, "fsdp": 1, "tensor": 1, "pipeline": 1}
    small = check_memory(cfg, devices, 10**5, mesh)
    assert small.ok is True and "of the host's" in small.detail
    huge_params = 10**12  # 16 TB of weights and Adam moments: more than any host this runs on
    need = memory_per_device(cfg, huge_params, mesh) * len(devices)
    assert need > host_memory_bytes()
    big = check_memory(cfg, devices, huge_params, mesh)
    assert big.ok is False and f"about {need / 2**30:.1f} GiB estimated for this process's cpu devices" in big.detail
    assert "\n" not in big.detail


def test_init_from_with_longer_sequences_than_the_source_is_said_at_start(tmp_path):
    import json

    from maxfp4.interop.positions import positions_warning

    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({"max_position_embeddings": 128}))
    base = [f"model.init_from={source}", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2"]
    assert positions_warning(load_config(None, base + ["data.seq_len=128"])) is None
    line = positions_warning(load_config(None, base + ["data.seq_len=256"]))
    assert line.startswith("warning: data.seq_len=256 exceeds model.init_from's max_position_embeddings=128: "
                           "rotary positions beyond 128 were never trained") and "data.seq_len=128 keeps" in line
