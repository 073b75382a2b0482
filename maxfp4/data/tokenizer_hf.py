"""A run's tokenizer as Hugging Face tokenizer files: ``tokenizer.json`` (the ``tokenizers``
library) and ``tokenizer_config.json``, so that ``AutoTokenizer.from_pretrained(DIR)`` encodes
text to the ids maxfp4's pipeline trains on: ``[bos] + pieces + [eos]``.

A SentencePiece BPE model converts exactly as Llama's did: the same vocabulary (ids kept), a
merge for every split of every normal piece into two normal pieces, ranked by the merged piece's
score (SentencePiece merges the highest-scoring pair first; a ranked BPE merges the lowest
rank first), byte fallback, and SentencePiece's dummy prefix as a normalizer. The
pipeline's BOS/EOS become the post-processor's template, and the tokenizer class is the generic
``PreTrainedTokenizerFast`` so transformers uses the file as written (a class such as
``LlamaTokenizerFast`` rebuilds parts of it from its own flags).

Known difference: a document containing a marker's text literally (``<s>``) encodes to the
marker's id here (transformers matches special tokens in text) and to pieces in SentencePiece.
"""

from __future__ import annotations

import json
from typing import Callable

from maxfp4.data.tokenizer import Tokenizer
from maxfp4.errors import DataError

DUMMY = "\u2581"  # SentencePiece's visible space
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def sentencepiece_json(path: str) -> str:
    """The tokenizer.json of the SentencePiece BPE model at ``path``."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Tokenizer as JsonTokenizer, decoders, models, normalizers

    sp = spm.SentencePieceProcessor(model_file=path)
    n = sp.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    special = [i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)]
    normal = {sp.id_to_piece(i) for i in range(n) if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i)
                                                          or sp.is_unused(i))}
    if sp.decode(sp.encode("a  b")) != "a  b" or sp.decode(sp.encode("\ufb01")) != "\ufb01":
        raise DataError(f"tokenizer {path}: collapses whitespace or normalizes Unicode; only SentencePiece "
                        "models with identity normalization convert to tokenizer.json here")
    dummy_prefix = sp.encode("a", out_type=str)[0].startswith(DUMMY)
    merges = []
    for piece in normal:
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                merges.append((-sp.get_score(vocab[piece]), vocab[piece], vocab[left], vocab[right], left, right))
    merges.sort()
    unk = sp.id_to_piece(sp.unk_id()) if sp.unk_id() >= 0 else None
    tok = JsonTokenizer(models.BPE(vocab=vocab, merges=[(m[4], m[5]) for m in merges], unk_token=unk,
                                   fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend(DUMMY)] if dummy_prefix else []
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", DUMMY)])
    tok.decoder = decoders.Sequence([decoders.Replace(DUMMY, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if dummy_prefix else []))
    tok.add_special_tokens([AddedToken(sp.id_to_piece(i), special=True, normalized=False) for i in special])
    return tok.to_str()


def with_markers(tokenizer_json: str, bos: str | None, eos: str | None, ids: dict[str, int]) -> str:
    """``tokenizer_json`` whose post-processor adds ``bos`` and ``eos`` around every text (after
    any post-processor it had that is not a template of its own markers, e.g. byte-level offsets)."""
    from tokenizers import Tokenizer as JsonTokenizer, processors

    tok = JsonTokenizer.from_str(tokenizer_json)
    head = [bos] if bos else []
    tail = [eos] if eos else []
    single = " ".join(head + ["$A"] + tail)
    pair = " ".join(head + ["$A"] + tail + head + ["$B:1"] + tail)
    template = processors.TemplateProcessing(single=single, pair=pair,
                                             special_tokens=[(t, ids[t]) for t in dict.fromkeys(head + tail)])
    old = json.loads(tokenizer_json).get("post_processor")
    if old is None or old.get("type") == "TemplateProcessing":
        tok.post_processor = template
    else:
        tok.post_processor = processors.Sequence([tok.post_processor, template])
    return tok.to_str()


def hf_tokenizer_files(tokenizer: Tokenizer, *, max_length: int,
                       config_beside: dict | None = None) -> dict[str, str]:
    """{file name: text} of the Hugging Face tokenizer files for ``tokenizer``.
    ``config_beside``: a tokenizer_config.json that came with a tokenizer.json (kept, with
    the markers and class set here)."""
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise DataError("the Hugging Face export writes tokenizer.json with the tokenizers package "
                        "(pip install tokenizers)") from None
    if tokenizer.kind == "sentencepiece":
        source = sentencepiece_json(tokenizer.path)
    else:
        with open(tokenizer.path, encoding="utf-8") as fh:
            source = fh.read()
    from tokenizers import Tokenizer as JsonTokenizer

    plain = JsonTokenizer.from_str(source)

    def token(i: int) -> str | None:
        return plain.id_to_token(i) if i >= 0 else None

    bos, eos, pad = token(tokenizer.bos_id), token(tokenizer.eos_id), token(tokenizer.pad_id)
    ids = {t: plain.token_to_id(t) for t in (bos, eos) if t}
    config = dict(config_beside or {})
    config.update({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                   "clean_up_tokenization_spaces": False,
                   # What the post-processor does, for readers that look at the flags.
                   "add_bos_token": bos is not None, "add_eos_token": eos is not None})
    markers = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    if tokenizer.kind == "sentencepiece" and token(_unk_id(tokenizer)):
        markers["unk_token"] = token(_unk_id(tokenizer))
    markers = {k: v for k, v in markers.items() if v is not None}
    config.update(markers)
    return {"tokenizer.json": with_markers(source, bos, eos, ids),
            "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False) + "\n",
            "special_tokens_map.json": json.dumps(markers, indent=2, ensure_ascii=False) + "\n"}


def _unk_id(tokenizer: Tokenizer) -> int:
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=tokenizer.path).unk_id()


def write_hf_tokenizer(tokenizer: Tokenizer, out: str, write: Callable[[str, str], None], *,
                       max_length: int) -> list[str]:
    """Write the files into ``out`` through ``write(path, text)``; returns their names."""
    import os

    beside = os.path.join(os.path.dirname(os.path.abspath(tokenizer.path)), "tokenizer_config.json")
    config = None
    if tokenizer.kind == "tokenizers" and os.path.isfile(beside):
        with open(beside, encoding="utf-8") as fh:
            config = json.load(fh)
    files = hf_tokenizer_files(tokenizer, max_length=max_length, config_beside=config)
    for name, text in files.items():
        write(os.path.join(out, name), text)
    return list(files)
