"""Files replaced whole: a crash, signal or full disk while writing leaves the previous file (or
none), never half of a new one. Written here once because the standard library has no atomic
replace-on-close, and every writer of run files, checkpoints' side files, exports and prepared
data needs the same three steps: write a temporary beside the target, then ``os.replace`` it
(atomic within a file system), or remove it if anything went wrong."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Iterator


@contextlib.contextmanager
def atomic_path(path: str, *, file_mode: int | None = None, unique: bool = False) -> Iterator[str]:
    """Yield a temporary path beside ``path`` for the caller to write; on a clean exit it replaces
    ``path`` (its permissions set to ``file_mode`` first, if given), on an error it is removed.
    ``unique``: a fresh name per call, for targets that several processes may write at once."""
    if unique:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=os.path.basename(path) + ".",
                                   suffix=".tmp")
        os.close(fd)
    else:
        tmp = f"{path}.tmp"
    try:
        yield tmp
        if file_mode is not None:
            os.chmod(tmp, file_mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def atomic_file(path: str, mode: str = "w", *, fsync: bool = False, unique: bool = False,
                file_mode: int | None = None) -> Iterator[IO]:
    """``open(path, mode)`` that replaces ``path`` only once the ``with`` block ends cleanly
    (``fsync``: the bytes reach the disk before the rename; ``file_mode`` as for atomic_path)."""
    with atomic_path(path, unique=unique, file_mode=file_mode) as tmp:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())


def write_text_atomic(path: str, text: str, *, file_mode: int | None = None) -> None:
    with atomic_file(path, file_mode=file_mode) as fh:
        fh.write(text)
