"""grain pipeline: ArrayRecord shards from prepare, jsonl/tfds sources, mixtures, process sharding,
JSON-checkpointable state, worker processes, held-out split, eval in training, bad-input errors."""

from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from maxfp4.config import load_config
from maxfp4.data import make_batches, make_eval_batches
from maxfp4.data import prepare as prepare_mod
from maxfp4.data.corpus import tokenize_documents
from maxfp4.data.sources import builtin_documents
from maxfp4.errors import DataError
from maxfp4.reliability.preflight import check_data

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 512


def cfg_of(tmp_path, *overrides):
    return load_config(None, [f"model.vocab_size={VOCAB}", "data.seq_len=64", "data.global_batch=8",
                              f"run.output_dir={tmp_path}", *overrides])


def take(it, n):
    return [next(it) for _ in range(n)]


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def run_prepare(*argv):
    return prepare_mod.prepare(prepare_mod.parse_args(list(map(str, argv))), stream=io.StringIO())


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The builtin corpus prepared into 4 shards with a trained 512-piece tokenizer."""
    out = tmp_path_factory.mktemp("prep") / "builtin"
    manifest = run_prepare("--source", "builtin", "--out", out, "--vocab-size", VOCAB, "--docs-per-shard", 20)
    return out, manifest


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- prepare + array_record


def test_prepare_writes_token_ids_and_manifest(prepared):
    out, manifest = prepared
    docs = builtin_documents()
    from maxfp4.data.tokenizer import Tokenizer
    tok = Tokenizer(str(out / "tokenizer.model"))
    want = tokenize_documents(docs, tok)
    assert manifest["num_documents"] == len(docs) == sum(s["num_documents"] for s in manifest["shards"])
    assert manifest["num_tokens"] == sum(len(d) for d in want)
    assert manifest["vocab_size"] == VOCAB and len(manifest["shards"]) == math.ceil(len(docs) / 20)
    assert json.loads((out / "manifest.json").read_text()) == manifest
    import hashlib
    assert manifest["tokenizer_sha256"] == hashlib.sha256((out / "tokenizer.model").read_bytes()).hexdigest()
    # Records are raw little-endian int32 ids, in document order, readable without this package.
    from array_record.python.array_record_module import ArrayRecordReader
    got = []
    for shard in manifest["shards"]:
        reader = ArrayRecordReader(str(out / shard["name"]))
        got += [np.frombuffer(r, "<i4") for r in reader.read_all()]
        reader.close()
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    assert not [p for p in os.listdir(out) if p.endswith(".tmp") or p.startswith("prepare_request")]


def test_array_record_batches_equal_text_batches(prepared, tmp_path):
    """The same documents and tokenizer pack into the same batches whether read from shards or text."""
    out, _ = prepared
    shards = make_batches(cfg_of(tmp_path, "data.source=array_record", f"data.paths=[{out}]"), str(tmp_path / "a"))
    text = make_batches(cfg_of(tmp_path, "data.source=builtin", f"data.tokenizer={out / 'tokenizer.model'}"),
                        str(tmp_path / "b"))
    assert shards.num_tokens == text.num_tokens and shards.batches_per_epoch == text.batches_per_epoch
    n = shards.batches_per_epoch + 2  # across an epoch boundary
    assert_same(take(shards, n), take(text, n))


@pytest.mark.parametrize("source", ["array_record", "text", "mixture"])
def test_two_process_shares_concatenate_to_one_process_batch(prepared, tmp_path, source):
    out, _ = prepared
    tok = f"data.tokenizer={out / 'tokenizer.model'}"
    for i, doc in enumerate(builtin_documents()[:30]):
        (tmp_path / f"d{i:02d}.txt").write_text(doc, encoding="utf-8")
    overrides = {
        "array_record": ["data.source=array_record", f"data.paths=[{out}]", "data.global_batch=32"],
        "text": ["data.source=text", f"data.paths=[{tmp_path / 'd*.txt'}]", tok, "data.global_batch=32"],
        "mixture": ["data.source=mixture", tok, "data.global_batch=32",
                    f"data.mixture=[{{source: array_record, paths: [{out}], weight: 3}}, "
                    f"{{source: text, paths: ['{tmp_path / 'd*.txt'}'], weight: 1}}]"],
    }[source]
    cfg = cfg_of(tmp_path, *overrides)
    whole = take(make_batches(cfg, str(tmp_path / "r")), 6)
    shares = [take(make_batches(cfg, str(tmp_path / "r"), process_index=p, process_count=2), 6) for p in range(2)]
    for k in range(6):
        for key in whole[k]:
            assert shares[0][k][key].shape == (16, 64)
            np.testing.assert_array_equal(np.concatenate([shares[0][k][key], shares[1][k][key]]), whole[k][key])
    assert not np.array_equal(shares[0][0]["inputs"], shares[1][0]["inputs"])


def test_mixture_follows_weights(prepared, tmp_path):
    out, _ = prepared
    (tmp_path / "z.txt").write_text("zz " * 4000, encoding="utf-8")  # one long document of one word
    cfg = cfg_of(tmp_path, "data.source=mixture", f"data.tokenizer={out / 'tokenizer.model'}",
                 "data.global_batch=16",
                 f"data.mixture=[{{source: array_record, paths: [{out}], weight: 3}}, "
                 f"{{source: text, paths: ['{tmp_path / 'z.txt'}'], weight: 1}}]")
    batches = take(make_batches(cfg, str(tmp_path / "r")), 4)
    from maxfp4.data.tokenizer import Tokenizer
    z_ids = set(Tokenizer(str(out / "tokenizer.model")).encode("zz zz zz")) | {2, 3}
    from_z = [set(np.unique(row[seg > 0]).tolist()) <= z_ids
              for b in batches for row, seg in zip(b["inputs"], b["segment_ids"])]
    assert sum(from_z) == 16  # exactly a quarter of the 64 rows come from the weight-1 source


def test_state_round_trips_through_json_and_workers(prepared, tmp_path):
    out, _ = prepared
    cfg = cfg_of(tmp_path, "data.source=array_record", f"data.paths=[{out}]", "data.global_batch=64")
    it = make_batches(cfg, str(tmp_path / "r"))
    take(it, it.batches_per_epoch + 1)
    state = json.loads(json.dumps(it.get_state()))  # as the checkpoint stores it
    assert state["next_index"] == it.batches_per_epoch + 1 and state["epoch"] == 1
    assert all(type(v) is int for v in state.values())
    expected = take(it, 3)
    fresh = make_batches(cfg, str(tmp_path / "r"))
    fresh.set_state(state)
    assert_same(take(fresh, 3), expected)
    # Worker processes (grain multiprocess prefetch) serve the same stream and resume from the same state.
    workers = make_batches(cfg_of(tmp_path, "data.source=array_record", f"data.paths=[{out}]",
                                  "data.global_batch=64", "data.workers=1"), str(tmp_path / "r"))
    workers.set_state(state)
    try:
        assert_same(take(workers, 3), expected)
        assert workers.get_state()["next_index"] == state["next_index"] + 3
    finally:
        workers.close()
    with pytest.raises(DataError, match="num_rows"):
        fresh.set_state(dict(state, num_rows=state["num_rows"] + 1))


def test_prepare_refuses_existing_output_and_resumes(tmp_path, monkeypatch):
    docs = [{"text": f"document {i}: " + "some words here and there " * (i + 1)} for i in range(12)]
    src = write_jsonl(tmp_path / "in.jsonl", docs)
    args = ["--source", "jsonl", "--paths", src, "--out", tmp_path / "out", "--vocab-size", 300,
            "--docs-per-shard", 4]
    reference = run_prepare(*args[:5], tmp_path / "ref", *args[6:])
    calls = []
    real = prepare_mod.records.write_shard

    def failing(directory, name, token_docs):  # an interruption after the first shard
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(directory, name, token_docs)

    monkeypatch.setattr(prepare_mod.records, "write_shard", failing)
    with pytest.raises(KeyboardInterrupt):
        run_prepare(*args)
    first = tmp_path / "out" / "shard-00000.array_record"
    stamp = first.stat().st_mtime_ns
    assert not (tmp_path / "out" / "manifest.json").exists()
    monkeypatch.setattr(prepare_mod.records, "write_shard", real)
    manifest = run_prepare(*args)  # same command: resumes, keeping the complete shard
    assert first.stat().st_mtime_ns == stamp
    assert manifest["shards"] == reference["shards"] and manifest["num_tokens"] == reference["num_tokens"]
    # A finished output is refused without --force: one line, exit code 2.
    cmd = [sys.executable, "-m", "maxfp4.data.prepare", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert re.match(r"error: --out .*out already exists.*--force", proc.stderr)
    assert run_prepare(*args, "--force")["shards"] == reference["shards"]


# ----------------------------------------------------------------------------- jsonl, tfds


def test_jsonl_source_reads_field(tmp_path, prepared):
    out, _ = prepared
    docs = builtin_documents()[:40]
    write_jsonl(tmp_path / "a.jsonl", [{"body": d, "id": i} for i, d in enumerate(docs)])
    cfg = cfg_of(tmp_path, "data.source=jsonl", f"data.paths=[{tmp_path / 'a.jsonl'}]", "data.jsonl_field=body",
                 f"data.tokenizer={out / 'tokenizer.model'}")
    it = make_batches(cfg, str(tmp_path / "r"))
    assert it.num_tokens == sum(len(d) - 1 for d in tokenize_documents(docs, it.tokenizer))


def test_tfds_source_offline(tmp_path, prepared):
    out, _ = prepared
    docs = builtin_documents()[:30]

    # Built by a separate script (as a user would, offline); this process then reads it by name only.
    (tmp_path / "docs.json").write_text(json.dumps(docs), encoding="utf-8")
    (tmp_path / "build.py").write_text("""
