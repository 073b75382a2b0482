"""SentencePiece tokenizer: load the user's, reuse the run's, or train one on the documents.

Training choices and why:
- BPE with byte fallback (the Llama/Mistral convention): any UTF-8 text encodes without
  ``<unk>`` and decodes back exactly, and SentencePiece's BPE trainer takes well under a second
  on the builtin corpus (unigram takes several times longer for the same vocabulary).
- ``identity`` normalization and no whitespace collapsing, so code indentation and Unicode in
  the documents survive an encode/decode round trip; newlines fall back to their byte piece.
- Determinism: no input shuffling and a fixed thread count. SentencePiece's BPE merges depend
  on how the input is split across threads, so the count is a constant rather than the CPU
  count: every machine and every process trains the same model from the same data.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from typing import Iterable, Sequence

import sentencepiece as spm

from maxfp4.config import Config
from maxfp4.errors import DataError

TOKENIZER_FILENAME = "tokenizer.model"
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
TRAIN_THREADS = 4
# SentencePiece skips training "sentences" longer than max_sentence_length (4192 bytes);
# slicing long lines to this many characters (<= 4 bytes each in UTF-8) keeps all the text.
_MAX_LINE_CHARS = 1024
# Cap on training lines; a larger corpus is subsampled evenly, which is plenty for a vocabulary.
_MAX_TRAIN_LINES = 2_000_000


class Tokenizer:
    """A loaded SentencePiece model. ``bos_id``/``eos_id``/``pad_id`` are -1 where absent."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"tokenizer {path}: not a readable SentencePiece model ({first})") from None

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def bos_id(self) -> int:
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        return self._sp.eos_id()

    @property
    def pad_id(self) -> int:
        return self._sp.pad_id()

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def load_checked(path: str, vocab_size: int, what: str) -> Tokenizer:
    """Load a tokenizer and refuse one whose vocabulary does not match the model's."""
    tok = Tokenizer(path)
    if tok.vocab_size != vocab_size:
        raise DataError(
            f"{what} {path} has vocab size {tok.vocab_size} but model.vocab_size={vocab_size}; "
            f"set model.vocab_size={tok.vocab_size} or use a matching tokenizer"
        )
    return tok


def load_or_train_tokenizer(cfg: Config, documents: Sequence[str], run_dir: str) -> Tokenizer:
    """``data.tokenizer`` if set, else ``<run_dir>/tokenizer.model`` if present, else train one.

    Training writes to a unique temporary name and renames it into place, so processes sharing
    a run directory that train at the same time each install an identical, complete file.
    """
    vocab_size = cfg.model.vocab_size
    if cfg.data.tokenizer:
        return load_checked(cfg.data.tokenizer, vocab_size, "data.tokenizer")
    path = os.path.join(run_dir, TOKENIZER_FILENAME)
    if os.path.exists(path):
        return load_checked(path, vocab_size, "run tokenizer")
    model = train_tokenizer_bytes(documents, vocab_size)
    os.makedirs(run_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=run_dir, prefix=TOKENIZER_FILENAME + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(model)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return load_checked(path, vocab_size, "run tokenizer")


def _training_lines(documents: Sequence[str]) -> list[str]:
    lines = [
        line[i:i + _MAX_LINE_CHARS]
        for doc in documents
        for line in doc.splitlines()
        if line.strip()
        for i in range(0, len(line), _MAX_LINE_CHARS)
    ]
    if len(lines) > _MAX_TRAIN_LINES:
        stride = -(-len(lines) // _MAX_TRAIN_LINES)
        lines = lines[::stride]
    return lines


def train_tokenizer_bytes(documents: Sequence[str], vocab_size: int) -> bytes:
    """Train a BPE model of exactly ``vocab_size`` pieces; return the serialized model."""
    lines = _training_lines(documents)
    if not lines:
        raise DataError("tokenizer training: the documents contain no text; set data.tokenizer or add data")
    out = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=out,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            pad_id=PAD_ID,
            unk_id=UNK_ID,
            bos_id=BOS_ID,
            eos_id=EOS_ID,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            shuffle_input_sentence=False,
            input_sentence_size=0,
            num_threads=TRAIN_THREADS,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise _training_error(str(e), vocab_size) from None
    return out.getvalue()


def _training_error(message: str, vocab_size: int) -> DataError:
    too_high = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", message)
    if too_high:
        limit = too_high.group(1)
        return DataError(
            f"tokenizer training: model.vocab_size={vocab_size} is too large for this data (at most {limit} "
            f"pieces can be learned from it); set model.vocab_size<={limit}, add data, or set data.tokenizer"
        )
    too_low = re.search(r"Vocabulary size is smaller than required_chars\. \d+ vs (\d+)", message)
    if too_low:
        need = too_low.group(1)
        return DataError(
            f"tokenizer training: model.vocab_size={vocab_size} is too small for this data (the 256 byte "
            f"pieces, 4 special tokens and the data's characters need {need}); set model.vocab_size>={need}"
        )
    last = message.strip().splitlines()[-1] if message.strip() else "unknown error"
    return DataError(f"tokenizer training failed for model.vocab_size={vocab_size}: {last}")
