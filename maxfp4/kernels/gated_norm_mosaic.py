"""The Mamba-2 mixer's gated RMSNorm (``maxfp4.kernels.gated_norm``: read its module docstring
first for the math and why a kernel) as Mosaic GPU kernels, forward and backward, with the
same operands, outputs and FP8 stores as the Triton kernels there.

A row of one group (Eg values, 4,096 in mamba2-1p3b) is one array in Mosaic GPU's strided
register layout, 16-byte vectors of 8 values, Eg / 1,024 a thread: the row's sums (of g^2, and
of g scale dout in the backward) are whole-array reductions, and the scale's gradient sums over
rows are elementwise, in registers. TMA moves at most 256 values along a dimension, so every
[..., n] array is viewed as [..., n / 64, 64] (free in XLA): a program's rows of one group are
then one copy. The in_proj output that z is read from, and whose gradient dz is written into,
keeps its width I; I must be a multiple of 64.

The forward: a program takes 4 rows of one group (u, z in, the output out). The backward: a
program walks 16 rows, as the Triton kernel's do, so that its partial sums of the scale's
gradient are as many; the next row's inputs load while a row computes (two slots), and each
row's du and dz leave by TMA from two slots too. The FP8 variants keep each program's max
|value| as one number. ``approx_math``: the sigmoid is ``ssd_mosaic.sigmoid`` (``ex2.approx``,
an approximate ``rsqrt`` for its division), as in the other Mosaic kernels. The row sums run in
another order than Triton's: an output may differ by one BF16 step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maxfp4.kernels.epilogue import Quantize, Quantized
from maxfp4.kernels.ssd_mosaic import (StridedLoads, kernel_on_grid, lowers, scale_operand, sigmoid,
                                      store_maybe_quantized)

CHUNK = 64  # values a TMA box's last dimension holds (of at most 256)
_VALUES_A_VECTOR = 8  # BF16 values in 16 bytes
_THREADS = 128  # a warpgroup
_FORWARD_ROWS = 4  # rows a forward program: u, z and the output of 4 rows fill ~100 KB of shared memory
_BACKWARD_ROWS = 16  # rows a backward program walks: as the Triton kernel's, for as many partial sums
_GRID = ("b", "t", "g")  # a program: batch row, rows of T, group


def supported(t: int, e: int, groups: int, in_columns: int) -> bool:
    """Whether the kernels take these shapes: a group's row is whole vectors of every thread
    (Eg a multiple of 1,024) and at most 256 chunks; T a multiple of both programs' rows; the
    in_proj width I a multiple of 64."""
    if e % groups:
        return False
    eg = e // groups
    return (eg % (_VALUES_A_VECTOR * _THREADS) == 0 and eg // CHUNK <= 256 and in_columns % CHUNK == 0
            and t % _BACKWARD_ROWS == 0)


def _chunked(a: jax.Array) -> jax.Array:
    """[..., n] as [..., n / 64, 64]."""
    return a.reshape(*a.shape[:-1], a.shape[-1] // CHUNK, CHUNK)


def _unchunked(a: jax.Array) -> jax.Array:
    return a.reshape(*a.shape[:-2], a.shape[-2] * a.shape[-1])


def _check(t: int, e: int, groups: int, in_columns: int) -> None:
    if not supported(t, e, groups, in_columns):
        raise ValueError(f"gated norm on Mosaic GPU: T {t}, E {e} in {groups} groups and in_proj width {in_columns} "
                         f"do not tile (need E / groups a multiple of 1024, at most {256 * CHUNK}; T of "
                         f"{_BACKWARD_ROWS}; the width of {CHUNK})")


def _row_loads(eg: int, interpret: bool) -> StridedLoads:
    """Loads of one group's row, [Eg / 64, 64]."""
    return StridedLoads((eg // CHUNK, CHUNK), interpret, vec_size=_VALUES_A_VECTOR)


def _gated(rows: StridedLoads, u_s, z_s) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(u, z, sigmoid(z), g = u z sigmoid(z)) of one row, in FP32."""
    u = rows.load(u_s).astype(jnp.float32)
    z = rows.load(z_s).astype(jnp.float32)
    sz = sigmoid(z, rows.interpret)
    return u, z, sz, u * z * sz


def _store_row(value: jax.Array, dst, quantized: Quantized | None, qscale_s, amax):
    """``store_maybe_quantized`` of a row; returns the running max |value rounded| (None without
    ``quantized``)."""
    rounded = store_maybe_quantized(value, dst, quantized, qscale_s)
    if rounded is None:
        return None
    row_max = jnp.max(jnp.abs(rounded))
    return row_max if amax is None else jnp.maximum(amax, row_max)


def _scale_operand(quantize: Quantize | None) -> list:
    return [] if quantize is None else [scale_operand(quantize.scale)]


def gated_norm_forward(u_BTE, zxbcdt_BTI, scale_E, groups: int, eps: float, out_dtype, interpret: bool,
                       quantize: Quantize | None = None, rows_per_program: int = _FORWARD_ROWS):
    """``gated_norm.gated_norm_forward`` on Mosaic GPU: (the value, the residuals), the value
    ``(q, max |value|)`` with ``quantize``. ``rows_per_program`` (dividing 16): what
    ``benchmarks/norm_layer.py`` sweeps."""
    b, t, e = u_BTE.shape
    _check(t, e, groups, zxbcdt_BTI.shape[-1])
    dtype = out_dtype if quantize is None else quantize.dtype
    out, amax = _forward(u_BTE, zxbcdt_BTI, scale_E, *_scale_operand(quantize), groups=groups, eps=eps,
                         out_dtype=jnp.dtype(out_dtype), store_dtype=jnp.dtype(dtype), fp8=quantize is not None,
                         interpret=interpret, n=rows_per_program)
    residuals = (u_BTE, zxbcdt_BTI, scale_E)
    return (out if quantize is None else (out, amax)), residuals


@functools.partial(jax.jit, static_argnames=("groups", "eps", "out_dtype", "store_dtype", "fp8", "interpret", "n"))
def _forward(u_BTE, zxbcdt_BTI, scale_E, *qscale, groups, eps, out_dtype, store_dtype, fp8, interpret,
             n=_FORWARD_ROWS):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, t, e = u_BTE.shape
    eg = e // groups
    nc = eg // CHUNK
    rows = _row_loads(eg, interpret)
    quantized = Quantized(out_dtype) if fp8 else None

    def kernel(u_g, z_g, s_g, *refs):
        refs = list(refs)
        qscale_g = refs.pop(0) if fp8 else None
        out_g = refs.pop(0)
        amax_g = refs.pop(0) if fp8 else None
        u_s, z_s, s_s, *refs = refs
        qscale_s = refs.pop(0) if fp8 else None
        out_s = refs.pop(0)
        amax_s = refs.pop(0) if fp8 else None
        loaded, = refs
        bi, ti, gi = lax.axis_index("b"), lax.axis_index("t"), lax.axis_index("g")
        t0, cols = ti * n, pl.ds(gi * nc, nc)
        plgpu.copy_gmem_to_smem(u_g.at[bi, pl.ds(t0, n), cols], u_s, loaded)
        plgpu.copy_gmem_to_smem(z_g.at[bi, pl.ds(t0, n), cols], z_s, loaded)
        plgpu.copy_gmem_to_smem(s_g.at[cols], s_s, loaded)
        if fp8:
            plgpu.copy_gmem_to_smem(qscale_g, qscale_s, loaded)
        plgpu.barrier_wait(loaded)
        scale = rows.load(s_s)
        amax = None
        for i in range(n):
            _, _, _, g = _gated(rows, u_s.at[i], z_s.at[i])
            r = lax.rsqrt(jnp.mean(g * g) + eps)
            amax = _store_row(g * r * scale, out_s.at[i], quantized, qscale_s, amax)
        if fp8:
            amax_s[0] = amax
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_s, out_g.at[bi, pl.ds(t0, n), cols])
        if fp8:
            plgpu.copy_smem_to_gmem(amax_s, amax_g.at[bi, ti, gi])
        plgpu.wait_smem_to_gmem(0)

    f32 = jnp.float32
    out_type = [jax.ShapeDtypeStruct((b, t, e // CHUNK, CHUNK), store_dtype)]
    scratch = [plgpu.SMEM((n, nc, CHUNK), u_BTE.dtype), plgpu.SMEM((n, nc, CHUNK), zxbcdt_BTI.dtype),
               plgpu.SMEM((nc, CHUNK), f32)]
    if fp8:
        out_type.append(jax.ShapeDtypeStruct((b, t // n, groups, 32), f32))
        scratch.append(plgpu.SMEM((32,), f32))
    scratch.append(plgpu.SMEM((n, nc, CHUNK), store_dtype))
    if fp8:
        scratch.append(plgpu.SMEM((32,), f32))
    scratch.append(plgpu.Barrier(num_arrivals=3 + fp8))
    results = kernel_on_grid(kernel, out_type, (b, t // n, groups), _GRID, scratch, interpret)(
        _chunked(u_BTE), _chunked(zxbcdt_BTI), _chunked(scale_E.astype(f32)), *qscale)
    return _unchunked(results[0]), (jnp.max(results[1][..., 0]) if fp8 else None)


def gated_norm_backward(residuals, dout_BTE, groups: int, eps: float, interpret: bool,
                        quantize: Quantize | None = None):
    """``gated_norm.gated_norm_backward`` on Mosaic GPU: (du, dz [B, T, I] with its first E columns
    written, dscale), and ``max |dz|`` with ``quantize``."""
    u_BTE, zxbcdt_BTI, scale_E = residuals
    b, t, e = u_BTE.shape
    _check(t, e, groups, zxbcdt_BTI.shape[-1])
    dz_dtype = zxbcdt_BTI.dtype if quantize is None else quantize.dtype
    du, dz, dscale, amax = _backward(u_BTE, zxbcdt_BTI, scale_E, dout_BTE, *_scale_operand(quantize), groups=groups,
                                     eps=eps, dz_dtype=jnp.dtype(dz_dtype), fp8=quantize is not None,
                                     interpret=interpret)
    return (du, dz, dscale) if quantize is None else (du, dz, dscale, amax)


@functools.partial(jax.jit, static_argnames=("groups", "eps", "dz_dtype", "fp8", "interpret"))
def _backward(u_BTE, zxbcdt_BTI, scale_E, dout_BTE, *qscale, groups, eps, dz_dtype, fp8, interpret):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, t, e = u_BTE.shape
    eg = e // groups
    nc = eg // CHUNK
    rows = _row_loads(eg, interpret)
    quantized = Quantized(zxbcdt_BTI.dtype) if fp8 else None
    n = _BACKWARD_ROWS
    f32 = jnp.float32

    def kernel(u_g, z_g, s_g, dout_g, *refs):
        refs = list(refs)
        qscale_g = refs.pop(0) if fp8 else None
        du_g, dz_g, dscale_g = refs[:3]
        refs = refs[3:]
        amax_g = refs.pop(0) if fp8 else None
        u_s, z_s, dout_s, s_s, *refs = refs
        qscale_s = refs.pop(0) if fp8 else None
        du_s, dz_s, dscale_s = refs[:3]
        refs = refs[3:]
        amax_s = refs.pop(0) if fp8 else None
        loaded, once = refs
        bi, ti, gi = lax.axis_index("b"), lax.axis_index("t"), lax.axis_index("g")
        cols = pl.ds(gi * nc, nc)
        plgpu.copy_gmem_to_smem(s_g.at[cols], s_s, once)
        if fp8:
            plgpu.copy_gmem_to_smem(qscale_g, qscale_s, once)

        def fetch(i):  # row i of the program into slot i % 2
            row, slot = ti * n + i, i % 2
            plgpu.copy_gmem_to_smem(u_g.at[bi, row, cols], u_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(z_g.at[bi, row, cols], z_s.at[slot], loaded.at[slot])
            plgpu.copy_gmem_to_smem(dout_g.at[bi, row, cols], dout_s.at[slot], loaded.at[slot])
        fetch(0)
        fetch(1)
        plgpu.barrier_wait(once)
        amax = None
        for i in range(n):
            slot = i % 2
            plgpu.barrier_wait(loaded.at[slot])
            u, z, sz, g = _gated(rows, u_s.at[slot], z_s.at[slot])
            dout = rows.load(dout_s.at[slot]).astype(f32)
            # The scale and the scale's running gradient stay in shared memory, each thread
            # reading and writing its own values: a row is Eg / 128 registers an array a
            # thread (32 at Eg = 4,096), and u, z, sigmoid(z), g and dout already take five.
            r = lax.rsqrt(jnp.mean(g * g) + eps)
            dg = r * rows.load(s_s) * dout - g * (r * r * r * jnp.mean(g * rows.load(s_s) * dout))
            term = dout * g * r
            dscale_s[...] = term if i == 0 else rows.load(dscale_s) + term
            du = dg * z * sz
            dz = dg * u * sz * (1.0 + z * (1.0 - sz))
            if i >= 2:  # the stores from this slot two rows back have read it
                plgpu.wait_smem_to_gmem(2, wait_read_only=True)
            du_s[slot] = du.astype(du_s.dtype)
            amax = _store_row(dz, dz_s.at[slot], quantized, qscale_s, amax)
            plgpu.commit_smem()  # (a warpgroup barrier: every thread is done reading the slot's inputs)
            row = ti * n + i
            plgpu.copy_smem_to_gmem(du_s.at[slot], du_g.at[bi, row, cols])
            plgpu.copy_smem_to_gmem(dz_s.at[slot], dz_g.at[bi, row, cols])
            if i + 2 < n:
                fetch(i + 2)
        if fp8:
            amax_s[0] = amax
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(dscale_s, dscale_g.at[bi, ti, cols])
        if fp8:
            plgpu.copy_smem_to_gmem(amax_s, amax_g.at[bi, ti, gi])
        plgpu.wait_smem_to_gmem(0)

    in_cols = zxbcdt_BTI.shape[-1]
    out_type = [jax.ShapeDtypeStruct((b, t, e // CHUNK, CHUNK), u_BTE.dtype),
                jax.ShapeDtypeStruct((b, t, in_cols // CHUNK, CHUNK), dz_dtype),
                jax.ShapeDtypeStruct((b, t // n, e // CHUNK, CHUNK), f32)]
    scratch = [plgpu.SMEM((2, nc, CHUNK), u_BTE.dtype), plgpu.SMEM((2, nc, CHUNK), zxbcdt_BTI.dtype),
               plgpu.SMEM((2, nc, CHUNK), dout_BTE.dtype), plgpu.SMEM((nc, CHUNK), f32)]
    if fp8:
        out_type.append(jax.ShapeDtypeStruct((b, t // n, groups, 32), f32))
        scratch.append(plgpu.SMEM((32,), f32))
    scratch += [plgpu.SMEM((2, nc, CHUNK), u_BTE.dtype), plgpu.SMEM((2, nc, CHUNK), dz_dtype),
                plgpu.SMEM((nc, CHUNK), f32)]
    if fp8:
        scratch.append(plgpu.SMEM((32,), f32))
    scratch += [plgpu.Barrier(num_arrivals=3, num_barriers=2), plgpu.Barrier(num_arrivals=1 + fp8)]
    results = kernel_on_grid(kernel, out_type, (b, t // n, groups), _GRID, scratch, interpret)(
        _chunked(u_BTE), _chunked(zxbcdt_BTI), _chunked(scale_E.astype(f32)), _chunked(dout_BTE), *qscale)
    du, dz, dscale_parts = (_unchunked(a) for a in results[:3])
    dscale = jnp.sum(dscale_parts, axis=(0, 1)).astype(scale_E.dtype)
    return du, dz, dscale, (jnp.max(results[3][..., 0]) if fp8 else None)


def lowers_at(b: int, t: int, e: int, groups: int, in_columns: int, act_dtype, scale_dtype) -> bool:
    """Whether this jax lowers the four kernels for CUDA at these shapes, as the mixer runs them
    (BF16 stores, and the FP8 recipes' E4M3 forward and E5M2 backward stores)
    (``ssd_mosaic.lowers``: one warning and False where it does not)."""
    sds = jax.ShapeDtypeStruct
    u, zx, s = sds((b, t, e), act_dtype), sds((b, t, in_columns), act_dtype), sds((e,), scale_dtype)
    q = [sds((32,), jnp.float32)]
    act = jnp.dtype(act_dtype)
    return (all(lowers(_forward, u, zx, s, *([] if dtype == act else q), groups=groups, eps=1e-5, out_dtype=act,
                       store_dtype=jnp.dtype(dtype), fp8=dtype != act, interpret=False)
                for dtype in (act, jnp.float8_e4m3fn))
            and all(lowers(_backward, u, zx, s, u, *([] if dtype == act else q), groups=groups, eps=1e-5,
                           dz_dtype=jnp.dtype(dtype), fp8=dtype != act, interpret=False)
                    for dtype in (act, jnp.float8_e5m2)))
