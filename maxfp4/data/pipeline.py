"""Documents -> tokens -> packed rows -> per-process shares of each global batch.

Dimension letters: B local batch rows, G global batch rows, R packed rows in the dataset,
T sequence length (``data.seq_len``).

Packing: each document becomes ``[bos] + tokens + [eos]``, cut into chunks of at most T+1
tokens that overlap by one token, so every next-token pair of the document lands in exactly one
chunk. Chunks (documents in a seeded shuffled order) fill rows of T pairs first-fit in order;
``segment_ids`` number the chunks of a row from 1 (0 is padding) and ``positions`` restart at 0
in each chunk, so attention can be masked per segment and no pair ever crosses documents.

Batching: epoch e visits the rows in a permutation seeded by (run.seed, e); global batch k of
the epoch is rows ``[k*G, (k+1)*G)`` of it, and process p of P takes the p-th slice of B = G/P
rows. The global batch therefore does not depend on the process count, and ``(epoch, k)`` is
all the state needed to resume exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from maxfp4.config import Config
from maxfp4.data.sources import load_documents
from maxfp4.data.tokenizer import Tokenizer, load_or_train_tokenizer
from maxfp4.errors import DataError

# Independent random streams, so reshuffling one never perturbs another.
_STREAM_DOCUMENTS, _STREAM_EPOCH, _STREAM_SYNTHETIC = 0, 1, 2
_FIRST_REAL_TOKEN = 4  # ids below are pad/unk/bos/eos in the trained tokenizer's layout


def _rng(seed: int, stream: int, *counters: int) -> np.random.Generator:
    # SeedSequence wants non-negative entropy; masking maps a negative run.seed to a distinct one.
    return np.random.default_rng([seed & 0xFFFF_FFFF_FFFF_FFFF, stream, *counters])


# ----------------------------------------------------------------------------- packing


@dataclass(frozen=True)
class PackedRows:
    """The whole packed dataset: four int32 arrays of shape [R, T]."""

    inputs_RT: np.ndarray
    targets_RT: np.ndarray
    segment_ids_RT: np.ndarray
    positions_RT: np.ndarray

    @property
    def num_rows(self) -> int:
        return self.inputs_RT.shape[0]

    @property
    def num_tokens(self) -> int:
        """Trained-on (input, target) pairs, i.e. the non-padding positions."""
        return int(np.count_nonzero(self.segment_ids_RT))


def chunk_document(ids: np.ndarray, seq_len: int) -> list[np.ndarray]:
    """Chunks of at most seq_len+1 tokens starting every seq_len tokens; chunks of <2 tokens dropped.

    Chunk i ends with the token chunk i+1 starts with: that token is a target in chunk i and an
    input in chunk i+1, so no pair is lost at the cut.
    """
    return [ids[start:start + seq_len + 1] for start in range(0, max(len(ids) - 1, 0), seq_len)]


def pack_chunks(chunks: Sequence[np.ndarray], seq_len: int, pad_id: int) -> PackedRows:
    """First-fit in order: a chunk joins the current row if its pairs fit, else opens a new row."""
    row_of = np.empty(len(chunks), np.int64)
    col_of = np.empty(len(chunks), np.int64)
    seg_of = np.empty(len(chunks), np.int64)
    row, used, seg = -1, seq_len, 0
    for i, chunk in enumerate(chunks):
        pairs = len(chunk) - 1
        if used + pairs > seq_len:
            row, used, seg = row + 1, 0, 0
        seg += 1
        row_of[i], col_of[i], seg_of[i] = row, used, seg
        used += pairs
    num_rows = row + 1
    inputs_RT = np.full((num_rows, seq_len), pad_id, np.int32)
    targets_RT = np.full((num_rows, seq_len), pad_id, np.int32)
    segment_ids_RT = np.zeros((num_rows, seq_len), np.int32)
    positions_RT = np.zeros((num_rows, seq_len), np.int32)
    for chunk, r, c, s in zip(chunks, row_of, col_of, seg_of):
        n = len(chunk) - 1
        inputs_RT[r, c:c + n] = chunk[:-1]
        targets_RT[r, c:c + n] = chunk[1:]
        segment_ids_RT[r, c:c + n] = s
        positions_RT[r, c:c + n] = np.arange(n, dtype=np.int32)
    return PackedRows(inputs_RT, targets_RT, segment_ids_RT, positions_RT)


def tokenize_documents(documents: Sequence[str], tokenizer: Tokenizer) -> list[np.ndarray]:
    """``[bos] + encode(doc) + [eos]`` per document (a marker the tokenizer lacks is left out)."""
    head = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    tail = [tokenizer.eos_id] if tokenizer.eos_id >= 0 else []
    return [np.asarray(head + ids + tail, np.int32) for ids in tokenizer.encode_batch(documents)]


def pack_documents(token_docs: Sequence[np.ndarray], seq_len: int, pad_id: int, seed: int) -> PackedRows:
    """Shuffle the document order with ``seed``, chunk each document, and pack the chunks."""
    order = _rng(seed, _STREAM_DOCUMENTS).permutation(len(token_docs))
    chunks = [chunk for i in order for chunk in chunk_document(token_docs[i], seq_len)]
    return pack_chunks(chunks, seq_len, pad_id)


# ----------------------------------------------------------------------------- iterators


def _batch_dict(inputs_BT, targets_BT, segment_ids_BT, positions_BT) -> dict[str, np.ndarray]:
    return {
        "inputs": inputs_BT,
        "targets": targets_BT,
        "segment_ids": segment_ids_BT,
        "positions": positions_BT,
        "loss_mask": (segment_ids_BT > 0).astype(np.float32),
    }


def _check_state(state: dict, keys: tuple[str, ...], expected: dict[str, int]) -> dict[str, int]:
    missing = [k for k in keys if k not in state]
    if missing:
        raise DataError(f"data iterator state {dict(state)!r}: missing key {missing[0]!r}; expected keys {keys}")
    values = {k: int(state[k]) for k in keys}
    for key, want in expected.items():
        if values[key] != want:
            raise DataError(
                f"data iterator state has {key}={values[key]} but this run's data has {key}={want}; "
                "the data or data.* settings changed since the checkpoint, so it cannot resume exactly"
            )
    return values


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


class BatchIterator:
    """Infinite iterator of this process's share of each global batch.

    ``next(it)`` -> dict: "inputs", "targets", "segment_ids", "positions" int32 [B, T] and
    "loss_mask" float32 [B, T]. ``get_state()`` -> dict of plain ints; ``set_state(state)`` makes
    the next batch the one that followed when the state was taken.
    """

    tokenizer: Tokenizer | None
    num_tokens: int

    def __init__(self, cfg: Config, process_index: int, process_count: int):
        self.seed = cfg.run.seed
        self.seq_len = cfg.data.seq_len
        self.global_batch = cfg.data.global_batch
        self.local_batch = local_batch_size(cfg, process_index, process_count)
        self._row_start = process_index * self.local_batch

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def get_state(self) -> dict[str, int]:
        raise NotImplementedError

    def set_state(self, state: dict) -> None:
        raise NotImplementedError


class PackedBatchIterator(BatchIterator):
    """Batches of packed document rows, epoch after epoch (a last partial batch is dropped)."""

    def __init__(self, cfg: Config, rows: PackedRows, tokenizer: Tokenizer, process_index: int,
                 process_count: int):
        super().__init__(cfg, process_index, process_count)
        if rows.num_rows < self.global_batch:
            raise DataError(
                f"data: {rows.num_tokens} tokens pack into {rows.num_rows} rows of data.seq_len={self.seq_len}, "
                f"fewer than data.global_batch={self.global_batch} (needs about "
                f"{self.global_batch * self.seq_len} tokens); add data or lower data.global_batch or data.seq_len"
            )
        self.rows = rows
        self.tokenizer = tokenizer
        self.num_tokens = rows.num_tokens
        self.batches_per_epoch = rows.num_rows // self.global_batch
        self.epoch = 0
        self.batch_in_epoch = 0
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, row permutation [R])

    def _epoch_order(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            self._order = (self.epoch, _rng(self.seed, _STREAM_EPOCH, self.epoch).permutation(self.rows.num_rows))
        return self._order[1]

    def __next__(self) -> dict[str, np.ndarray]:
        start = self.batch_in_epoch * self.global_batch + self._row_start
        idx_B = self._epoch_order()[start:start + self.local_batch]
        r = self.rows
        batch = _batch_dict(r.inputs_RT[idx_B], r.targets_RT[idx_B], r.segment_ids_RT[idx_B], r.positions_RT[idx_B])
        self.batch_in_epoch += 1
        if self.batch_in_epoch == self.batches_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0
        return batch

    def get_state(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "num_rows": self.rows.num_rows,
            "global_batch": self.global_batch,
        }

    def set_state(self, state: dict) -> None:
        values = _check_state(state, ("epoch", "batch_in_epoch", "num_rows", "global_batch"),
                              {"num_rows": self.rows.num_rows, "global_batch": self.global_batch})
        if values["epoch"] < 0 or not 0 <= values["batch_in_epoch"] < self.batches_per_epoch:
            raise DataError(f"data iterator state {values}: expected epoch >= 0 and "
                            f"0 <= batch_in_epoch < {self.batches_per_epoch}")
        self.epoch, self.batch_in_epoch = values["epoch"], values["batch_in_epoch"]


class SyntheticBatchIterator(BatchIterator):
    """Uniform random tokens in [4, vocab_size): one segment per row, a fresh global batch per step."""

    def __init__(self, cfg: Config, process_index: int, process_count: int):
        super().__init__(cfg, process_index, process_count)
        self.vocab_size = cfg.model.vocab_size
        if self.vocab_size <= _FIRST_REAL_TOKEN:
            raise DataError(f"model.vocab_size={self.vocab_size}: data.source=synthetic draws ids from "
                            f"[{_FIRST_REAL_TOKEN}, vocab_size), so expected more than {_FIRST_REAL_TOKEN}")
        self.tokenizer = None
        self.num_tokens = 0  # an endless stream has no dataset size
        self.step = 0

    def __next__(self) -> dict[str, np.ndarray]:
        # The whole global batch is drawn on every process so each share is independent of P.
        tokens_GT1 = _rng(self.seed, _STREAM_SYNTHETIC, self.step).integers(
            _FIRST_REAL_TOKEN, self.vocab_size, size=(self.global_batch, self.seq_len + 1), dtype=np.int32)
        tokens_BT1 = tokens_GT1[self._row_start:self._row_start + self.local_batch]
        shape = (self.local_batch, self.seq_len)
        self.step += 1
        return _batch_dict(
            np.ascontiguousarray(tokens_BT1[:, :-1]),
            np.ascontiguousarray(tokens_BT1[:, 1:]),
            np.ones(shape, np.int32),
            np.broadcast_to(np.arange(self.seq_len, dtype=np.int32), shape).copy(),
        )

    def get_state(self) -> dict[str, int]:
        return {"step": self.step, "global_batch": self.global_batch}

    def set_state(self, state: dict) -> None:
        values = _check_state(state, ("step", "global_batch"), {"global_batch": self.global_batch})
        if values["step"] < 0:
            raise DataError(f"data iterator state {values}: expected step >= 0")
        self.step = values["step"]


def make_batches(cfg: Config, run_dir: str, *, process_index: int = 0, process_count: int = 1) -> BatchIterator:
    """Build this process's batch iterator for ``cfg.data`` (training a tokenizer into run_dir if needed)."""
    local_batch_size(cfg, process_index, process_count)  # fail before any tokenizer training
    if cfg.data.source == "synthetic":
        return SyntheticBatchIterator(cfg, process_index, process_count)
    documents = load_documents(cfg)
    tokenizer = load_or_train_tokenizer(cfg, documents, run_dir)
    token_docs = tokenize_documents(documents, tokenizer)
    rows = pack_documents(token_docs, cfg.data.seq_len, max(tokenizer.pad_id, 0), cfg.run.seed)
    return PackedBatchIterator(cfg, rows, tokenizer, process_index, process_count)
