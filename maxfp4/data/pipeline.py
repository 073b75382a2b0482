"""Corpus -> packed rows -> grain pipeline -> this process's share of each global batch.

Dimension letters: B local batch rows, G global batch rows, P processes, R packed rows, T
sequence length (``data.seq_len``).

Everything is a grain ``MapDataset`` (random access, lazy), so the whole pipeline is an index
computation until a row is read:

- single source: ``rows.shuffle(seed)[:nb*G].batch(B)[p::P].repeat()``. Grain's shuffle draws a
  new permutation per epoch (seed + epoch) and its slice/batch carry the epoch through, so epoch
  e's global batch k is rows ``perm_e[k*G:(k+1)*G]`` (the last partial batch of each epoch is
  dropped, keeping batches aligned to epochs) and process p of P takes its p-th block of B = G/P
  rows, ``perm_e[k*G + p*B : k*G + (p+1)*B]``.
- mixture: each source's rows shuffled and repeated, interleaved by ``MapDataset.mix`` in
  proportion to the weights, then ``.batch(B)[p::P]`` as above.
- synthetic: row n is random tokens seeded by (seed, n); ``.batch(B)[p::P]``.

So the global batch depends on the seed and G only, never on P, and the position in the stream
(``next_index``, grain's own iterator state) is all that is needed to resume exactly.
"""

from __future__ import annotations

import functools
import math
import numpy as np

from maxfp4.config import Config
from maxfp4.data.corpus import (STREAM_DOCUMENTS, STREAM_EPOCH, STREAM_MIXTURE, STREAM_SYNTHETIC, Part,
                                grain_seed, load_corpus, load_eval_paths, rng, split_documents,
                                tokenize_documents)
from maxfp4.data.holdout import sequences_note
from maxfp4.data.packing import EmptyRows, PackedRows, PackedRowSource, chunk_document, pack_chunks
from maxfp4.data.tokenizer import Tokenizer
from maxfp4.errors import DataError

__all__ = ["BatchIterator", "make_batches", "make_eval_batches", "chunk_document", "pack_chunks",
           "tokenize_documents", "local_batch_size"]

_FIRST_REAL_TOKEN = 4  # ids below are pad/unk/bos/eos in the trained tokenizer's layout
_STREAM_EVAL_SYNTHETIC = 5


def local_batch_size(cfg: Config, process_index: int, process_count: int) -> int:
    """Rows per process, B = G / P; a G that P does not divide is an error, not a silent trim."""
    global_batch = cfg.data.global_batch
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(f"data: process_index={process_index} with process_count={process_count}: "
                        "expected 0 <= process_index < process_count")
    if global_batch % process_count:
        raise DataError(f"data.global_batch={global_batch}: expected a multiple of the process count "
                        f"{process_count}, so every process loads the same number of rows")
    return global_batch // process_count


def with_loss_mask(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(batch, loss_mask=(batch["segment_ids"] > 0).astype(np.float32))


class SyntheticRows:
    """Row n: uniform random tokens in [4, vocab_size) seeded by (seed, stream, n); one segment."""

    def __init__(self, seed: int, stream: int, vocab_size: int, seq_len: int):
        self.seed, self.stream, self.vocab_size, self.seq_len = seed, stream, vocab_size, seq_len

    def __len__(self) -> int:
        return 2**62  # endless for practical purposes; grain needs a length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        tokens_T1 = rng(self.seed, self.stream, index).integers(
            _FIRST_REAL_TOKEN, self.vocab_size, size=self.seq_len + 1, dtype=np.int32)
        return {"inputs": tokens_T1[:-1].copy(), "targets": tokens_T1[1:].copy(),
                "segment_ids": np.ones(self.seq_len, np.int32),
                "positions": np.arange(self.seq_len, dtype=np.int32)}


def _packed(cfg: Config, part: Part, doc_order_N: np.ndarray, pad_id: int) -> PackedRowSource:
    return PackedRowSource(part.documents, doc_order_N, part.lengths_N[doc_order_N], cfg.data.seq_len, pad_id)


