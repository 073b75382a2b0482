"""Where the Mamba-2 convolution kernel's time goes: a ladder of Pallas (Triton) kernels over the
same [B, T, C] BF16 array and the same [Tb, Cb] tiles, each adding one ingredient of the
convolution forward kernel (``maxfp4.model.conv_kernel``) to the one before:

    copy      tile in by block spec, tile out
    manual    the tile read from the whole array by pl.ds (as the convolution reads x)
    shifted   W row-shifted tiles read and summed (the convolution's taps, no weights)
    masked    + each shifted tile's segment ids compared and masked (packed documents)
    conv      + weights, bias and SiLU in FP32: the convolution forward itself
    dpre      the pre-activation gradient (the backward's first kernel without its reductions)
    dpre_db   + the bias gradient's column sum over the tile
    dpre_dw   + the W weight rows' column sums of the reloaded taps times it (the whole kernel)

    dpre_dw over R row tiles a program, the column sums' products accumulated element-wise
              across them and summed over rows once (variants ``rows TB x R``)

(The backward steps read the array's tile as the output gradient and fold their column sums into
the output as 0 * sum, which the compiler cannot drop, so each keeps one output.)

    python benchmarks/probes/conv_loads.py [--config configs/mamba2-1p3b.yaml]

Each row: device microseconds a launch, read from a profiler trace of repeated calls (a timed
call alone adds tens of microseconds of dispatch at these sizes), and the bandwidth of the least
traffic (the array read once and written once). The convolution's own kernels, forward and
backward, are traced the same way, and an XLA element-wise pass over the array for scale.
"""

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

sys.path.insert(0, "benchmarks")
from conv_tiles import conv_inputs  # noqa: E402  (this folder is on the path when run as a script)
from profile_summary import traced_kernel_times  # noqa: E402

from maxfp4.model.conv_kernel import conv_backward, conv_forward, default_conv_tiling  # noqa: E402
from maxfp4.pallas_params import triton_params  # noqa: E402

STEPS = ("copy", "manual", "shifted", "masked", "conv", "dpre", "dpre_db", "dpre_dw")


def _kernel(x_ref, ids_ref, w_ref, b_ref, x_tile_ref, out_ref, *, step, tb, cb, width):
    bi, t0, c0 = pl.program_id(0), pl.program_id(1) * tb, pl.program_id(2) * cb
    if step == "copy":
        out_ref[...] = x_tile_ref[...]
        return
    if step == "manual":
        out_ref[...] = x_ref[bi, pl.ds(t0 + width - 1, tb), pl.ds(c0, cb)]
        return
    ids_Tb = ids_ref[bi, pl.ds(t0 + width - 1, tb)]
    acc = jnp.zeros((tb, cb), jnp.float32)
    full = step not in ("shifted", "masked")  # weights, bias and SiLU

    def tap(lag):
        x_TbCb = x_ref[bi, pl.ds(t0 + width - 1 - lag, tb), pl.ds(c0, cb)].astype(jnp.float32)
        if step != "shifted":
            keep_Tb = ids_ref[bi, pl.ds(t0 + width - 1 - lag, tb)] == ids_Tb
            x_TbCb = jnp.where(keep_Tb[:, None], x_TbCb, 0.0)
        return x_TbCb

    if full:
        acc += b_ref[pl.ds(c0, cb)][None, :]
    for lag in range(width):
        acc += tap(lag) * w_ref[width - 1 - lag, pl.ds(c0, cb)][None, :] if full else tap(lag)
    if step in ("shifted", "masked"):
        out_ref[...] = acc.astype(out_ref.dtype)
        return
    sig = jax.nn.sigmoid(acc)
    if step == "conv":
        out_ref[...] = (acc * sig).astype(out_ref.dtype)
        return
    dpre = x_tile_ref[...].astype(jnp.float32) * sig * (1.0 + acc * (1.0 - sig))
    sums = jnp.zeros((cb,), jnp.float32)
    if step in ("dpre_db", "dpre_dw"):
        sums += jnp.sum(dpre, axis=0)
    if step == "dpre_dw":
        for lag in range(width):
            sums += jnp.sum(tap(lag) * dpre, axis=0)
    out_ref[...] = (dpre + 0.0 * sums[None, :]).astype(out_ref.dtype)


def _rows_kernel(x_ref, ids_ref, w_ref, b_ref, dout_ref, out_ref, *, tb, cb, width, rows):
    """dpre_dw over `rows` row tiles of one program (see the module doc)."""
    bi, c0 = pl.program_id(0), pl.program_id(2) * cb
    acc_db = jnp.zeros((tb, cb), jnp.float32)
    acc_dw = [jnp.zeros((tb, cb), jnp.float32) for _ in range(width)]
    for r in range(rows):
        t0 = (pl.program_id(1) * rows + r) * tb
        ids_Tb = ids_ref[bi, pl.ds(t0 + width - 1, tb)]

        def tap(lag, t0=t0, ids_Tb=ids_Tb):
            x_TbCb = x_ref[bi, pl.ds(t0 + width - 1 - lag, tb), pl.ds(c0, cb)].astype(jnp.float32)
            keep_Tb = ids_ref[bi, pl.ds(t0 + width - 1 - lag, tb)] == ids_Tb
            return jnp.where(keep_Tb[:, None], x_TbCb, 0.0)

        pre = jnp.broadcast_to(b_ref[pl.ds(c0, cb)][None, :], (tb, cb)).astype(jnp.float32)
        for lag in range(width):
            pre += tap(lag) * w_ref[width - 1 - lag, pl.ds(c0, cb)][None, :]
        sig = jax.nn.sigmoid(pre)
        dpre = dout_ref[pl.ds(r * tb, tb), :].astype(jnp.float32) * sig * (1.0 + pre * (1.0 - sig))
        acc_db += dpre
        for lag in range(width):
            acc_dw[lag] += tap(lag) * dpre
        if r < rows - 1:
            out_ref[pl.ds(r * tb, tb), :] = dpre.astype(out_ref.dtype)
    sums = jnp.sum(acc_db, axis=0)
    for lag in range(width):
        sums += jnp.sum(acc_dw[lag], axis=0)
    out_ref[pl.ds((rows - 1) * tb, tb), :] = (dpre + 0.0 * sums[None, :]).astype(out_ref.dtype)


