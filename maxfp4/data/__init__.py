"""Data path: source -> tokenizer -> packed rows -> grain pipeline -> this process's share of each global batch.

``make_batches(cfg, run_dir, process_index=, process_count=)`` returns a :class:`BatchIterator`;
``make_eval_batches`` the held-out batches. See :mod:`maxfp4.data.pipeline` for the batch layout
and resume state, ``docs/DATA.md`` for sources and settings.
"""

from maxfp4.data.pipeline import BatchIterator, make_batches, make_eval_batches
from maxfp4.data.sources import load_documents
from maxfp4.data.tokenizer import Tokenizer, load_or_train_tokenizer

__all__ = ["BatchIterator", "Tokenizer", "load_documents", "load_or_train_tokenizer", "make_batches",
           "make_eval_batches"]
