"""``model.init_from`` and ``data.seq_len``: a run that trains on longer sequences than the source
model was made for is said so before anything is written."""

from __future__ import annotations

import json
import os


def positions_warning(cfg) -> str | None:
    """The start-up warning when ``data.seq_len`` exceeds the source's ``max_position_embeddings``
    (None when it does not, or there is no source to read). Every model maxfp4 builds runs at any
    length (rotary positions, or none in a hybrid's attention), so it is a warning: what the
    source learned about positions stops at its length, and rotary angles beyond it were never seen."""
    if not cfg.model.init_from:
        return None
    try:
        with open(os.path.join(cfg.model.init_from, "config.json"), encoding="utf-8") as fh:
            source = json.load(fh)
    except (OSError, ValueError):
        return None  # check_init_from says what is wrong with the directory
    limit = source.get("max_position_embeddings")
    if not isinstance(limit, int) or cfg.data.seq_len <= limit:
        return None
    how = (f"rotary positions beyond {limit} were never trained (model.rope_theta={cfg.model.rope_theta:g})"
           if cfg.model.rope else "its attention has no position encoding; its layers learned only up to that length")
    return (f"warning: data.seq_len={cfg.data.seq_len} exceeds model.init_from's max_position_embeddings={limit}: {how}; "
            f"data.seq_len={limit} keeps to what the source model was trained on")
