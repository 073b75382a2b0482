"""FP8 transposes: XLA's transpose of an FP8 array against a Pallas (Triton) tile transpose, at the
shapes of the FP8 recipes' weight-gradient operands (X^T and dY^T, [K, M] from [M, K]).

The FP8 weight-gradient GEMM needs both operands with the token axis contiguous, so each FP8
linear layer transposes its quantized input and its quantized output gradient. XLA runs those
as transposes of 1-byte elements; this probe asks whether a tile kernel moves them faster.
Each time is the median over calls of one jitted function that transposes ``--copies``
distinct arrays (so launch gaps are amortised), divided by the copies.

    python benchmarks/probes/fp8_transpose.py [--copies 8]
"""

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.pallas_params import triton_params  # noqa: E402


def _kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...].T


@functools.partial(jax.jit, static_argnames=("bm", "bn", "num_warps"))
def tile_transpose(x_MN: jax.Array, bm: int, bn: int, num_warps: int) -> jax.Array:
    """x^T [N, M] by [bm, bn] tiles, the bytes moved as uint8 (the same bits)."""
    m, n = x_MN.shape
    u = jax.lax.bitcast_convert_type(x_MN, jnp.uint8)
    out = pl.pallas_call(_kernel, grid=(m // bm, n // bn),
                         in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j))],
                         out_specs=pl.BlockSpec((bn, bm), lambda i, j: (j, i)),
                         out_shape=jax.ShapeDtypeStruct((n, m), jnp.uint8),
                         **triton_params(False, num_warps))(u)
    return jax.lax.bitcast_convert_type(out, x_MN.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    shapes = [(16384, 8512), (16384, 8192), (16384, 4096), (16384, 2048)]
    tilings = [(64, 64, 4), (128, 128, 4), (128, 128, 8), (64, 128, 4), (128, 64, 4), (32, 128, 4),
               (128, 32, 4), (256, 64, 8), (64, 256, 8)]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; us per transpose, GB/s moved (read + write)")
    print(f"{'shape':<16}{'variant':<18}{'us':>9}{'GB/s':>9}")
    rng = np.random.default_rng(0)
    for m, n in shapes:
        xs = [jnp.asarray(rng.standard_normal((m, n)), jnp.float32).astype(jnp.float8_e4m3fn)
              for _ in range(a.copies)]
        want = np.asarray(jax.lax.bitcast_convert_type(xs[0], jnp.uint8)).T
        moved = 2 * m * n
        variants = [("xla", jax.jit(lambda xs: [x.T for x in xs]))]
        for bm, bn, w in tilings:
            if m % bm or n % bn:
                continue
            variants.append((f"tile {bm}x{bn} w{w}",
                             jax.jit(lambda xs, bm=bm, bn=bn, w=w: [tile_transpose(x, bm, bn, w) for x in xs])))
        for label, fn in variants:
            try:
                got = fn(xs)[0]
                ok = np.array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint8)), want)
                us = 1e3 * median_ms(fn, xs, iters=a.iters) / a.copies
            except Exception as exc:  # a tiling Triton refuses is reported, not fatal
                print(f"{str((m, n)):<16}{label:<18} failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            print(f"{str((m, n)):<16}{label:<18}{us:>9.1f}{moved / us / 1e3:>9.0f}{'' if ok else '  WRONG BITS'}",
                  flush=True)


if __name__ == "__main__":
    main()