def _too_few_rows(cfg: Config, rows: PackedRowSource, need: int, what: str) -> DataError:
    return DataError(
        f"data{what}: {rows.num_tokens} tokens pack into {rows.num_rows} rows of data.seq_len={cfg.data.seq_len}, "
        f"fewer than data.global_batch={need} (needs about {need * cfg.data.seq_len} tokens); add data or "
        "lower data.global_batch or data.seq_len")


class BatchIterator:
    """Infinite iterator of this process's share of each global batch, read through grain.

    ``next(it)`` -> dict: "inputs", "targets", "segment_ids", "positions" int32 [B, T] and
    "loss_mask" float32 [B, T]. ``max_runs_per_row``: no row of any batch holds more runs of
    equal segment ids (documents, and a padding tail) than this, known before the first batch
    from the packing layout (synthetic rows: 1), so the train step can pick its attention kernel
    when it is compiled. ``get_state()`` -> dict of plain ints: ``next_index`` (grain's
    iterator position) plus what identifies the data, checked by ``set_state``, which makes the
    next batch the one that followed when the state was taken.
    """

    def __init__(self, cfg: Config, dataset, *, tokenizer: Tokenizer | None, num_tokens: int, num_rows: int,
                 batches_per_epoch: int | None = None, row_source: PackedRowSource | None = None,
                 parts: list[Part] | None = None, max_runs_per_row: int):
        import grain

        self._dataset = dataset.map(with_loss_mask)
        self.tokenizer = tokenizer
        # The loaded corpus (None for synthetic data), so make_eval_batches need not load it again.
        self.corpus = (tokenizer, parts) if parts is not None else None
        # Start-up lines about how the data was split (a part held out as sequences).
        self.notes = [sequences_note(part, cfg.data.eval_fraction, cfg.data.seq_len)
                      for part in parts or [] if part.held_N is not None]
        self.num_tokens = num_tokens
        self.num_rows = num_rows
        self.max_runs_per_row = max_runs_per_row
        self.global_batch = cfg.data.global_batch
        self.batches_per_epoch = batches_per_epoch
        self._row_source = row_source
        self._workers = cfg.data.workers
        self._read_options = grain.ReadOptions(num_threads=cfg.data.read_threads,
                                               prefetch_buffer_size=cfg.data.prefetch)
        self._next_index = 0
        self._iterator = None  # started on the first next(), after any set_state

    @functools.cached_property
    def rows(self) -> PackedRows:
        """Every packed row, materialised (single-source data only; for inspection and tests)."""
        if self._row_source is None:
            raise AttributeError("rows: only a single-source packed dataset has a fixed row table")
        return self._row_source.materialise()

    def _start(self):
        import grain

        if self._workers == 0:
            iterator = iter(self._dataset.to_iter_dataset(self._read_options))
            iterator.set_state({"next_index": self._next_index})  # grain's own state format
            return iterator
        # Worker processes: grain's multiprocess state depends on the worker count, so the pipeline
        # restarts from the position instead; a run can then resume with a different data.workers.
        _mark_absl_flags_parsed()
        dataset = self._dataset[self._next_index:].to_iter_dataset(self._read_options)
        options = grain.MultiprocessingOptions(num_workers=self._workers,
                                               per_worker_buffer_size=max(self._read_options.prefetch_buffer_size, 1))
        return iter(dataset.mp_prefetch(options))

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._iterator is None:
            self._iterator = self._start()
        batch = next(self._iterator)
        self._next_index += 1
        return batch

    def get_state(self) -> dict[str, int]:
        if self._iterator is not None and self._workers == 0:
            # Our count of delivered batches is what the checkpoint stores; it must be grain's too.
            grain_state = self._iterator.get_state()
            if int(grain_state["next_index"]) != self._next_index:
                raise RuntimeError(f"grain iterator state {grain_state} disagrees with the "
                                   f"{self._next_index} batches delivered")
        state = {"next_index": self._next_index, "num_rows": self.num_rows, "global_batch": self.global_batch}
        if self.batches_per_epoch:
            state["epoch"], state["batch_in_epoch"] = divmod(self._next_index, self.batches_per_epoch)
        return state

    def set_state(self, state: dict) -> None:
        state = {k: int(v) for k, v in state.items()}
        if "next_index" not in state and "epoch" in state and self.batches_per_epoch:
            # Checkpoints from before the grain pipeline stored (epoch, batch_in_epoch).
            state["next_index"] = state["epoch"] * self.batches_per_epoch + state.get("batch_in_epoch", 0)
        for key, want in (("global_batch", self.global_batch), ("num_rows", self.num_rows)):
            if key in state and state[key] != want:
                raise DataError(
                    f"data iterator state has {key}={state[key]} but this run's data has {key}={want}; "
                    "the data or data.* settings changed since the checkpoint, so it cannot resume exactly")
        if state.get("next_index", -1) < 0:
            raise DataError(f"data iterator state {state}: expected a key next_index >= 0")
        self.close()
        self._next_index = state["next_index"]

    def close(self) -> None:
        """Stop grain's prefetch threads or worker processes (a fresh one starts on next())."""
        if self._iterator is not None and hasattr(self._iterator, "close"):
            self._iterator.close()
        self._iterator = None