import json, sys
import tensorflow_datasets as tfds

class TinyTopics(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")
    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({"text": tfds.features.Text()}))
    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}
    def _generate_examples(self):
        for i, doc in enumerate(json.load(open(sys.argv[1]))):
            yield i, {"text": doc}

TinyTopics(data_dir=sys.argv[2], file_format="array_record").download_and_prepare()
""")
    subprocess.run([sys.executable, str(tmp_path / "build.py"), str(tmp_path / "docs.json"), str(tmp_path / "tfds")],
                   check=True, capture_output=True, timeout=120)
    cfg = cfg_of(tmp_path, "data.source=tfds", "data.tfds_name=tiny_topics", f"data.tfds_data_dir={tmp_path / 'tfds'}",
                 f"data.tokenizer={out / 'tokenizer.model'}")
    it = make_batches(cfg, str(tmp_path / "r"))
    assert it.num_tokens == sum(len(d) - 1 for d in tokenize_documents(docs, it.tokenizer))
    with pytest.raises(DataError, match="data.tfds_name='no_such_set'.*cannot open"):
        make_batches(cfg_of(tmp_path, "data.source=tfds", "data.tfds_name=no_such_set",
                            f"data.tfds_data_dir={tmp_path / 'tfds'}"), str(tmp_path / "r2"))
    # The preflight opens the dataset and checks its first example only (the loader reads all).
    check = check_data(cfg)
    assert check.ok and check.detail.startswith("30 tfds example(s)"), check
    bad = check_data(cfg_of(tmp_path, "data.source=tfds", "data.tfds_name=tiny_topics",
                            f"data.tfds_data_dir={tmp_path / 'tfds'}", "data.tfds_field=body"))
    assert not bad.ok and "example 0 has no field 'body' (fields: text)" in bad.detail, bad


# ----------------------------------------------------------------------------- held-out split, eval in training


def test_eval_fraction_holds_out_documents(prepared, tmp_path):
    out, _ = prepared
    base = ["data.source=array_record", f"data.paths=[{out}]", "data.global_batch=16"]
    cfg = cfg_of(tmp_path, *base, "data.eval_fraction=0.1", "data.eval_batches=3")
    train_it = make_batches(cfg, str(tmp_path / "r"))
    full_it = make_batches(cfg_of(tmp_path, *base), str(tmp_path / "r"))
    evals = make_eval_batches(cfg, str(tmp_path / "r"))
    assert 0 < len(evals) <= 3 and all(b["inputs"].shape == (16, 64) for b in evals)
    held_tokens = sum(int(b["loss_mask"].sum()) for b in evals)
    assert train_it.num_tokens < full_it.num_tokens
    # Held-out rows never appear in training (8 of 78 documents are held out).
    train_rows = {r.tobytes() for r in train_it.rows.inputs_RT}
    assert not any(r.tobytes() in train_rows for b in evals for r, m in zip(b["inputs"], b["loss_mask"]) if m.any())
    assert held_tokens > 0
    assert_same(make_eval_batches(cfg, str(tmp_path / "r")), evals)  # deterministic
    shares = [make_eval_batches(cfg, str(tmp_path / "r"), process_index=p, process_count=2) for p in range(2)]
    for k, b in enumerate(evals):
        np.testing.assert_array_equal(np.concatenate([shares[0][k]["targets"], shares[1][k]["targets"]]), b["targets"])
    # Uncapped, every held-out pair is evaluated once; the last batch is filled with padding rows.
    from maxfp4.data.corpus import load_corpus, split_documents
    all_cfg = cfg_of(tmp_path, *base, "data.eval_fraction=0.02", "data.eval_batches=1000")
    every = make_eval_batches(all_cfg, str(tmp_path / "r"))
    _, parts = load_corpus(all_cfg, str(tmp_path / "r"))
    held_N = split_documents(parts[0], 0.02, 0, 0)[1]
    assert len(held_N) == 2
    assert sum(int(b["loss_mask"].sum()) for b in every) == int((parts[0].lengths_N[held_N] - 1).sum())
    row_used = np.concatenate([b["loss_mask"].any(axis=1) for b in every])
    n_used = int(row_used.sum())
    assert row_used[:n_used].all() and not row_used[n_used:].any() and len(row_used) - n_used < 16


def test_train_logs_eval_loss(tiny_cfg):
    from maxfp4.train import train
    import jax
    cfg = tiny_cfg("train.eval_every=2", "data.eval_batches=2", "mesh.data=1")
    records = train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    evals = {r["step"]: r.get("eval_loss") for r in records}
    assert evals[1] is None and evals[3] is None
    assert all(math.isfinite(evals[s]) and 0.5 * math.log(256) < evals[s] < 2 * math.log(256) for s in (2, 4))
    with open(os.path.join(cfg.run_dir, "metrics.jsonl")) as fh:
        logged = [json.loads(line) for line in fh]
    assert [r["step"] for r in logged if "eval_loss" in r] == [2, 4]


# ----------------------------------------------------------------------------- bad input


def test_bad_jsonl_lines_are_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"{re.escape(str(bad))}:2: not valid JSON"):
        make_batches(cfg_of(tmp_path, "data.source=jsonl", f"data.paths=[{bad}]"), str(tmp_path / "r"))
    bad.write_text('{"text": "fine"}\n\n{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"{re.escape(str(bad))}:3: no field 'text'"):
        make_batches(cfg_of(tmp_path, "data.source=jsonl", f"data.paths=[{bad}]"), str(tmp_path / "r"))
    bad.write_text('{"text": ""}\n{"text": "  "}\n', encoding="utf-8")
    with pytest.raises(DataError, match="hold no non-empty 'text' values"):
        make_batches(cfg_of(tmp_path, "data.source=jsonl", f"data.paths=[{bad}]"), str(tmp_path / "r"))


def test_prepared_data_errors(prepared, tmp_path):
    import shutil
    out, _ = prepared
    with pytest.raises(DataError, match=r"prepared tokenizer .*has vocab size 512 but model.vocab_size=600"):
        make_batches(cfg_of(tmp_path, "data.source=array_record", f"data.paths=[{out}]", "model.vocab_size=600"),
                     str(tmp_path / "r"))
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match=rf"{re.escape(str(missing))} does not exist"):
        make_batches(cfg_of(tmp_path, "data.source=array_record", f"data.paths=[{missing}]"), str(tmp_path / "r"))
    other = tmp_path / "other.model"
    shutil.copyfile(out / "tokenizer.model", other)
    with open(other, "ab") as fh:
        fh.write(b"\0")
    with pytest.raises(DataError, match="is not the one .* was prepared with"):
        make_batches(cfg_of(tmp_path, "data.source=array_record", f"data.paths=[{out}]", f"data.tokenizer={other}"),
                     str(tmp_path / "r"))


def _train_cli(tmp_path, *overrides):
    cmd = [sys.executable, "-m", "maxfp4.train", os.path.join(REPO, "configs", "quickstart.yaml"), "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
           "model.n_kv_heads=2", "model.d_ff=64", f"model.vocab_size={VOCAB}", "data.seq_len=32",
           "data.global_batch=8", "train.steps=1", "optim.warmup_steps=0", "data.eval_fraction=0", "train.eval_every=0",
           f"run.output_dir={tmp_path}", *map(str, overrides)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu"))


def test_cli_corrupt_shard_and_bad_jsonl_exit_2(prepared, tmp_path):
    import shutil
    out, _ = prepared
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    shard = broken / "shard-00001.array_record"
    shard.write_bytes(shard.read_bytes()[:1000])  # truncated
    proc = _train_cli(tmp_path, "data.source=array_record", f"data.paths=[{broken}]")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert re.search(rf"ArrayRecord shard {re.escape(str(shard))} is missing or corrupt", proc.stderr)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "ok"}\n[1, 2]\n', encoding="utf-8")
    proc = _train_cli(tmp_path, "data.source=jsonl", f"data.paths=[{bad}]")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{bad}:3: no field 'text'" in proc.stderr


def test_deeply_nested_jsonl_line_is_named(tmp_path):
    """json's decoder recurses per level: a 100,000-deep line raised RecursionError."""
    from maxfp4.data.sources import read_jsonl_file
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "fine"}\n' + "[" * 100_000 + "]" * 100_000 + "\n", encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_jsonl_file(str(path), "text")
    assert str(err.value) == (f"data.paths: {path}:2: JSON nested too deeply to read; expected one object per "
                              "line with a string field")


