"""``cfg.data`` -> a tokenizer and token documents, split into training and held-out parts.

A corpus has one part per source (a mixture has several). Each part is a random-access sequence
of int32 token documents plus their lengths: an in-memory list for text sources (tokenized when
the run starts), or :class:`~maxfp4.data.records.TokenShards` for prepared ArrayRecord data (read
on demand). Everything here is a pure function of the config and the files, so every process
computes the same corpus, split and order without talking to the others.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from maxfp4.config import Config
from maxfp4.data.holdout import hold_out_sequences, too_few_documents
from maxfp4.data.records import MANIFEST, open_prepared, sha256_of
from maxfp4.data.sources import source_documents
from maxfp4.data.tokenizer import Tokenizer, load_checked, load_or_train_tokenizer
from maxfp4.errors import DataError

STREAM_DOCUMENTS, STREAM_EPOCH, STREAM_SYNTHETIC, STREAM_EVAL_SPLIT, STREAM_MIXTURE = 0, 1, 2, 3, 4


def rng(seed: int, stream: int, *counters: int) -> np.random.Generator:
    # SeedSequence wants non-negative entropy; masking maps a negative run.seed to a distinct one.
    return np.random.default_rng([seed & 0xFFFF_FFFF_FFFF_FFFF, stream, *counters])


def grain_seed(seed: int, stream: int, *counters: int) -> int:
    """A seed in [0, 2**32) for grain's shuffle, derived like :func:`rng` (grain rejects others)."""
    return int(rng(seed, stream, *counters).integers(0, 2**32))


@dataclass(frozen=True)
class Part:
    """Token documents of one source: ``documents[i]`` -> int32 ids, ``lengths_N[i]`` its length."""

    name: str
    documents: Any
    lengths_N: np.ndarray
    weight: float = 1.0
    held_N: np.ndarray | None = None  # held-out documents fixed by the data (maxfp4.data.holdout), else drawn


def tokenize_documents(documents: Sequence[str], tokenizer: Tokenizer) -> list[np.ndarray]:
    """``[bos] + encode(doc) + [eos]`` per document (a marker the tokenizer lacks is left out)."""
    head = [tokenizer.bos_id] if tokenizer.bos_id >= 0 else []
    tail = [tokenizer.eos_id] if tokenizer.eos_id >= 0 else []
    return [np.asarray(head + ids + tail, np.int32) for ids in tokenizer.encode_batch(documents)]


def _text_part(name: str, docs: list[str], tokenizer: Tokenizer, weight: float = 1.0) -> Part:
    token_docs = tokenize_documents(docs, tokenizer)
    return Part(name, token_docs, np.asarray([len(d) for d in token_docs], np.int64), weight)


def prepared_directories(patterns: Sequence[str]) -> list[str]:
    """``data.paths`` of array_record: directories (or their manifest.json), globs allowed."""
    if not patterns:
        raise DataError("data.paths=[]: expected at least one directory written by python -m maxfp4.data.prepare")
    out: list[str] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        matches = sorted(glob.glob(expanded)) if glob.has_magic(expanded) else [expanded]
        if not matches:
            raise DataError(f"data.paths: glob {pattern!r} matches no directories")
        for path in matches:
            path = os.path.dirname(path) or "." if os.path.basename(path) == MANIFEST else path
            if not os.path.isdir(path):
                raise DataError(f"data.paths: {path} does not exist or is not a directory; expected a directory "
                                "written by python -m maxfp4.data.prepare")
            out.append(path)
    return out


def _prepared_part(cfg: Config, name: str, paths: Sequence[str], weight: float = 1.0) -> tuple[Part, str, str]:
    shards, tokenizer_path, manifest = open_prepared(prepared_directories(paths))
    return Part(name, shards, shards.lengths_N.astype(np.int64), weight), tokenizer_path, manifest["tokenizer_sha256"]


