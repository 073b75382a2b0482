"""SHA-256 of a checkpoint's array files (``checkpoint.verify``), each process hashing what it
wrote, so a restore can tell a flipped bit from good data.

Orbax's OCDBT layout: process ``i`` writes ``state/ocdbt.process_<i>/`` and
``state/array_metadatas/process_<i>``; process 0 also writes the tree's metadata and the merged
manifest at the top of ``state/``. Each process records its files, with their sizes and hashes,
in ``<step>/checksums.process_<i>.json`` (written under a temporary name, renamed). Orbax's
``commit_success.txt`` markers are not hashed (they hold a time stamp, no data).
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from maxfp4.files import atomic_file

UNVERIFIED = "unverified"  # the checkpoint has no checksum files
_CHUNK = 16 << 20  # hashlib releases the GIL on large buffers: the training loop keeps running
_OWNED = re.compile(r"^(ocdbt\.process_(\d+)|array_metadatas/process_(\d+))(/|$)")


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _writer_of(relpath: str) -> int:
    """The process that writes ``relpath`` (relative to ``state/``)."""
    m = _OWNED.match(relpath)
    return int(m.group(2) or m.group(3)) if m else 0


def files_written_by(step_dir: str, process: int) -> list[str]:
    state = os.path.join(step_dir, "state")
    out = []
    for root, _, names in os.walk(state):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), state)
            if name != "commit_success.txt" and _writer_of(rel) == process:
                out.append(os.path.join("state", rel))
    return sorted(out)


def checksum_path(step_dir: str, process: int) -> str:
    return os.path.join(step_dir, f"checksums.process_{process}.json")


def write(step_dir: str, process: int) -> str:
    """Hash the files ``process`` wrote into a committed checkpoint ``step_dir``."""
    files = {rel: {"bytes": os.path.getsize(os.path.join(step_dir, rel)),
                   "sha256": file_sha256(os.path.join(step_dir, rel))}
             for rel in files_written_by(step_dir, process)}
    path = checksum_path(step_dir, process)
    with atomic_file(path) as fh:
        json.dump({"process": process, "files": files}, fh, indent=0)
    return path


def verify(step_dir: str, process: int, process_count: int) -> str | None:
    """None if this process's share of the checksum files matches; UNVERIFIED if the
    checkpoint has none; else one line naming the first file that does not match."""
    names = sorted(n for n in os.listdir(step_dir) if re.fullmatch(r"checksums\.process_\d+\.json", n))
    if not names:
        return UNVERIFIED
    for name in names[process::process_count]:
        try:
            with open(os.path.join(step_dir, name), encoding="utf-8") as fh:
                files = json.load(fh)["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return f"{name}: unreadable ({e})"
        for rel, want in files.items():
            path = os.path.join(step_dir, rel)
            try:
                size = os.path.getsize(path)
                got = file_sha256(path) if size == want["bytes"] else None
            except OSError as e:
                return f"array file {rel}: {e.strerror or e} (checkpoint.verify)"
            if got != want["sha256"]:
                what = f"{size} bytes, expected {want['bytes']}" if got is None else "SHA-256 differs from the saved one"
                return f"array file {rel}: {what} (checkpoint.verify)"
    return None
