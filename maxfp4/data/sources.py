"""Where documents come from: ``data.source`` -> a list of document strings.

``builtin`` is real English prose shipped inside CPython itself: the documentation topics of
``pydoc_data.topics`` -- the Python Language Reference sections that ``help("if")`` prints
(statements, operators, data model, built-in types), about 80 topics and ~465K characters on
Python 3.11. It needs no download, so a fresh checkout can pretrain a small model offline and
watch the loss fall on natural language rather than random tokens.

``text`` reads ``data.paths`` (files or globs), one document per file. ``jsonl`` reads one
document per line, the string ``data.jsonl_field`` of a JSON object. ``tfds`` reads a TensorFlow
Datasets dataset already on disk through ``tfds.data_source`` (no TensorFlow, no download).
``array_record`` holds token ids, not text (:mod:`maxfp4.data.records`); ``synthetic`` has no
documents (its random tokens are made in :mod:`maxfp4.data.pipeline`).
"""

from __future__ import annotations

import glob
import json
import os

from maxfp4.config import Config
from maxfp4.errors import DataError


TEXT_SOURCES = ("builtin", "text", "jsonl", "tfds")


def load_documents(cfg: Config) -> list[str]:
    """Return the documents of ``cfg.data.source`` in a fixed order (empty for synthetic)."""
    if cfg.data.source == "synthetic":
        return []
    return source_documents(cfg, cfg.data.source, cfg.data.paths)


def source_documents(cfg: Config, source: str, paths: tuple[str, ...] | list[str]) -> list[str]:
    """The text documents of one text source (``paths`` as in ``data.paths``)."""
    if source == "builtin":
        return builtin_documents()
    if source == "text":
        return text_documents(paths)
    if source == "jsonl":
        return jsonl_documents(paths, cfg.data.jsonl_field)
    if source == "tfds":
        return tfds_documents(cfg.data.tfds_name, cfg.data.tfds_split, cfg.data.tfds_data_dir, cfg.data.tfds_field)
    raise DataError(f"data.source={source!r}: expected one of {', '.join(TEXT_SOURCES)}")


def builtin_documents() -> list[str]:
    """One document per distinct pydoc topic text, in topic-name order so the corpus never varies."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise DataError(
            "data.source=builtin: this Python has no pydoc_data.topics module (some slim builds strip "
            "it); use data.source=text with data.paths, or data.source=synthetic"
        ) from None
    # dict.fromkeys keeps the first of identical topics ("if" and "else" share one text).
    docs = [doc for doc in dict.fromkeys(topics[name] for name in sorted(topics)) if doc.strip()]
    if not docs:
        raise DataError("data.source=builtin: pydoc_data.topics is empty in this Python; use data.source=text")
    return docs


def expand_paths(patterns: tuple[str, ...] | list[str]) -> list[str]:
    """Expand files and globs in the given order (each glob sorted), dropping repeats.

    A pattern that names no file is an error rather than a silent omission: a typo in one of
    several globs would otherwise train on a fraction of the intended data without notice.
    """
    files: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        if glob.has_magic(expanded):
            matches = [p for p in sorted(glob.glob(expanded, recursive=True)) if os.path.isfile(p)]
            if not matches:
                raise DataError(f"data.paths: glob {pattern!r} matches no files")
        elif os.path.isdir(expanded):
            raise DataError(f"data.paths: {pattern!r} is a directory; expected a file or a glob such as "
                            f"{os.path.join(pattern, '*.txt')!r}")
        elif os.path.isfile(expanded):
            matches = [expanded]
        else:
            raise DataError(f"data.paths: {pattern!r} does not exist; expected a text file or a glob")
        for path in matches:
            key = os.path.abspath(path)
            if key not in seen:
                seen.add(key)
                files.append(path)
    return files


def read_text_file(path: str) -> str:
    """The file as text, newlines as a text-mode read gives them (``\r\n`` and ``\r`` read
    as ``\n``); invalid UTF-8 is an error naming the file, line and byte."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except OSError as e:
        raise DataError(f"data.paths: cannot read {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:  # decoded whole, so e.start is the offset in the file
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"data.paths: {path} is not UTF-8 text (line {line}: undecodable byte "
                        f"0x{raw[e.start]:02x} at offset {e.start})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def text_documents(patterns: tuple[str, ...] | list[str]) -> list[str]:
    """One document per file; whitespace-only files are skipped (they carry nothing to learn)."""
    if not patterns:
        raise DataError("data.paths=[]: expected at least one file or glob for data.source=text")
    files = expand_paths(patterns)
    docs = [text for text in (read_text_file(p) for p in files) if text.strip()]
    if not docs:
        raise DataError(f"data.paths: all {len(files)} file(s) are empty ({', '.join(files[:3])}"
                        f"{', ...' if len(files) > 3 else ''}); expected text to train on")
    return docs


def read_jsonl_file(path: str, field: str) -> list[str]:
    """One document per non-blank line; a line that is not a JSON object with a string ``field``
    is an error naming the file and line (a silently skipped line hides a broken export)."""
    docs = []
    text = read_text_file(path)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"data.paths: {path}:{number}: not valid JSON ({e.msg})") from None
        except RecursionError:  # json's decoder recurses once per level of [ or {
            raise DataError(f"data.paths: {path}:{number}: JSON nested too deeply to read; expected one "
                            "object per line with a string field") from None
        if not isinstance(record, dict) or field not in record:
            raise DataError(f"data.paths: {path}:{number}: no field {field!r} (set data.jsonl_field to the "
                            f"field holding the text)")
        value = record[field]
        if not isinstance(value, str):
            raise DataError(f"data.paths: {path}:{number}: field {field!r} is {type(value).__name__}, "
                            "expected a string")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's \ud800 escapes decode to lone surrogates
            raise DataError(f"data.paths: {path}:{number}: field {field!r} holds a lone surrogate "
                            f"({value[e.start]!r} at character {e.start}); expected valid Unicode text") from None
        if value.strip():
            docs.append(value)
    return docs