@functools.partial(jax.jit, static_argnames=("tb", "cb", "rows", "num_warps"))
def rows_ladder(x_pad, ids_pad, w, b, x, tb, cb, rows, num_warps):
    bsz, t, c = x.shape
    tile = pl.BlockSpec((pl.squeezed, tb * rows, cb), lambda bi, ti, ci: (bi, ti, ci))
    return pl.pallas_call(
        functools.partial(_rows_kernel, tb=tb, cb=cb, width=w.shape[0], rows=rows),
        grid=(bsz, t // (tb * rows), c // cb), in_specs=[pl.no_block_spec] * 4 + [tile], out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name=f"rows_{tb}x{rows}_w{num_warps}",
        **triton_params(False, num_warps))(x_pad, ids_pad, w, b, x)


@functools.partial(jax.jit, static_argnames=("step", "tb", "cb", "num_warps"))
def ladder(x_pad, ids_pad, w, b, x, step, tb, cb, num_warps):
    bsz, t, c = x.shape
    tile = pl.BlockSpec((pl.squeezed, tb, cb), lambda bi, ti, ci: (bi, ti, ci))
    return pl.pallas_call(
        functools.partial(_kernel, step=step, tb=tb, cb=cb, width=w.shape[0]), grid=(bsz, t // tb, c // cb),
        in_specs=[pl.no_block_spec] * 4 + [tile], out_specs=tile,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), name=f"ladder_{step}_w{num_warps}",
        **triton_params(False, num_warps))(x_pad, ids_pad, w, b, x)


def device_us(calls, reps: int) -> dict[str, tuple[float, int]]:
    """Per GPU kernel name: mean device microseconds a launch and launches, over ``reps`` runs of
    each of ``calls`` (zero-argument functions, each run once untraced first)."""
    totals, counts = traced_kernel_times(calls, reps)
    return {name: (totals[name] / counts[name], counts[name]) for name in totals}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/mamba2-1p3b.yaml")
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    x, w, bias, ids = conv_inputs(a.config)
    (b, t, c), width = x.shape, w.shape[0]
    x_pad = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
    ids_pad = jnp.pad(ids, ((0, 0), (width - 1, 0)), constant_values=-1)
    tiling = default_conv_tiling(t, c)
    moved = 2 * x.size * x.dtype.itemsize
    print(f"[B, T, C] = [{b}, {t}, {c}], tile {tiling.rows} x {tiling.channels}, {jax.devices()[0].device_kind}")
    calls = [functools.partial(ladder, x_pad, ids_pad, w, bias, x, step=step, tb=tiling.rows, cb=tiling.channels,
                               num_warps=warps) for step in STEPS for warps in (4, 8)]
    calls += [functools.partial(rows_ladder, x_pad, ids_pad, w, bias, x, tb=tb, cb=tiling.channels, rows=rows,
                                num_warps=warps)
              for tb, rows, warps in ((64, 1, 8), (32, 4, 8), (32, 8, 8), (64, 4, 8), (32, 4, 4), (16, 8, 4))]
    fwd = jax.jit(lambda x: conv_forward(x, w, bias, ids, False, tiling))
    out, res = fwd(x)
    bwd = jax.jit(lambda res, dout: conv_backward(res, dout, False, tiling=tiling))
    calls += [functools.partial(fwd, x), functools.partial(bwd, res, out),
              functools.partial(jax.jit(lambda x: x * 2), x)]  # XLA's element-wise pass, for scale
    print(f"{'kernel':<40}{'launches':>9}{'us':>9}{'GB/s':>8}")
    for name, (us, n) in sorted(device_us(calls, a.reps).items(), key=lambda kv: -kv[1][0]):
        print(f"{name[:39]:<40}{n:>9}{us:>9.1f}{moved / us / 1e3:>8.0f}", flush=True)
    want = out
    got = ladder(x_pad, ids_pad, w, bias, x, step="conv", tb=tiling.rows, cb=tiling.channels,
                 num_warps=tiling.forward_warps)
    print("conv step equals the kernel's forward:", bool(jnp.array_equal(got, want)))
    same = [bool(jnp.array_equal(rows_ladder(x_pad, ids_pad, w, bias, x, tb=tb, cb=tiling.channels, rows=rows,
                                             num_warps=8),
                                 ladder(x_pad, ids_pad, w, bias, x, step="dpre_dw", tb=tiling.rows,
                                        cb=tiling.channels, num_warps=8)))
            for tb, rows in ((64, 1), (32, 4))]
    print("rows variants equal dpre_dw:", same)


if __name__ == "__main__":
    main()