def _mark_absl_flags_parsed() -> None:
    # grain's multiprocess prefetch reads absl flags, which raise when a program (like ours) never
    # parsed them; marking them parsed keeps every flag at its default.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _pad_id(tokenizer: Tokenizer) -> int:
    return max(tokenizer.pad_id, 0)


def _train_orders(cfg: Config, parts: list[Part]) -> list[np.ndarray]:
    """Training document indices of each part, in the seeded order they are packed in."""
    orders = []
    for i, part in enumerate(parts):
        train_N, _ = split_documents(part, cfg.data.eval_fraction, cfg.run.seed, i)
        # Part 0 uses the stream of the single-source pipeline, so a plain source packs the same
        # rows whether or not it is written as a one-part mixture.
        orders.append(train_N[rng(cfg.run.seed, STREAM_DOCUMENTS, *([i] if i else [])).permutation(len(train_N))])
    return orders


def make_batches(cfg: Config, run_dir: str, *, process_index: int = 0, process_count: int = 1) -> BatchIterator:
    """Build this process's batch iterator for ``cfg.data`` (training a tokenizer into run_dir if needed)."""
    import grain

    local_batch = local_batch_size(cfg, process_index, process_count)  # fail before any tokenizer training
    G, seed = cfg.data.global_batch, cfg.run.seed
    if cfg.data.source == "synthetic":
        _check_synthetic_vocab(cfg)
        rows = SyntheticRows(seed, STREAM_SYNTHETIC, cfg.model.vocab_size, cfg.data.seq_len)
        dataset = grain.MapDataset.source(rows).batch(local_batch)[process_index::process_count]
        return BatchIterator(cfg, dataset, tokenizer=None, num_tokens=0, num_rows=0, max_runs_per_row=1)

    tokenizer, parts = load_corpus(cfg, run_dir)
    sources = [_packed(cfg, part, order, _pad_id(tokenizer)) for part, order in zip(parts, _train_orders(cfg, parts))]
    num_tokens, num_rows = sum(s.num_tokens for s in sources), sum(s.num_rows for s in sources)
    if len(sources) == 1:
        (rows,) = sources
        batches_per_epoch = rows.num_rows // G
        if batches_per_epoch == 0:
            raise _too_few_rows(cfg, rows, G, "")
        dataset = (grain.MapDataset.source(rows).shuffle(grain_seed(seed, STREAM_EPOCH))[:batches_per_epoch * G]
                   .batch(local_batch, drop_remainder=True)[process_index::process_count].repeat())
        return BatchIterator(cfg, dataset, tokenizer=tokenizer, num_tokens=num_tokens, num_rows=num_rows,
                             batches_per_epoch=batches_per_epoch, row_source=rows, parts=parts,
                             max_runs_per_row=rows.max_runs_per_row)
    for part, rows in zip(parts, sources):
        if rows.num_rows == 0:
            raise DataError(f"data.mixture part {part.name}: no rows to train on")
    streams = [grain.MapDataset.source(rows).shuffle(grain_seed(seed, STREAM_MIXTURE, i)).repeat()
               for i, rows in enumerate(sources)]
    mixed = grain.MapDataset.mix(streams, [part.weight for part in parts])
    dataset = mixed.batch(local_batch, drop_remainder=True)[process_index::process_count]
    return BatchIterator(cfg, dataset, tokenizer=tokenizer, num_tokens=num_tokens, num_rows=num_rows, parts=parts,
                         max_runs_per_row=max(rows.max_runs_per_row for rows in sources))


