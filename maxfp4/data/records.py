"""Pre-tokenized ArrayRecord shards: the on-disk format ``prepare`` writes and ``array_record`` reads.

A prepared directory holds::

    manifest.json                     what is in it (below), written last: its presence means complete
    tokenizer.model                   the SentencePiece model the ids come from
    shard-00000.array_record          one record per document: its token ids, little-endian int32
    shard-00000.lengths               the token count of each record, little-endian int32

Records are raw ``<i4`` bytes (read back with ``np.frombuffer``), never pickles: loading data must
not execute code. The ``.lengths`` sidecar lets the packer lay out rows from document lengths alone,
so a process reads only the documents of its own rows instead of every shard at start-up.

``manifest.json``: ``{"format": 1, "source": ..., "vocab_size": V, "tokenizer_sha256": ...,
"num_documents": N, "num_tokens": N_tok, "shards": [{"name", "num_documents", "num_tokens"}, ...]}``.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Sequence

import numpy as np

from maxfp4.errors import DataError
from maxfp4.files import atomic_file, atomic_path

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.model"
FORMAT_VERSION = 1
TOKEN_DTYPE = np.dtype("<i4")
# group_size:1 puts each record in its own chunk, so a random read decodes one document, not 65536.
WRITER_OPTIONS = "group_size:1"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.array_record"


def lengths_name(shard: str) -> str:
    return shard.removesuffix(".array_record") + ".lengths"


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_shard(directory: str, name: str, token_docs: Sequence[np.ndarray]) -> dict:
    """Write one shard and its lengths; temporary names + rename, so a crash never leaves a
    shard that looks complete (``prepare`` resumes by keeping the complete ones)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    lengths = np.asarray([len(d) for d in token_docs], TOKEN_DTYPE)
    with atomic_path(os.path.join(directory, name)) as tmp:  # the shard last: its presence marks the pair complete
        writer = ArrayRecordWriter(tmp, WRITER_OPTIONS)
        try:
            for ids in token_docs:
                writer.write(np.asarray(ids, TOKEN_DTYPE).tobytes())
        finally:
            writer.close()
        with atomic_path(os.path.join(directory, lengths_name(name))) as lengths_tmp:
            lengths.tofile(lengths_tmp)
    return {"name": name, "num_documents": len(token_docs), "num_tokens": int(lengths.sum())}


def write_manifest(directory: str, manifest: dict) -> None:
    with atomic_file(os.path.join(directory, MANIFEST)) as fh:
        json.dump(manifest, fh, indent=1)


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        raise DataError(f"data.paths: {directory} has no {MANIFEST}; expected a directory written by "
                        "python -m maxfp4.data.prepare (an interrupted prepare leaves none: rerun it)") from None
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"data.paths: cannot read {path}: {e or type(e).__name__}") from None
    keys = ("format", "vocab_size", "tokenizer_sha256", "shards")
    if not isinstance(manifest, dict) or any(k not in manifest for k in keys):
        raise DataError(f"data.paths: {path} is not a prepare manifest (expected keys {', '.join(keys)})")
    if manifest["format"] != FORMAT_VERSION:
        raise DataError(f"data.paths: {path} has format {manifest['format']}; this version reads "
                        f"format {FORMAT_VERSION}: rerun prepare")
    return manifest


