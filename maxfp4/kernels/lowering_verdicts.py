"""Whether a Mosaic GPU kernel lowers, remembered on disk beside JAX's compilation cache.

``ssd_mosaic.lowers`` checks a kernel by lowering it for CUDA before the step uses it, and the
step then lowers it again: Mosaic GPU lowers in Python (its layout inference most of it), ~1 s a
kernel. The checks took 17.0 of the 38.9 s that tracing and lowering mamba2-1p3b's FP8 step took
on 2 CPU cores (jax 0.11.2, lowered for CUDA). JAX's persistent cache spares a restarted run
XLA's compile, not jax's tracing and lowering: with the verdicts on disk a process whose cache
directory holds them skips the checks.

A verdict is keyed by jax's and jaxlib's versions, the kernel, its operands' shapes and dtypes,
its static arguments and the source of every module of ``maxfp4/kernels``: a change to any of
them checks anew. Nothing is stored without a cache directory (``run.compile_cache_dir``, which
the trainer hands to JAX); a directory that cannot be written only costs the next process the
checks.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import jax

from maxfp4.files import atomic_file

FOLDER = "maxfp4-mosaic-lowers"  # inside JAX's compilation cache directory


def directory() -> Path | None:
    """Where verdicts live: a folder of JAX's compilation cache directory (None: no cache)."""
    cache = jax.config.jax_compilation_cache_dir
    return Path(os.path.expanduser(cache)) / FOLDER if cache else None


@functools.lru_cache(maxsize=1)
def _kernels_source_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def verdict_name(kernel: str, key) -> str:
    """The file name of ``kernel``'s verdict at ``key`` (its operands and static arguments, as
    ``ssd_mosaic.lowers`` forms it) under this jax, jaxlib and kernel source."""
    import jaxlib
    text = repr((jax.__version__, jaxlib.__version__, kernel, key, _kernels_source_digest()))
    return hashlib.sha256(text.encode()).hexdigest() + ".json"


def recalled(name: str) -> dict | None:
    """The stored verdict ``{"lowers": bool, "why": str}``, or None (none stored, or unreadable)."""
    folder = directory()
    if folder is None:
        return None
    try:
        verdict = json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None
    return verdict if isinstance(verdict, dict) and isinstance(verdict.get("lowers"), bool) else None


def remember(name: str, lowers: bool, why: str = "") -> None:
    folder = directory()
    if folder is None:
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # unique: the processes of a job may store the same verdict at once (a shared cache)
        with atomic_file(str(folder / name), unique=True) as fh:
            fh.write(json.dumps({"lowers": lowers, "why": why}))
    except OSError:  # a cache: a read-only or full disk costs the next process the checks only
        pass