def _check_synthetic_vocab(cfg: Config) -> None:
    if cfg.model.vocab_size <= _FIRST_REAL_TOKEN:
        raise DataError(f"model.vocab_size={cfg.model.vocab_size}: data.source=synthetic draws ids from "
                        f"[{_FIRST_REAL_TOKEN}, vocab_size), so expected more than {_FIRST_REAL_TOKEN}")


def make_eval_batches(cfg: Config, run_dir: str, *, process_index: int = 0, process_count: int = 1,
                      corpus: tuple[Tokenizer, list[Part]] | None = None) -> list[dict[str, np.ndarray]]:
    """This process's shares of the held-out global batches: a finite, deterministic list.

    ``corpus``: the training iterator's ``.corpus`` (tokenizer and parts), so the data is not
    read and tokenized a second time; None loads it.

    Held-out rows are packed in document order (no shuffle: every evaluation sees the same data)
    and cut into at most ``data.eval_batches`` global batches; the last is filled with padding
    rows (loss_mask 0), so no held-out token is dropped and every process gets B rows.
    """
    import grain

    local_batch = local_batch_size(cfg, process_index, process_count)
    G = cfg.data.global_batch
    if cfg.data.source == "synthetic":
        _check_synthetic_vocab(cfg)
        rows = SyntheticRows(cfg.run.seed, _STREAM_EVAL_SYNTHETIC, cfg.model.vocab_size, cfg.data.seq_len)
        dataset = grain.MapDataset.source(rows)[:cfg.data.eval_batches * G]
    else:
        tokenizer, parts = corpus or load_corpus(cfg, run_dir)
        pad_id = _pad_id(tokenizer)
        if cfg.data.eval_paths:
            held = [(part := load_eval_paths(cfg, tokenizer), np.arange(len(part.lengths_N)))]
        elif cfg.data.eval_fraction > 0:
            held = [(part, split_documents(part, cfg.data.eval_fraction, cfg.run.seed, i)[1])
                    for i, part in enumerate(parts)]
        else:
            raise DataError("no held-out data: set data.eval_fraction or data.eval_paths")
        sources = [grain.MapDataset.source(_packed(cfg, part, order, pad_id)) for part, order in held]
        eval_rows = grain.MapDataset.concatenate(sources) if len(sources) > 1 else sources[0]
        if len(eval_rows) == 0:
            raise DataError("the held-out documents pack into no rows (each has fewer than 2 tokens)")
        n_batches = min(math.ceil(len(eval_rows) / G), cfg.data.eval_batches)
        kept = eval_rows[:n_batches * G]
        padding = n_batches * G - len(kept)
        dataset = (grain.MapDataset.concatenate([kept, grain.MapDataset.source(EmptyRows(padding, cfg.data.seq_len, pad_id))])
                   if padding else kept)
    shares = dataset.batch(local_batch, drop_remainder=True)[process_index::process_count].map(with_loss_mask)
    return [shares[k] for k in range(len(shares))]

