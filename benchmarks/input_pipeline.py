"""Input pipeline throughput on CPU: tokens/s of the array_record grain pipeline.

    python benchmarks/input_pipeline.py --seq-len 2048 --global-batch 8 --batches 200 --json out.json

Builds ArrayRecord shards of synthetic token documents (lengths drawn around --doc-tokens, so
rows pack several documents and documents span rows) in a temporary directory, the same format
``python -m maxfp4.data.prepare`` writes, then times ``make_batches`` with data.source=array_record
for each data.workers value. Prints a table and writes JSON. Tokens/s counts all T x G positions
of a global batch (what the training step consumes), for one process reading all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxfp4.config import load_config  # noqa: E402
from maxfp4.data import make_batches, records  # noqa: E402
from maxfp4.data.tokenizer import train_tokenizer_bytes  # noqa: E402

VOCAB = 4096


def build_shards(directory: str, n_docs: int, doc_tokens: int, docs_per_shard: int, seed: int) -> dict:
    """Synthetic documents in the prepare layout (tokenizer from a little builtin text, for its vocabulary)."""
    from maxfp4.data.sources import builtin_documents

    tok_path = os.path.join(directory, records.TOKENIZER)
    with open(tok_path, "wb") as fh:
        fh.write(train_tokenizer_bytes(builtin_documents(), VOCAB))
    rng = np.random.default_rng(seed)
    lengths = np.maximum(2, rng.exponential(doc_tokens, n_docs).astype(np.int64))
    shards = []
    for s in range(0, n_docs, docs_per_shard):
        docs = [rng.integers(4, VOCAB, n, dtype=np.int32) for n in lengths[s:s + docs_per_shard]]
        shards.append(records.write_shard(directory, records.shard_name(len(shards)), docs))
    manifest = {"format": records.FORMAT_VERSION, "source": {"kind": "synthetic"}, "vocab_size": VOCAB,
                "tokenizer_sha256": records.sha256_of(tok_path), "num_documents": n_docs,
                "num_tokens": int(lengths.sum()), "shards": shards}
    records.write_manifest(directory, manifest)
    return manifest


def measure(directory: str, run_dir: str, seq_len: int, global_batch: int, workers: int, batches: int,
            warmup: int) -> dict:
    cfg = load_config(None, ["data.source=array_record", f"data.paths=[{directory}]", f"model.vocab_size={VOCAB}",
                             f"data.seq_len={seq_len}", f"data.global_batch={global_batch}",
                             f"data.workers={workers}", f"run.output_dir={run_dir}"])
    t0 = time.perf_counter()
    it = make_batches(cfg, run_dir)
    build_s = time.perf_counter() - t0
    try:
        for _ in range(warmup):  # starts threads / worker processes
            next(it)
        t0 = time.perf_counter()
        real = 0
        for _ in range(batches):
            real += int(next(it)["loss_mask"].sum())
        elapsed = time.perf_counter() - t0
    finally:
        it.close()
    tokens = batches * seq_len * global_batch
    return {"workers": workers, "setup_s": build_s, "batches": batches, "seconds": elapsed,
            "tokens_per_s": tokens / elapsed, "batches_per_s": batches / elapsed,
            "non_padding_fraction": real / tokens}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--docs", type=int, default=20000)
    p.add_argument("--doc-tokens", type=int, default=700, help="mean document length (exponential)")
    p.add_argument("--docs-per-shard", type=int, default=5000)
    p.add_argument("--workers", type=int, nargs="*", default=[0, 2])
    p.add_argument("--json", default="", help="write results here")
    args = p.parse_args(argv)

    tmp = tempfile.mkdtemp(prefix="maxfp4-input-bench-")
    try:
        os.makedirs(os.path.join(tmp, "data"))
        t0 = time.perf_counter()
        manifest = build_shards(os.path.join(tmp, "data"), args.docs, args.doc_tokens, args.docs_per_shard, 0)
        write_s = time.perf_counter() - t0
        results = [measure(os.path.join(tmp, "data"), os.path.join(tmp, "run"), args.seq_len, args.global_batch,
                           w, args.batches, args.warmup) for w in args.workers]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"array_record pipeline, seq_len={args.seq_len} global_batch={args.global_batch}, "
          f"{manifest['num_documents']} documents / {manifest['num_tokens']} tokens in "
          f"{len(manifest['shards'])} shards (written in {write_s:.1f}s), {os.cpu_count()} CPUs")
    print(f"{'workers':>8} {'setup s':>8} {'batches/s':>10} {'tokens/s':>12} {'non-pad':>8}")
    for r in results:
        print(f"{r['workers']:>8} {r['setup_s']:>8.2f} {r['batches_per_s']:>10.1f} {r['tokens_per_s']:>12,.0f} "
              f"{r['non_padding_fraction']:>8.3f}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"benchmark": "input_pipeline", "args": vars(args), "platform": platform.platform(),
                       "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                       "dataset": {k: manifest[k] for k in ("num_documents", "num_tokens")}, "results": results},
                      fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
