"""Data path: packing boundaries, determinism, process sharding, resume, tokenizer, sources, errors."""

from __future__ import annotations

import collections
import re

import numpy as np
import pytest

from maxfp4.config import load_config
from maxfp4.data import BatchIterator, load_documents, make_batches
from maxfp4.data.packing import PackedRowSource
from maxfp4.data.pipeline import chunk_document, pack_chunks, tokenize_documents
from maxfp4.errors import DataError

SEQ_LEN = 64
VOCAB = 512


def builtin_cfg(tmp_path, *overrides):
    return load_config(None, [
        "data.source=builtin", f"model.vocab_size={VOCAB}", f"data.seq_len={SEQ_LEN}",
        "data.global_batch=8", f"run.output_dir={tmp_path}", *overrides,
    ])


def text_cfg(tmp_path, paths, *overrides):
    return load_config(None, [
        "data.source=text", f"data.paths={list(map(str, paths))}", f"model.vocab_size={VOCAB}",
        "data.seq_len=16", "data.global_batch=2", f"run.output_dir={tmp_path}", *overrides,
    ])


@pytest.fixture(scope="module")
def builtin_tokenizer(tmp_path_factory):
    """A tokenizer trained once on the builtin corpus, for tests that only need some tokenizer."""
    run_dir = tmp_path_factory.mktemp("tok")
    it = make_batches(builtin_cfg(run_dir), str(run_dir))
    return it.tokenizer.path


def take(it: BatchIterator, n: int) -> list[dict]:
    return [next(it) for _ in range(n)]


def segments(batch: dict) -> list[tuple[int, ...]]:
    """Each segment of each row as its token sequence: its inputs followed by its last target."""
    out = []
    for inp, tgt, seg, pos in zip(batch["inputs"], batch["targets"], batch["segment_ids"], batch["positions"]):
        for s in np.unique(seg[seg > 0]):
            cols = np.flatnonzero(seg == s)
            assert np.array_equal(cols, np.arange(cols[0], cols[-1] + 1)), "a segment is not contiguous"
            assert np.array_equal(pos[cols], np.arange(len(cols))), "positions do not restart at 0"
            out.append(tuple(int(t) for t in inp[cols]) + (int(tgt[cols[-1]]),))
    return out


def expected_chunks(token_docs, seq_len) -> list[tuple[int, ...]]:
    """The contract, restated: windows of seq_len+1 tokens every seq_len tokens, at least 2 tokens."""
    return [tuple(int(t) for t in d[s:s + seq_len + 1]) for d in token_docs for s in range(0, len(d) - 1, seq_len)]


def runs_per_row(segment_ids_BT: np.ndarray) -> np.ndarray:
    """int [B]: runs of equal segment ids in each row (documents, and a padding tail as one),
    counted from the ids: the reference for the bound the packing layout gives."""
    return 1 + np.count_nonzero(segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1], axis=1)


