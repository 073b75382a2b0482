"""Packing token documents into rows of T next-token pairs, with segment ids and positions.

Dimension letters: R packed rows, T sequence length (``data.seq_len``), N documents, C chunks.

Each document (already ``[bos] + tokens + [eos]``) is cut into chunks of at most T+1 tokens that
overlap by one token, so every next-token pair of the document lands in exactly one chunk.
Chunks fill rows of T pairs first-fit in order; ``segment_ids`` number the chunks of a row from 1
(0 is padding) and ``positions`` restart at 0 in each chunk, so attention can be masked per
segment and no pair ever crosses documents.

The layout (which chunk goes where) is computed from document lengths alone, and a row is
materialised only when asked for: :class:`PackedRowSource` is a random-access grain source, so a
process reads just the documents of the rows in its share of each batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class PackedRows:
    """A packed dataset materialised: four int32 arrays of shape [R, T]."""

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


def first_fit_layout(pairs_C: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row, column, segment id) of each chunk: a chunk joins the current row if its pairs fit,
    else it opens a new row. Sequential by nature (each placement depends on the last); a plain
    loop over ints is fast enough for millions of chunks."""
    row_C = np.empty(len(pairs_C), np.int64)
    col_C = np.empty(len(pairs_C), np.int64)
    seg_C = np.empty(len(pairs_C), np.int32)
    row, used, seg = -1, seq_len, 0
    for i, pairs in enumerate(pairs_C.tolist()):
        if used + pairs > seq_len:
            row, used, seg = row + 1, 0, 0
        seg += 1
        row_C[i], col_C[i], seg_C[i] = row, used, seg
        used += pairs
    return row_C, col_C, seg_C


def _max_runs_per_row(pairs_C: np.ndarray, row_first_chunk_R1: np.ndarray, seq_len: int) -> int:
    """The most runs of equal segment ids in any row of a layout: its chunks, plus the padding
    tail where the chunks leave one (at least 1: an empty layout has no rows to bound)."""
    if len(pairs_C) == 0:
        return 1
    chunks_R = np.diff(row_first_chunk_R1)
    used_R = np.add.reduceat(pairs_C, row_first_chunk_R1[:-1])
    return int(np.max(chunks_R + (used_R < seq_len)))


def empty_row(seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    return {
        "inputs": np.full(seq_len, pad_id, np.int32),
        "targets": np.full(seq_len, pad_id, np.int32),
        "segment_ids": np.zeros(seq_len, np.int32),
        "positions": np.zeros(seq_len, np.int32),
    }


def _place(row: dict[str, np.ndarray], chunk: np.ndarray, col: int, seg: int) -> None:
    n = len(chunk) - 1
    row["inputs"][col:col + n] = chunk[:-1]
    row["targets"][col:col + n] = chunk[1:]
    row["segment_ids"][col:col + n] = seg
    row["positions"][col:col + n] = np.arange(n, dtype=np.int32)


def pack_chunks(chunks: Sequence[np.ndarray], seq_len: int, pad_id: int) -> PackedRows:
    """Pack in-memory chunks (2 to seq_len+1 tokens each) into a materialised :class:`PackedRows`,
    first-fit in order: :class:`PackedRowSource` over documents that are one chunk each."""
    lengths_N = np.asarray([len(c) for c in chunks], np.int64)
    return PackedRowSource(list(chunks), np.arange(len(chunks)), lengths_N, seq_len, pad_id).materialise()


class PackedRowSource:
    """Random-access packed rows over a random-access source of token documents (grain source).

    ``documents[i]`` -> int32 token array; ``doc_order_N`` is the order documents are packed in
    (a seeded shuffle, or a held-out subset) and ``lengths_N`` their lengths in that order.
    """

    def __init__(self, documents, doc_order_N: np.ndarray, lengths_N: np.ndarray, seq_len: int, pad_id: int):
        self.documents = documents
        self.seq_len = seq_len
        self.pad_id = pad_id
        lengths_N = np.asarray(lengths_N, np.int64)
        # Chunks per document: one every T tokens while at least one pair remains (chunk_document).
        n_chunks_N = np.maximum((lengths_N - 1 + seq_len - 1) // seq_len, 0)
        self.chunk_doc_C = np.repeat(np.asarray(doc_order_N, np.int64), n_chunks_N)
        first_chunk_N = np.cumsum(n_chunks_N) - n_chunks_N
        k_C = np.arange(len(self.chunk_doc_C)) - np.repeat(first_chunk_N, n_chunks_N)
        self.chunk_start_C = k_C * seq_len
        pairs_C = np.minimum(seq_len, np.repeat(lengths_N, n_chunks_N) - 1 - self.chunk_start_C)
        self.chunk_len_C = pairs_C + 1
        row_C, self.chunk_col_C, self.chunk_seg_C = first_fit_layout(pairs_C, seq_len)
        self.num_rows = int(row_C[-1]) + 1 if len(row_C) else 0
        # Chunks of a row are consecutive (first-fit in order), so a row is a range of chunks.
        self.row_first_chunk_R1 = np.searchsorted(row_C, np.arange(self.num_rows + 1))
        self.num_tokens = int(pairs_C.sum())
        self.max_runs_per_row = _max_runs_per_row(pairs_C, self.row_first_chunk_R1, seq_len)

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        row = empty_row(self.seq_len, self.pad_id)
        for c in range(self.row_first_chunk_R1[index], self.row_first_chunk_R1[index + 1]):
            start = int(self.chunk_start_C[c])
            # A whole record is read for one chunk: ArrayRecord has no partial reads, and most
            # documents are a chunk or two long.
            chunk = self.documents[int(self.chunk_doc_C[c])][start:start + int(self.chunk_len_C[c])]
            _place(row, chunk, int(self.chunk_col_C[c]), int(self.chunk_seg_C[c]))
        return row

    def materialise(self) -> PackedRows:
        rows = [self[r] for r in range(self.num_rows)]
        return PackedRows(*(np.stack([r[k] for r in rows]) if rows else np.zeros((0, self.seq_len), np.int32)
                            for k in ("inputs", "targets", "segment_ids", "positions")))


class EmptyRows:
    """``n`` padding rows (segment 0, so loss_mask 0): fills the last eval batch to a full global batch."""

    def __init__(self, n: int, seq_len: int, pad_id: int):
        self.n, self.seq_len, self.pad_id = n, seq_len, pad_id

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return empty_row(self.seq_len, self.pad_id)