class TokenShards:
    """Random access to the token documents of prepared directories (a grain data source).

    ``lengths_N`` is the token count of each document, read from the sidecars at start-up so
    packing needs no document; ``__getitem__`` reads one record through grain's ArrayRecord source.
    """

    def __init__(self, paths: Sequence[str], lengths_N: np.ndarray, shard_sizes: Sequence[int] | None = None):
        self.paths = tuple(paths)
        self.lengths_N = lengths_N
        # first document index of each shard, to name the file a bad record lives in
        self.shard_starts = np.cumsum([0, *(shard_sizes or [len(lengths_N)])])[:-1]
        self._source = None

    def __len__(self) -> int:
        return len(self.lengths_N)

    def shard_of(self, index: int) -> tuple[str, int]:
        """(shard path, record number in it) of document ``index``."""
        shard = int(np.searchsorted(self.shard_starts, index, side="right")) - 1
        return self.paths[min(shard, len(self.paths) - 1)], index - int(self.shard_starts[shard])

    def __getitem__(self, index: int) -> np.ndarray:
        index = int(index)
        try:
            if self._source is None:
                import grain

                self._source = grain.sources.ArrayRecordDataSource(list(self.paths))
            raw = self._source[index]
        except Exception as e:  # riegeli reports a damaged chunk as one of several error types
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise self._corrupt(index, f"cannot be read ({reason})") from None
        if len(raw) != 4 * int(self.lengths_N[index]):  # the sidecar and the shard disagree
            raise self._corrupt(index, f"holds {len(raw)} bytes, expected {4 * int(self.lengths_N[index])}")
        return np.frombuffer(raw, TOKEN_DTYPE)

    def _corrupt(self, index: int, what: str) -> DataError:
        path, record = self.shard_of(index)
        return DataError(f"data.paths: ArrayRecord shard {path} is corrupt: record {record} {what}; "
                         "rerun prepare with --force")

    def __getstate__(self) -> dict:
        # grain pickles the dataset into its worker processes; an open reader does not travel,
        # so each worker opens the shards itself on first read.
        return dict(self.__dict__, _source=None)


def open_prepared(directories: Sequence[str]) -> tuple[TokenShards, str, dict]:
    """Check every shard of the prepared directories; return (shards, tokenizer path, manifest of the first).

    Each shard is opened once here so a truncated or corrupt file is reported, by name, before
    training starts rather than when its first record is read.
    """
    from array_record.python.array_record_module import ArrayRecordReader

    shard_paths: list[str] = []
    lengths: list[np.ndarray] = []
    first: dict | None = None
    for directory in directories:
        manifest = read_manifest(directory)
        if first is not None and manifest["tokenizer_sha256"] != first["tokenizer_sha256"]:
            raise DataError(f"data.paths: {directory} was prepared with a different tokenizer than "
                            f"{directories[0]}; prepare both with the same --tokenizer")
        first = first or dict(manifest, directory=directory)
        for shard in manifest["shards"]:
            path = os.path.join(directory, shard["name"])
            try:
                reader = ArrayRecordReader(path)
                count = reader.num_records()
                reader.close()
            except (OSError, RuntimeError, ValueError) as e:
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise DataError(f"data.paths: ArrayRecord shard {path} is missing or corrupt ({reason}); "
                                "rerun prepare with --force") from None
            lengths_path = os.path.join(directory, lengths_name(shard["name"]))
            try:
                lengths_N = np.fromfile(lengths_path, TOKEN_DTYPE)
            except OSError as e:
                raise DataError(f"data.paths: cannot read {lengths_path}: {e.strerror or e}") from None
            if not count == len(lengths_N) == shard["num_documents"]:
                raise DataError(f"data.paths: ArrayRecord shard {path} holds {count} records and "
                                f"{lengths_path} {len(lengths_N)} lengths, but the manifest says "
                                f"{shard['num_documents']}; the directory is corrupt: rerun prepare with --force")
            shard_paths.append(path)
            lengths.append(lengths_N)
    if first is None:
        raise DataError("data.paths=[]: expected at least one directory written by python -m maxfp4.data.prepare")
    lengths_N = np.concatenate(lengths) if lengths else np.zeros(0, TOKEN_DTYPE)
    if not len(lengths_N):
        raise DataError(f"data.paths: {', '.join(directories)} hold no documents; expected prepared data")
    tokenizer = os.path.join(first["directory"], TOKENIZER)
    return TokenShards(tuple(shard_paths), lengths_N, [len(n) for n in lengths]), tokenizer, first
