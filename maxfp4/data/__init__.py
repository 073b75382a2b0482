"""Data path: source -> tokenizer -> packed rows -> this process's share of each global batch.

``make_batches(cfg, run_dir, process_index=, process_count=)`` returns a :class:`BatchIterator`;
see :mod:`maxfp4.data.pipeline` for the batch layout and resume state.
"""

from maxfp4.data.pipeline import BatchIterator, make_batches
from maxfp4.data.sources import load_documents
from maxfp4.data.tokenizer import Tokenizer, load_or_train_tokenizer

__all__ = ["BatchIterator", "Tokenizer", "load_documents", "load_or_train_tokenizer", "make_batches"]
