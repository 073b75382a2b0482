"""Tokenizers: load the user's (SentencePiece, or a Hugging Face tokenizer.json), reuse the run's,
or train a SentencePiece model on the documents.

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
from typing import Iterable, Sequence

import sentencepiece as spm

from maxfp4.config import Config
from maxfp4.errors import DataError
from maxfp4.files import atomic_file

TOKENIZER_FILENAME = "tokenizer.model"
PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
TRAIN_THREADS = 4
# SentencePiece skips training "sentences" longer than max_sentence_length (4192 bytes);
# slicing long lines to this many characters (<= 4 bytes each in UTF-8) keeps all the text.
_MAX_LINE_CHARS = 1024
# Cap on training lines; a larger corpus is subsampled evenly, which is plenty for a vocabulary.
_MAX_TRAIN_LINES = 2_000_000


class Tokenizer:
    """A loaded tokenizer: a SentencePiece model, or a Hugging Face ``tokenizer.json`` (the
    ``tokenizers`` library, e.g. Llama-3's), told apart by the file's content so that either
    works under any name (``prepare`` keeps its copy as ``tokenizer.model``). ``bos_id`` /
    ``eos_id`` / ``pad_id`` are -1 where absent; ``encode`` never adds them (the pipeline does)."""

    def __init__(self, path: str):
        self.path = path
        self._backend = _TokenizersJson(path) if _is_json(path) else _SentencePiece(path)

    @property
    def kind(self) -> str:
        """``sentencepiece`` or ``tokenizers``."""
        return self._backend.kind

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    @property
    def bos_id(self) -> int:
        return self._backend.bos_id

    @property
    def eos_id(self) -> int:
        return self._backend.eos_id

    @property
    def pad_id(self) -> int:
        return self._backend.pad_id

    def encode(self, text: str) -> list[int]:
        return self._backend.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._backend.encode_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        return self._backend.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({self.path!r}, vocab_size={self.vocab_size})"


def _is_json(path: str) -> bool:
    # A SentencePiece model is a protobuf, whose first byte is a field tag (never "{").
    try:
        with open(path, "rb") as fh:
            return fh.read(64).lstrip()[:1] == b"{"
    except OSError as e:
        raise DataError(f"tokenizer {path}: not readable ({e.strerror or e})") from None


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class _SentencePiece:
    kind = "sentencepiece"

    def __init__(self, path: str):
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"tokenizer {path}: not a readable SentencePiece model ({_first_line(e)})") from None
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id, self.eos_id, self.pad_id = self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


# Names of the markers in common tokenizer.json files, for one without a tokenizer_config.json.
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "[BOS]")
_EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[EOS]")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class _TokenizersJson:
    kind = "tokenizers"

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer as JsonTokenizer
        except ImportError:
            raise DataError(f"tokenizer {path}: a tokenizer.json needs the tokenizers package "
                            "(pip install tokenizers)") from None
        try:
            self.tok = JsonTokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions for bad files
            raise DataError(f"tokenizer {path}: not a readable tokenizer.json ({_first_line(e)})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id, self.pad_id = special_ids(self.tok, path)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def special_ids(tok, path: str) -> tuple[int, int, int]:
    """(bos, eos, pad) ids of a tokenizer.json: as the ``tokenizer_config.json`` beside it names
    them (Hugging Face's own record), else the first marker its post-processor adds (BOS), else
    the usual names; -1 where none is found."""
    import json

    named: dict[str, str] = {}
    config = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as fh:
                raw = json.load(fh)
        except (OSError, ValueError) as e:
            raise DataError(f"tokenizer {config}: not readable JSON ({e})") from None
        for key in ("bos", "eos", "pad"):
            value = raw.get(f"{key}_token")
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                named[key] = value
    if "bos" not in named:
        template = (json.loads(tok.to_str()).get("post_processor") or {}).get("single") or []
        first = template[0] if template else {}
        if "SpecialToken" in first:
            named["bos"] = first["SpecialToken"]["id"]

    def find(key: str, names: tuple[str, ...]) -> int:
        for name in ([named[key]] if key in named else list(names)):
            i = tok.token_to_id(name)
            if i is not None:
                return i
        return -1

    return find("bos", _BOS_NAMES), find("eos", _EOS_NAMES), find("pad", _PAD_NAMES)


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
    # Every process of a run may train it at once: each writes its own temporary (the bytes are
    # the same), and the last rename wins.
    with atomic_file(path, "wb", fsync=True, unique=True) as fh:
        fh.write(model)
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
