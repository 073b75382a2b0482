"""Where documents come from: ``data.source`` -> a list of document strings.

``builtin`` is real English prose shipped inside CPython itself: the documentation topics of
``pydoc_data.topics`` -- the Python Language Reference sections that ``help("if")`` prints
(statements, operators, data model, built-in types), about 80 topics and ~465K characters on
Python 3.11. It needs no download, so a fresh checkout can pretrain a small model offline and
watch the loss fall on natural language rather than random tokens.

``text`` reads ``data.paths`` (files or globs), one document per file. ``synthetic`` has no
documents; its random tokens are made in :mod:`maxfp4.data.pipeline`.
"""

from __future__ import annotations

import glob
import os

from maxfp4.config import Config
from maxfp4.errors import DataError


def load_documents(cfg: Config) -> list[str]:
    """Return the documents of ``cfg.data.source`` in a fixed order (empty for synthetic)."""
    source = cfg.data.source
    if source == "builtin":
        return builtin_documents()
    if source == "text":
        return text_documents(cfg.data.paths)
    if source == "synthetic":
        return []
    raise DataError(f"data.source={source!r}: expected one of builtin, text, synthetic")


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
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except UnicodeDecodeError as e:
        raise DataError(f"data.paths: {path} is not UTF-8 text (undecodable byte at offset {e.start})") from None
    except OSError as e:
        raise DataError(f"data.paths: cannot read {path}: {e.strerror or e}") from None


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