def jsonl_documents(patterns: tuple[str, ...] | list[str], field: str) -> list[str]:
    if not patterns:
        raise DataError("data.paths=[]: expected at least one JSONL file or glob for data.source=jsonl")
    files = expand_paths(patterns)
    docs = [doc for path in files for doc in read_jsonl_file(path, field)]
    if not docs:
        raise DataError(f"data.paths: {', '.join(files[:3])}{', ...' if len(files) > 3 else ''} hold no "
                        f"non-empty {field!r} values; expected text to train on")
    return docs


def open_tfds(name: str, split: str, data_dir: str):
    """A TFDS dataset prepared under ``data_dir``, opened as a random-access source.

    ``tfds.data_source`` reads the dataset's ArrayRecord files directly: no TensorFlow, and no
    network as long as the dataset was prepared there before (``download=False`` makes a
    missing one an error instead of a download attempt).
    """
    if not name:
        raise DataError("data.source=tfds: expected data.tfds_name, e.g. data.tfds_name=my_dataset:1.0.0")
    try:
        import tensorflow_datasets as tfds
    except ImportError:
        raise DataError("data.source=tfds needs the tensorflow-datasets package: pip install "
                        "'maxfp4[tfds]' (or use python -m maxfp4.data.prepare on text/JSONL)") from None
    try:
        return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
    except Exception as e:  # tfds raises many types (AssertionError, DatasetNotFoundError, ...)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"data.tfds_name={name!r} (split {split!r}, data_dir {data_dir or 'default'!r}): "
                        f"cannot open the prepared dataset: {reason}") from None


def tfds_field(name: str, example: dict, index: int, field: str):
    """``example[field]``, or a one-line error naming the fields there are."""
    if field not in example:
        raise DataError(f"data.tfds_name={name!r}: example {index} has no field {field!r} "
                        f"(fields: {', '.join(sorted(example))}); set data.tfds_field")
    return example[field]


def tfds_documents(name: str, split: str, data_dir: str, field: str) -> list[str]:
    """The string ``field`` of each example of a TFDS dataset prepared under ``data_dir``."""
    source = open_tfds(name, split, data_dir)
    docs = []
    for i in range(len(source)):
        value = tfds_field(name, source[i], i, field)
        try:
            value = value.decode("utf-8") if isinstance(value, bytes) else str(value)
        except UnicodeDecodeError as e:
            raise DataError(f"data.tfds_name={name!r}: example {i} field {field!r} is not UTF-8 text "
                            f"(undecodable byte at offset {e.start})") from None
        if value.strip():
            docs.append(value)
    if not docs:
        raise DataError(f"data.tfds_name={name!r} split {split!r}: no non-empty {field!r} values")
    return docs
