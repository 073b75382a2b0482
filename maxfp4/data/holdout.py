"""Held-out data cut from the token stream, for a source with too few documents to hold some out.

One text file (a novel) is one document: a document split cannot hold out 2% of it. Then a
seeded ``data.eval_fraction`` of the stream's whole sequences (``data.seq_len + 1`` tokens,
one packed row each, aligned inside their document) is held out, and training keeps the runs
of tokens between them as its documents. A held-out window shares no token with training, so
no next-token pair is both trained on and evaluated.

Dimension letters: N documents, W aligned windows, S slices (training runs + held-out windows).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from maxfp4.errors import DataError

STREAM_EVAL_SEQUENCES = 6  # a seed stream of its own (maxfp4.data.corpus numbers the others)


def too_few_documents(n_documents: int, fraction: float) -> bool:
    """True when a document split cannot honour ``fraction``: it would hold out every document,
    or its one-document minimum would hold out more than twice the fraction asked for."""
    return fraction > 0 and (round(fraction * n_documents) == 0 or max(1, round(fraction * n_documents)) >= n_documents)


class StreamSlices:
    """Random-access documents ``documents[doc_S[i]][start_S[i]:stop_S[i]]`` (read on demand, so
    prepared shards stay on disk)."""

    def __init__(self, documents, doc_S: np.ndarray, start_S: np.ndarray, stop_S: np.ndarray):
        self.documents, self.doc_S, self.start_S, self.stop_S = documents, doc_S, start_S, stop_S

    def __len__(self) -> int:
        return len(self.doc_S)

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.documents[int(self.doc_S[i])])[int(self.start_S[i]):int(self.stop_S[i])]


def hold_out_sequences(part, fraction: float, seed: int, index: int, seq_len: int, rng):
    """``part`` re-cut into training runs and held-out windows, its ``held_N`` naming the windows:
    ``max(1, round(fraction x tokens / (seq_len + 1)))`` windows drawn with ``rng(seed, stream,
    index)`` from the aligned windows of every document."""
    width = seq_len + 1
    lengths_N = np.asarray(part.lengths_N, np.int64)
    windows_N = lengths_N // width
    n_windows = int(windows_N.sum())
    n_held = max(1, round(fraction * int(lengths_N.sum()) / width))
    if n_held >= n_windows:
        raise DataError(f"data.eval_fraction={fraction}: the data ({part.name}) has {int(lengths_N.sum())} tokens, "
                        f"{n_windows} sequence(s) of data.seq_len={seq_len}, too few to hold out {n_held} and still "
                        "train; add data, lower data.seq_len, or use data.eval_paths")
    held_W = np.sort(rng(seed, STREAM_EVAL_SEQUENCES, index).choice(n_windows, n_held, replace=False))
    first_window_N = np.concatenate([[0], np.cumsum(windows_N)[:-1]])
    doc_W = np.searchsorted(first_window_N, held_W, side="right") - 1
    start_W = (held_W - first_window_N[doc_W]) * width
    slices, held = [], []  # (doc, start, stop) in stream order; indices of the held-out ones
    for doc, length in enumerate(lengths_N.tolist()):
        cursor = 0
        for start in start_W[doc_W == doc].tolist():
            if start - cursor >= 2:  # a run of fewer than 2 tokens has no next-token pair
                slices.append((doc, cursor, start))
            held.append(len(slices))
            slices.append((doc, start, start + width))
            cursor = start + width
        if length - cursor >= 2:
            slices.append((doc, cursor, length))
    doc_S, start_S, stop_S = (np.asarray(column, np.int64) for column in zip(*slices))
    return dataclasses.replace(part, documents=StreamSlices(part.documents, doc_S, start_S, stop_S),
                               lengths_N=stop_S - start_S, held_N=np.asarray(held, np.int64))


def sequences_note(part, fraction: float, seq_len: int) -> str:
    """The start-up line of a part held out as sequences."""
    n, width = len(part.held_N), seq_len + 1
    documents = len(np.unique(part.documents.doc_S))
    source = part.name.split(":", 1)[-1]  # "0:text" -> "text"
    return (f"data.eval_fraction={fraction:g}: the {source} data has {documents} document(s), too few to hold some "
            f"out; holding out {n} seeded sequence(s) of {width} tokens instead ({n * width:,} of "
            f"{int(part.lengths_N.sum()):,} tokens), never overlapping training rows")
