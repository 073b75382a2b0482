"""``python -m maxfp4.data.prepare``: text/JSONL files or a TFDS dataset -> tokenizer + ArrayRecord shards.

    python -m maxfp4.data.prepare --source jsonl --paths 'data/*.jsonl' --out prepared/ --vocab-size 32000
    python -m maxfp4.data.prepare --source text --paths a.txt b.txt --out prepared/ --tokenizer tok.model

Writes ``<out>/{tokenizer.model, shard-NNNNN.array_record, shard-NNNNN.lengths, manifest.json}``
(format in :mod:`maxfp4.data.records`); train on it with ``data.source=array_record
data.paths=[<out>]``. Documents keep their input order and go to shards in consecutive runs of
``--docs-per-shard``. Resumable: shards already complete (renamed into place) are kept and only
the rest are tokenized and written; the manifest is written last. An existing output directory
is refused unless it is an unfinished run of the same command or ``--force`` is given.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Sequence

import numpy as np

from maxfp4.config import load_config
from maxfp4.data import records
from maxfp4.data.corpus import tokenize_documents
from maxfp4.data.sources import source_documents
from maxfp4.data.tokenizer import Tokenizer, load_checked, train_tokenizer_bytes
from maxfp4.errors import DataError, exit_code_of
from maxfp4.files import atomic_path

DEFAULT_VOCAB_SIZE = 4096  # of a tokenizer trained here when --vocab-size is not given
_REQUEST = "prepare_request.json"  # the arguments of an unfinished run, to recognise a resume


class Progress:
    """A one-line progress bar on stderr, redrawn in place (no dependency; quiet when not a TTY
    except for the final line, so logs stay short)."""

    def __init__(self, total: int, label: str, stream=sys.stderr):
        self.total, self.label, self.stream = total, label, stream
        self.start = time.perf_counter()
        self.tty = getattr(stream, "isatty", lambda: False)()

    def update(self, done: int) -> None:
        if self.tty or done == self.total:
            width = 30
            filled = width * done // max(self.total, 1)
            rate = done / max(time.perf_counter() - self.start, 1e-9)
            end = "\n" if done == self.total else ""
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                              f"({rate:.1f}/s){end}")
            self.stream.flush()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m maxfp4.data.prepare",
                                description="Tokenize text, JSONL or a TFDS dataset into ArrayRecord shards.")
    p.add_argument("--source", choices=("text", "jsonl", "tfds", "builtin"), required=True)
    p.add_argument("--paths", nargs="*", default=[], help="files or globs (text: one document per file; "
                   "jsonl: one per line)")
    p.add_argument("--jsonl-field", default="text", help="jsonl: the key holding the text")
    p.add_argument("--tfds-name", default="", help="tfds: dataset name, e.g. my_dataset:1.0.0")
    p.add_argument("--tfds-split", default="train")
    p.add_argument("--tfds-data-dir", default="", help="tfds: where the dataset was prepared")
    p.add_argument("--tfds-field", default="text")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--tokenizer", default="", help="an existing SentencePiece model (default: train one)")
    p.add_argument("--vocab-size", type=int, default=0,
                   help="vocabulary of the trained tokenizer (or the check for --tokenizer); "
                   f"default {DEFAULT_VOCAB_SIZE}")
    p.add_argument("--docs-per-shard", type=int, default=10000)
    p.add_argument("--force", action="store_true", help="replace an existing output directory")
    return p.parse_args(argv)


def _request(args: argparse.Namespace) -> dict:
    return {k: v for k, v in sorted(vars(args).items()) if k != "force"}


def _claim_output(args: argparse.Namespace) -> bool:
    """Create or reuse ``--out``; True when resuming an unfinished run of the same request."""
    out = args.out
    if os.path.exists(out) and os.listdir(out):
        same = False
        try:
            with open(os.path.join(out, _REQUEST), encoding="utf-8") as fh:
                same = json.load(fh) == _request(args)
        except (OSError, ValueError):
            pass
        finished = os.path.exists(os.path.join(out, records.MANIFEST))
        if args.force:
            shutil.rmtree(out)
        elif same and not finished:
            return True
        else:
            raise DataError(f"--out {out} already exists and is not empty"
                            f"{' (a finished prepare)' if finished else ''}; use --force to replace it")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, _REQUEST), "w", encoding="utf-8") as fh:
        json.dump(_request(args), fh)
    return False


def prepare(args: argparse.Namespace, stream=sys.stderr) -> dict:
    """Run the preparation; returns the manifest."""
    if args.docs_per_shard < 1:
        raise DataError(f"--docs-per-shard={args.docs_per_shard}: expected a positive integer")
    if args.tokenizer and not os.path.isfile(args.tokenizer):
        raise DataError(f"--tokenizer {args.tokenizer}: no such file")
    cfg = load_config(None, [f"data.jsonl_field={json.dumps(args.jsonl_field)}",
                             f"data.tfds_name={json.dumps(args.tfds_name)}",
                             f"data.tfds_split={json.dumps(args.tfds_split)}",
                             f"data.tfds_data_dir={json.dumps(args.tfds_data_dir)}",
                             f"data.tfds_field={json.dumps(args.tfds_field)}"])
    # Read (and so validate) the input before touching the output directory.
    documents = source_documents(cfg, args.source, args.paths)
    resuming = _claim_output(args)
    out = args.out
    tok_path = os.path.join(out, records.TOKENIZER)
    # A given tokenizer is checked against --vocab-size only on request; a trained one always.
    want = args.vocab_size or (0 if args.tokenizer else DEFAULT_VOCAB_SIZE)
    if not (resuming and os.path.exists(tok_path)):
        with atomic_path(tok_path) as tmp:
            if args.tokenizer:
                shutil.copyfile(args.tokenizer, tmp)
            else:
                stream.write(f"training a {want}-piece tokenizer on {len(documents)} documents\n")
                with open(tmp, "wb") as fh:
                    fh.write(train_tokenizer_bytes(documents, want))
    tokenizer = load_checked(tok_path, want, "--tokenizer" if args.tokenizer else "tokenizer") if want \
        else Tokenizer(tok_path)

    n_shards = -(-len(documents) // args.docs_per_shard)
    shards = []
    bar = Progress(n_shards, f"writing {out}", stream)
    for s in range(n_shards):
        name = records.shard_name(s)
        docs = documents[s * args.docs_per_shard:(s + 1) * args.docs_per_shard]
        length_path = os.path.join(out, records.lengths_name(name))
        if os.path.exists(os.path.join(out, name)) and os.path.exists(length_path):
            lengths = np.fromfile(length_path, records.TOKEN_DTYPE)  # complete: keep it
            shards.append({"name": name, "num_documents": len(lengths), "num_tokens": int(lengths.sum())})
        else:
            shards.append(records.write_shard(out, name, tokenize_documents(docs, tokenizer)))
        bar.update(s + 1)
    manifest = {
        "format": records.FORMAT_VERSION,
        "source": {"kind": args.source, "paths": list(args.paths), "jsonl_field": args.jsonl_field,
                   "tfds_name": args.tfds_name, "tfds_split": args.tfds_split},
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_sha256": records.sha256_of(tok_path),
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards),
        "shards": shards,
    }
    records.write_manifest(out, manifest)
    os.unlink(os.path.join(out, _REQUEST))
    stream.write(f"{manifest['num_documents']} documents, {manifest['num_tokens']} tokens in {n_shards} shard(s) "
                 f"-> {out}\n")
    return manifest


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return exit_code_of(prepare, args)


if __name__ == "__main__":
    sys.exit(main())
