"""A corpus nobody needs to download: the Python sources and text files of installed packages.

Every machine with Python has them (the GPU image holds torch, transformers and the rest), so the
convergence runs train and evaluate on the same text everywhere. Files are split into training and
held-out sets *by file*, by a hash of the path relative to its package root, so the split does not
depend on where the packages are installed or on the order they are found. Writes JSONL (one file a
line, ``{"text", "path"}``) ready for ``python -m maxfp4.data.prepare --source jsonl``:

    python benchmarks/gather_corpus.py --out corpus/ [--max-mb 600] [--heldout 0.005]
    # -> corpus/train.jsonl, corpus/heldout.jsonl, corpus/summary.json

The order of files is sorted by relative path, so two machines with the same packages write the
same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import site
import sys
import sysconfig

SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt")
MIN_BYTES, MAX_BYTES = 200, 1_000_000  # skip stubs and generated blobs


def package_roots() -> list[str]:
    """The interpreter's standard library and every site-packages directory, deduplicated."""
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    roots += site.getsitepackages() + [site.getusersitepackages()]
    seen, out = set(), []
    for r in roots:
        real = os.path.realpath(r)
        if os.path.isdir(real) and real not in seen:
            seen.add(real)
            out.append(real)
    return out


def candidate_files(roots: list[str]) -> list[tuple[str, str]]:
    """(relative path, absolute path) of every text file under the roots, sorted by relative path.
    A file reachable from two roots (the stdlib holds site-packages) is kept once."""
    found: dict[str, str] = {}
    real_seen: set[str] = set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            for name in filenames:
                if not name.endswith(SUFFIXES):
                    continue
                path = os.path.join(dirpath, name)
                real = os.path.realpath(path)
                if real in real_seen:
                    continue
                real_seen.add(real)
                found.setdefault(os.path.relpath(path, root), path)
    return sorted(found.items())


def is_heldout(rel_path: str, fraction: float) -> bool:
    digest = hashlib.sha256(rel_path.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def read_text(path: str) -> str | None:
    try:
        size = os.path.getsize(path)
        if not MIN_BYTES <= size <= MAX_BYTES:
            return None
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError):
        return None
    return text if "\x00" not in text else None


def gather(out_dir: str, max_mb: float, heldout: float) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    budget = int(max_mb * 1e6)
    counts = {"train": [0, 0], "heldout": [0, 0]}  # files, bytes
    with open(os.path.join(out_dir, "train.jsonl"), "w", encoding="utf-8") as train_fh, \
            open(os.path.join(out_dir, "heldout.jsonl"), "w", encoding="utf-8") as held_fh:
        for rel, path in candidate_files(package_roots()):
            if counts["train"][1] + counts["heldout"][1] >= budget:
                break
            text = read_text(path)
            if text is None:
                continue
            split = "heldout" if is_heldout(rel, heldout) else "train"
            (held_fh if split == "heldout" else train_fh).write(json.dumps({"text": text, "path": rel}) + "\n")
            counts[split][0] += 1
            counts[split][1] += len(text.encode("utf-8"))
    summary = {"python": sys.version.split()[0], "roots": package_roots(), "heldout_fraction": heldout,
               **{f"{k}_files": v[0] for k, v in counts.items()}, **{f"{k}_bytes": v[1] for k, v in counts.items()}}
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=1)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-mb", type=float, default=600.0, help="stop after this many MB of text")
    p.add_argument("--heldout", type=float, default=0.005, help="fraction of files held out")
    args = p.parse_args(argv)
    summary = gather(args.out, args.max_mb, args.heldout)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