def test_shard_corrupted_mid_run_is_named_in_one_line_exit_2(prepared, tmp_path):
    """Bytes flipped inside a chunk of a prepared shard: the shard still opens (its footer is
    intact), so the damage shows when training reads that record. The run ends with one line
    naming the shard and record, exit code 2 (before: a grain traceback not naming the file,
    exit 1)."""
    import shutil
    out, _ = prepared
    broken = tmp_path / "broken"
    shutil.copytree(out, broken)
    shard = broken / "shard-00000.array_record"
    raw = bytearray(shard.read_bytes())
    raw[20000:20064] = bytes(b ^ 0xFF for b in raw[20000:20064])  # inside a chunk, not a block header
    shard.write_bytes(bytes(raw))
    proc = _train_cli(tmp_path, "data.source=array_record", f"data.paths=[{broken}]", "train.steps=30",
                      "train.log_every=1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert re.match(rf"error: data.paths: ArrayRecord shard {re.escape(str(shard))} is corrupt: record \d+ cannot be "
                    r"read \(Corrupted Riegeli", proc.stderr), proc.stderr
    assert "step      1/30" in proc.stdout  # it failed mid-run, not at start-up


def test_lone_surrogates_and_invalid_utf8_are_named_with_file_and_line(tmp_path):
    """A JSON ``\\ud800`` escape decodes to a lone surrogate that no tokenizer can encode (it
    ended in the tokenizer trainer's C++ cast error, naming no file); invalid UTF-8 in a text or
    JSONL file names its line and byte. CRLF files read as text mode reads them."""
    from maxfp4.data.sources import read_jsonl_file, read_text_file
    jsonl = tmp_path / "surrogate.jsonl"
    jsonl.write_text('{"text": "fine"}\n\n{"text": "a\\ud800b"}\n', encoding="utf-8")
    with pytest.raises(DataError) as err:
        read_jsonl_file(str(jsonl), "text")
    assert str(err.value) == (f"data.paths: {jsonl}:3: field 'text' holds a lone surrogate ('\\ud800' at "
                              "character 1); expected valid Unicode text")
    paired = tmp_path / "paired.jsonl"
    paired.write_text('{"text": "\\ud83d\\ude00 ok"}\n', encoding="utf-8")  # a surrogate pair is one character
    assert read_jsonl_file(str(paired), "text") == ["\U0001F600 ok"]
    for name in ("bad.txt", "bad.jsonl"):
        bad = tmp_path / name
        bad.write_bytes(b'{"text": "one"}\n{"text": "caf\xe9"}\n')
        with pytest.raises(DataError) as err:
            read_jsonl_file(str(bad), "text") if name.endswith("jsonl") else read_text_file(str(bad))
        assert str(err.value) == (f"data.paths: {bad} is not UTF-8 text (line 2: undecodable byte 0xe9 at "
                                  "offset 29)")
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"a\r\nb\rc\n")
    assert read_text_file(str(crlf)) == "a\nb\nc\n"