def assert_batches_equal(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


# ----------------------------------------------------------------------------- packing


def test_chunks_overlap_by_one_and_cover_every_pair():
    ids = np.arange(100, 100 + 2 * SEQ_LEN + 2)  # 2T+2 tokens -> chunks of T+1, T+1, 2
    chunks = chunk_document(ids, SEQ_LEN)
    assert [len(c) for c in chunks] == [SEQ_LEN + 1, SEQ_LEN + 1, 2]
    pairs = [(int(a), int(b)) for c in chunks for a, b in zip(c[:-1], c[1:])]
    assert pairs == [(int(a), int(b)) for a, b in zip(ids[:-1], ids[1:])]
    # T+1 tokens fit one chunk exactly; a dangling overlap token gives no chunk; one token gives none.
    assert len(chunk_document(ids[:SEQ_LEN + 1], SEQ_LEN)) == 1
    assert len(chunk_document(ids[:2 * SEQ_LEN + 1], SEQ_LEN)) == 2
    assert chunk_document(ids[:1], SEQ_LEN) == []


def test_pack_chunks_first_fit_layout():
    seq_len, pad = 8, 0
    # 4 + 3 + 1 pairs fill the first row exactly; 8 pairs fill the second; 1 pair opens a third.
    chunks = [np.arange(10, 15), np.arange(20, 24), np.arange(50, 52), np.arange(30, 39), np.arange(40, 42)]
    rows = pack_chunks(chunks, seq_len, pad)
    assert rows.num_rows == 3 and rows.num_tokens == 17
    np.testing.assert_array_equal(rows.segment_ids_RT, [[1, 1, 1, 1, 2, 2, 2, 3],
                                                        [1] * 8,
                                                        [1, 0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(rows.positions_RT[0], [0, 1, 2, 3, 0, 1, 2, 0])
    np.testing.assert_array_equal(rows.inputs_RT[0], [10, 11, 12, 13, 20, 21, 22, 50])
    np.testing.assert_array_equal(rows.targets_RT[0], [11, 12, 13, 14, 21, 22, 23, 51])
    np.testing.assert_array_equal(rows.targets_RT[1], np.arange(31, 39))
    np.testing.assert_array_equal(rows.inputs_RT[2], [40] + [pad] * 7)
    # Runs per row (documents, and a padding tail as one more): 3, 1 and 2.
    np.testing.assert_array_equal(runs_per_row(rows.segment_ids_RT), [3, 1, 2])


@pytest.mark.parametrize("seed", range(4))
def test_layout_bounds_runs_per_row(seed):
    """The bound the train step compiles its attention kernel for, read off the packing layout
    before any row exists, is the most runs any materialised row holds (counted from its ids)."""
    rng = np.random.default_rng(seed)
    seq_len = 16
    # Short documents (many a row), exact fills, and documents longer than a row.
    lengths = rng.choice([2, 3, 5, seq_len + 1, 2 * seq_len + 3], size=60)
    docs = [np.arange(n, dtype=np.int32) for n in lengths]
    source = PackedRowSource(docs, np.arange(len(docs)), lengths, seq_len, 0)
    counted = runs_per_row(source.materialise().segment_ids_RT)
    assert source.max_runs_per_row == counted.max()
    assert counted.max() > 1  # the bound is not trivially 1 here


def test_runs_per_row_counts_changes_of_segment_id():
    seg = np.array([[1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 0]])
    np.testing.assert_array_equal(runs_per_row(seg), [3, 1, 1, 6])


def test_packed_batches_follow_documents(tmp_path):
    cfg = builtin_cfg(tmp_path)
    it = make_batches(cfg, str(tmp_path / "run"))
    token_docs = tokenize_documents(load_documents(cfg), it.tokenizer)
    tok = it.tokenizer
    assert all(d[0] == tok.bos_id and d[-1] == tok.eos_id for d in token_docs)
    want = expected_chunks(token_docs, SEQ_LEN)
    assert it.num_tokens == sum(len(d) - 1 for d in token_docs)

    got = []
    for batch in take(it, it.batches_per_epoch):  # one full epoch
        for key in ("inputs", "targets", "segment_ids", "positions"):
            assert batch[key].shape == (8, SEQ_LEN) and batch[key].dtype == np.int32
        assert batch["loss_mask"].dtype == np.float32
        np.testing.assert_array_equal(batch["loss_mask"], (batch["segment_ids"] > 0).astype(np.float32))
        assert np.all(batch["inputs"][batch["segment_ids"] == 0] == max(tok.pad_id, 0))
        assert runs_per_row(batch["segment_ids"]).max() <= it.max_runs_per_row
        got += segments(batch)
    # Every segment is a chunk of one document (so each target is that document's next token and no
    # pair crosses documents), and no chunk is served more often in an epoch than the data holds it.
    assert not collections.Counter(got) - collections.Counter(want)
    dropped_rows = it.rows.num_rows - it.batches_per_epoch * 8
    assert sum(len(s) - 1 for s in got) >= it.num_tokens - dropped_rows * SEQ_LEN
    # Documents are longer than a row, so some segments are continuation chunks (no bos).
    assert any(s[0] != tok.bos_id for s in got) and any(s[0] == tok.bos_id for s in got)


def test_text_files_reconstruct_exactly(tmp_path, builtin_tokenizer):
    texts = ["The quick brown fox jumps over the lazy dog. " * 7, "Hello, world!\n", "Ünïcode ✓ and\ttabs\n" * 3]
    paths = []
    for i, text in enumerate(texts):
        paths.append(tmp_path / f"doc{i}.txt")
        paths[-1].write_text(text, encoding="utf-8")
    cfg = text_cfg(tmp_path, [tmp_path / "doc*.txt"], f"data.tokenizer={builtin_tokenizer}", "data.global_batch=1")
    it = make_batches(cfg, str(tmp_path / "run"))
    got = [s for b in take(it, it.batches_per_epoch) for s in segments(b)]
    token_docs = tokenize_documents(texts, it.tokenizer)
    assert sorted(got) == sorted(expected_chunks(token_docs, 16))  # global_batch=1: nothing dropped
    assert [it.tokenizer.decode(d) for d in token_docs] == texts


# ----------------------------------------------------------------------------- determinism, sharding, resume


def test_same_seed_same_batches_other_seed_differs(tmp_path):
    a = take(make_batches(builtin_cfg(tmp_path), str(tmp_path / "a")), 3)
    b = take(make_batches(builtin_cfg(tmp_path), str(tmp_path / "b")), 3)  # retrains: same tokenizer too
    assert_batches_equal(a, b)
    assert (tmp_path / "a" / "tokenizer.model").read_bytes() == (tmp_path / "b" / "tokenizer.model").read_bytes()
    c = take(make_batches(builtin_cfg(tmp_path, "run.seed=1"), str(tmp_path / "a")), 3)
    assert not np.array_equal(a[0]["inputs"], c[0]["inputs"])


@pytest.mark.parametrize("source", ["builtin", "synthetic"])
def test_process_shares_concatenate_to_global_batch(tmp_path, source):
    # global_batch=512 over ~4k rows: 8 batches per epoch, so 10 batches cross an epoch boundary.
    cfg = builtin_cfg(tmp_path, f"data.source={source}", "data.global_batch=512")
    run_dir = str(tmp_path / "run")
    whole = take(make_batches(cfg, run_dir), 10)
    shares = [take(make_batches(cfg, run_dir, process_index=p, process_count=2), 10) for p in range(2)]
    for k in range(10):
        for key in whole[k]:
            assert shares[0][k][key].shape[0] == 256
            np.testing.assert_array_equal(np.concatenate([shares[0][k][key], shares[1][k][key]]), whole[k][key])
    assert not np.array_equal(shares[0][0]["inputs"], shares[1][0]["inputs"])


def test_global_batch_not_divisible_by_processes(tmp_path):
    with pytest.raises(DataError, match=r"data.global_batch=8.*process count 3"):
        make_batches(builtin_cfg(tmp_path), str(tmp_path / "run"), process_index=0, process_count=3)
    assert not (tmp_path / "run").exists()  # rejected before training a tokenizer


def test_epochs_reshuffle_rows(tmp_path):
    it = make_batches(builtin_cfg(tmp_path, "data.global_batch=512"), str(tmp_path / "run"))
    n = it.batches_per_epoch
    epochs = [np.concatenate([b["inputs"] for b in take(it, n)]) for _ in range(2)]
    assert it.get_state()["epoch"] == 2 and it.get_state()["batch_in_epoch"] == 0
    # An epoch serves each packed row at most once, and the next epoch serves them in a new order.
    all_rows = collections.Counter(r.tobytes() for r in it.rows.inputs_RT)
    for rows in epochs:
        assert not collections.Counter(r.tobytes() for r in rows) - all_rows
    assert not np.array_equal(epochs[0], epochs[1])


@pytest.mark.parametrize("source", ["builtin", "synthetic"])
def test_state_round_trip(tmp_path, source):
    cfg = builtin_cfg(tmp_path, f"data.source={source}", "data.global_batch=512")
    run_dir = str(tmp_path / "run")
    it = make_batches(cfg, run_dir)
    take(it, 11)  # past the first epoch (8 batches) for builtin
    state = it.get_state()
    assert all(type(v) is int for v in state.values())
    expected = take(it, 3)
    fresh = make_batches(cfg, run_dir)
    fresh.set_state({k: np.int64(v) for k, v in state.items()})  # as a checkpoint may hand it back
    assert_batches_equal(take(fresh, 3), expected)
    if source == "builtin":
        assert state["epoch"] == 1
        bad = dict(state, num_rows=state["num_rows"] + 1)
        with pytest.raises(DataError, match="num_rows"):
            fresh.set_state(bad)


# ----------------------------------------------------------------------------- tokenizer


def test_tokenizer_trained_once_and_reused(tmp_path):
    run_dir = tmp_path / "run"
    first = make_batches(builtin_cfg(tmp_path), str(run_dir))
    path = run_dir / "tokenizer.model"
    assert first.tokenizer.path == str(path) and first.tokenizer.vocab_size == VOCAB
    assert (first.tokenizer.pad_id, first.tokenizer.bos_id, first.tokenizer.eos_id) == (0, 2, 3)
    stat, content = path.stat(), path.read_bytes()
    assert [p.name for p in run_dir.iterdir()] == ["tokenizer.model"]  # no temporary left behind
    second = make_batches(builtin_cfg(tmp_path), str(run_dir))
    assert path.stat().st_mtime_ns == stat.st_mtime_ns and path.read_bytes() == content
    assert second.tokenizer.path == str(path)
    text = "def f(x):\n    return x ** 2  # ünïcode ✓"
    assert second.tokenizer.decode(second.tokenizer.encode(text)) == text


def test_tokenizer_vocab_mismatch_names_file(tmp_path, builtin_tokenizer):
    with pytest.raises(DataError, match=rf"{re.escape(builtin_tokenizer)}.*512.*model.vocab_size=600"):
        make_batches(builtin_cfg(tmp_path, f"data.tokenizer={builtin_tokenizer}", "model.vocab_size=600"),
                     str(tmp_path / "run"))
    run_dir = tmp_path / "resumed"
    make_batches(builtin_cfg(tmp_path), str(run_dir))
    with pytest.raises(DataError, match=rf"{re.escape(str(run_dir / 'tokenizer.model'))}.*512.*model.vocab_size=600"):
        make_batches(builtin_cfg(tmp_path, "model.vocab_size=600"), str(run_dir))


def test_vocab_too_large_for_data_suggests_smaller(tmp_path):
    (tmp_path / "small.txt").write_text("a tiny corpus of a few words\n" * 5)
    cfg = text_cfg(tmp_path, [tmp_path / "small.txt"], "model.vocab_size=4096")
    with pytest.raises(DataError, match=r"model.vocab_size=4096 is too large.*model.vocab_size<=\d+"):
        make_batches(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run" / "tokenizer.model").exists()


def test_not_a_tokenizer_file(tmp_path):
    bogus = tmp_path / "bogus.model"
    bogus.write_bytes(b"not a model")
    with pytest.raises(DataError, match=re.escape(str(bogus))):
        make_batches(builtin_cfg(tmp_path, f"data.tokenizer={bogus}"), str(tmp_path / "run"))


# ----------------------------------------------------------------------------- text source errors


def test_missing_path_and_glob_are_named(tmp_path):
    (tmp_path / "ok.txt").write_text("some text\n")
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=f"{re.escape(str(missing))}.*does not exist"):
        make_batches(text_cfg(tmp_path, [tmp_path / "ok.txt", missing]), str(tmp_path / "run"))
    glob = tmp_path / "*.jsonl"
    with pytest.raises(DataError, match=rf"glob '{re.escape(str(glob))}' matches no files"):
        make_batches(text_cfg(tmp_path, [tmp_path / "ok.txt", glob]), str(tmp_path / "run"))


def test_empty_files(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("" if name == "a.txt" else "  \n")
    with pytest.raises(DataError, match=r"all 2 file\(s\) are empty"):
        make_batches(text_cfg(tmp_path, [tmp_path / "*.txt"]), str(tmp_path / "run"))


def test_undecodable_file_is_named(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError, match=f"{re.escape(str(bad))} is not UTF-8"):
        make_batches(text_cfg(tmp_path, [bad]), str(tmp_path / "run"))


def test_too_little_data_for_one_batch(tmp_path, builtin_tokenizer):
    (tmp_path / "short.txt").write_text("Only a sentence or two of text here.\n")
    cfg = text_cfg(tmp_path, [tmp_path / "short.txt"], f"data.tokenizer={builtin_tokenizer}",
                   "data.global_batch=64")
    with pytest.raises(DataError, match=r"\d+ tokens pack into \d+ rows.*data.global_batch=64.*1024 tokens"):
        make_batches(cfg, str(tmp_path / "run"))


# ----------------------------------------------------------------------------- synthetic


def test_synthetic_batches(tmp_path):
    cfg = builtin_cfg(tmp_path, "data.source=synthetic", "model.vocab_size=37", "data.global_batch=4")
    it = make_batches(cfg, str(tmp_path / "run"))
    assert it.tokenizer is None and it.num_tokens == 0
    batches = take(it, 3)
    for b in batches:
        assert {k: (v.shape, v.dtype.name) for k, v in b.items()} == {
            "inputs": ((4, SEQ_LEN), "int32"), "targets": ((4, SEQ_LEN), "int32"),
            "segment_ids": ((4, SEQ_LEN), "int32"), "positions": ((4, SEQ_LEN), "int32"),
            "loss_mask": ((4, SEQ_LEN), "float32")}
        for key in ("inputs", "targets"):
            assert b[key].min() >= 4 and b[key].max() < 37
        np.testing.assert_array_equal(b["targets"][:, :-1], b["inputs"][:, 1:])
        assert np.all(b["segment_ids"] == 1) and np.all(b["loss_mask"] == 1.0)
        assert it.max_runs_per_row == 1  # so the train step compiles the smallest packed kernel
        np.testing.assert_array_equal(b["positions"], np.tile(np.arange(SEQ_LEN), (4, 1)))
    assert len(np.unique(np.concatenate([b["inputs"] for b in batches]))) == 33  # all of [4, 37) drawn
    assert not np.array_equal(batches[0]["inputs"], batches[1]["inputs"])
    assert_batches_equal(take(make_batches(cfg, str(tmp_path / "run")), 3), batches)
    assert not (tmp_path / "run").exists()  # no tokenizer for synthetic data