def _prepared_tokenizer(cfg: Config, tokenizer_path: str, sha: str, where: str) -> Tokenizer:
    """The tokenizer the shards were made with: data.tokenizer if set (it must be that very model)."""
    path = cfg.data.tokenizer or tokenizer_path
    if not os.path.isfile(path):
        raise DataError(f"data.paths: {where} has no {os.path.basename(path)}; set data.tokenizer to the model "
                        "the data was prepared with")
    if sha256_of(path) != sha:
        raise DataError(f"tokenizer {path} is not the one {where} was prepared with (sha256 differs from "
                        "its manifest); its token ids would mean other pieces")
    return load_checked(path, cfg.model.vocab_size, "data.tokenizer" if cfg.data.tokenizer else "prepared tokenizer")


def load_corpus(cfg: Config, run_dir: str) -> tuple[Tokenizer, list[Part]]:
    """The training corpus of ``cfg.data`` (before any held-out split) and its tokenizer."""
    d = cfg.data
    specs = ([(p["source"], tuple(p.get("paths", ())), float(p.get("weight", 1.0))) for p in d.mixture]
             if d.source == "mixture" else [(d.source, d.paths, 1.0)])
    prepared = {}
    for i, (source, paths, weight) in enumerate(specs):
        if source == "array_record":
            prepared[i] = _prepared_part(cfg, f"{i}:{source}", paths, weight)
    texts = {i: source_documents(cfg, source, paths)
             for i, (source, paths, _) in enumerate(specs) if source != "array_record"}
    if prepared:
        first = next(iter(prepared.values()))
        for part, _, sha in prepared.values():
            if sha != first[2]:
                raise DataError("data.mixture: its array_record parts were prepared with different tokenizers; "
                                "prepare them with the same --tokenizer")
        tokenizer = _prepared_tokenizer(cfg, first[1], first[2], ", ".join(specs[next(iter(prepared))][1]))
    else:
        tokenizer = load_or_train_tokenizer(cfg, [doc for docs in texts.values() for doc in docs], run_dir)
    parts = [prepared[i][0] if i in prepared else _text_part(f"{i}:{specs[i][0]}", texts[i], tokenizer, specs[i][2])
             for i in range(len(specs))]
    # A part with too few documents for the fraction (one text file) holds out whole sequences.
    parts = [hold_out_sequences(part, d.eval_fraction, cfg.run.seed, i, d.seq_len, rng)
             if too_few_documents(len(part.lengths_N), d.eval_fraction) else part for i, part in enumerate(parts)]
    return tokenizer, parts


def load_eval_paths(cfg: Config, tokenizer: Tokenizer) -> Part:
    """``data.eval_paths``: held-out data of the training source, in the training tokenizer's ids."""
    if cfg.data.source == "array_record":
        part, _, sha = _prepared_part(cfg, "eval", cfg.data.eval_paths)
        if sha != sha256_of(tokenizer.path):
            raise DataError(f"data.eval_paths: {', '.join(cfg.data.eval_paths)} was prepared with another "
                            "tokenizer than the training data")
        return part
    return _text_part("eval", source_documents(cfg, cfg.data.source, cfg.data.eval_paths), tokenizer)


def split_documents(part: Part, fraction: float, seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) document indices: a seeded choice of round(fraction x N) documents, at
    least one when fraction > 0; both sorted, so the split is a function of the data and seed only.
    A part cut by :func:`maxfp4.data.holdout.hold_out_sequences` names its held-out documents."""
    n = len(part.lengths_N)
    if part.held_N is not None:
        keep = np.ones(n, bool)
        keep[part.held_N] = False
        return np.flatnonzero(keep).astype(np.int64), part.held_N
    n_eval = max(1, round(fraction * n)) if fraction > 0 else 0
    if fraction > 0 and n_eval >= n:
        raise DataError(f"data.eval_fraction={fraction}: the data ({part.name}) has {n} document(s), too few "
                        "to hold some out and still train; add data or use data.eval_paths")
    held_N = np.sort(rng(seed, STREAM_EVAL_SPLIT, index).choice(n, n_eval, replace=False)).astype(np.int64)
    keep = np.ones(n, bool)
    keep[held_N] = False
    return np.flatnonzero(keep).astype(np.int64), held_N
