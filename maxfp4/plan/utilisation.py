"""A measured utilisation read from a results file (``python -m maxfp4.plan --mfu-from``)."""

from __future__ import annotations

import json
from typing import Any

from maxfp4.errors import UserError
from maxfp4.metrics import DEVICE_PEAKS_TFLOPS


def read_utilisation(path: str, gpu: str) -> float:
    """Utilisation from a results file: the last record with ``mfu``, or ``tflops_per_device``
    over the BF16 peak; a JSON document, a JSON list, or JSON lines (metrics.jsonl)."""
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise UserError(f"--mfu-from {path}: {e.strerror}") from None
    try:
        records = [json.loads(text)]
    except json.JSONDecodeError:
        try:
            records = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError:
            raise UserError(f"--mfu-from {path}: not JSON or JSON lines") from None
    found = _find_fields(records)
    if found is None:
        raise UserError(f"--mfu-from {path}: no 'mfu' or 'tflops_per_device' field")
    key, value = found
    u = value if key == "mfu" else value / DEVICE_PEAKS_TFLOPS[gpu.upper()]["bf16"]
    if not 0 < u <= 1:
        raise UserError(f"--mfu-from {path}: utilisation {u:.3f} from {key!r} is not in (0, 1]")
    return u


def _find_fields(node: Any) -> tuple[str, float] | None:
    """The last numeric ``mfu`` (preferred) or ``tflops_per_device`` found depth-first."""
    found = None
    if isinstance(node, list):
        for item in node:
            found = _find_fields(item) or found
    elif isinstance(node, dict):
        for key in ("mfu", "tflops_per_device"):
            if isinstance(node.get(key), (int, float)) and not isinstance(node.get(key), bool):
                return key, float(node[key])
        for value in node.values():
            found = _find_fields(value) or found
    return found
