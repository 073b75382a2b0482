"""One attention layer (causal, GQA, packed segments) forward and forward + backward, per
implementation, with each implementation's agreement with the masked cuDNN kernel.

    python benchmarks/attention_layer.py [--shapes 8x2048x32x8x64,...] [--docs 1,4,12] [--json out.json]

Variants: ``cudnn_mask`` (segment mask as a [B,1,T,T] bias), ``cudnn:M`` (packed layout with at
most M runs per row), ``causal`` (one document per row, no segment information: the bound the
packed layout aims at). Rows of ``--docs`` documents of random lengths, then a padding tail.
Times are medians of CUDA-synchronised repeats after a warm-up.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from maxfp4.model.attention import attend
from timing import median_ms


def segment_ids(rng, b: int, t: int, docs: int) -> np.ndarray:
    seg = np.zeros((b, t), np.int32)
    for row in range(b):
        used = int(t * rng.uniform(0.9, 1.0)) if docs > 1 else t
        cuts = np.sort(rng.choice(np.arange(1, used), size=docs - 1, replace=False)) if docs > 1 else []
        bounds = [0, *cuts, used]
        for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            seg[row, s:e] = i + 1
    return seg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="8x2048x32x8x64,1x8192x32x8x128")
    ap.add_argument("--docs", default="1,4,12")
    ap.add_argument("--variants", default="cudnn_mask,cudnn:8,cudnn:16,cudnn:32,cudnn:64,causal")
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = []
    for shape in a.shapes.split(","):
        b, t, n, k, h = (int(v) for v in shape.split("x"))
        q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.bfloat16)
        kk = jnp.asarray(rng.normal(size=(b, t, k, h)), jnp.bfloat16)
        v = jnp.asarray(rng.normal(size=(b, t, k, h)), jnp.bfloat16)
        dout = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.bfloat16)
        for docs in (int(d) for d in a.docs.split(",")):
            seg = jnp.asarray(segment_ids(rng, b, t, docs))
            ref = None
            for variant in a.variants.split(","):
                impl, _, cap = variant.partition(":")
                if impl == "causal":
                    if docs != 1:
                        continue
                    f = lambda q, k, v, s: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
                else:
                    f = lambda q, k, v, s, impl=impl, cap=int(cap or 16): attend(q, k, v, s, impl, cap)
                fwd = jax.jit(f)
                fwd_bwd = jax.jit(lambda q, k, v, s, f=f: jax.vjp(lambda q, k, v: f(q, k, v, s), q, k, v)[1](dout))
                out = np.asarray(fwd(q, kk, v, seg), np.float32)
                grads = [np.asarray(g, np.float32) for g in fwd_bwd(q, kk, v, seg)]
                if ref is None:
                    ref = (out, grads)
                    err = 0.0
                else:
                    err = max(float(np.linalg.norm(x - r) / np.linalg.norm(r))
                              for x, r in zip([out, *grads], [ref[0], *ref[1]]))
                row = {"shape": shape, "docs": docs, "variant": variant,
                       "fwd_ms": median_ms(fwd, q, kk, v, seg, iters=20),
                       "fwd_bwd_ms": median_ms(fwd_bwd, q, kk, v, seg, iters=20),
                       "rel_err_vs_first": err}
                rows.append(row)
                print(f"{shape:<18}{docs:>5}  {variant:<12}{row['fwd_ms']:>9.3f}{row['fwd_bwd_ms']:>11.3f}"
                      f"{err:>12.2e}", flush=True)
    print(f"\n{'shape BxTxNxKxH':<18}{'docs':>5}  {'variant':<12}{'fwd ms':>9}{'fwd+bwd':>11}{'rel err':>12}")
    for r in rows:
        print(f"{r['shape']:<18}{r['docs']:>5}  {r['variant']:<12}{r['fwd_ms']:>9.3f}{r['fwd_bwd_ms']:>11.3f}"
              f"{r['rel_err_vs_first']:>12.2e}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
