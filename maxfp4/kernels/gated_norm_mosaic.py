"""The Mamba-2 mixer's gated RMSNorm (``maxfp4.kernels.gated_norm``: read its module docstring
first for the math and why a kernel) as Mosaic GPU kernels, forward and backward, with the
same operands, outputs and FP8 stores as the Triton kernels there.

A row of one group (Eg values, 4,096 in mamba2-1p3b) is worked in pieces of 1,024 values, one
16-byte vector a thread of the warpgroup, in Mosaic GPU's strided register layout (a row held
whole would be Eg / 128 registers an array a thread). A pass over the pieces adds up the row's
sums (of g^2, and of g scale dout in the backward) elementwise, then reduces once; a second
pass makes the outputs. TMA moves at most 256 values along a dimension, so every [..., n]
array is viewed as [..., n / 64, 64] (free in XLA): a program's rows of one group are then one
copy. The in_proj output that z is read from, and whose gradient dz is written into, keeps its
width I; I must be a multiple of 64.

The forward: a program takes 2 rows of one group (u, z in, the output out), keeping g in
registers between its passes (measured on an H200: 95 us a mamba2-1p3b layer against the Triton
kernel's 110). The backward: a program walks 16 rows, as the Triton kernel's do, so that its
partial sums of the scale's gradient are as many (held in registers), on one warpgroup, its rows
in a loop: 0.19 ms a layer against Triton's 0.26, which spreads a row over 16 warps (the rows
unrolled in Python took 0.72 ms, and ~45 s to lower). A row split over 4
warpgroups, exchanging their parts of the sums through shared memory, measured 0.28 ms and gave
wrong sums: jax lowers a reduction over all axes of a strided array through one scratch buffer
that the warpgroups of a program share (jax 0.11.2 documents the case as unsupported; 0.10
refuses it). The next row's inputs load while a row computes (two slots), and each row's du and
dz overwrite its u and z (E5M2 dz has its own slot) and leave by TMA from there, which keeps
shared memory to ~64 KB a program. The pass that makes the outputs computes g again rather than
keeping it. The FP8 variants keep each program's max |value| as one number. ``approx_math``: the
sigmoid is ``ssd_mosaic.sigmoid`` (``ex2.approx``, an approximate ``rsqrt`` for its division), as
in the other Mosaic kernels. The row sums run in another order than Triton's: an output may
differ by one BF16 step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from maxfp4.kernels.epilogue import Quantize, Quantized
from maxfp4.kernels.ssd_mosaic import (StridedLoads, kernel_on_grid, lowers, scale_operand, sigmoid,
                                      store_keeping_max)

CHUNK = 64  # values a TMA box's last dimension holds (of at most 256)
_VALUES_A_VECTOR = 8  # BF16 values in 16 bytes
_THREADS = 128  # a warpgroup
PIECE = _VALUES_A_VECTOR * _THREADS  # values of a row one pass step holds: one vector a thread
_FORWARD_ROWS = 2  # rows a forward program (measured on an H200: 95.2 us with 2, 95.1 with 1, 168.7 with 4)
_BACKWARD_ROWS = 16  # rows a backward program walks: as the Triton kernel's, for as many partial sums
_GRID = ("b", "t", "g")  # a program: batch row, rows of T, group


def supported(t: int, e: int, groups: int, in_columns: int) -> bool:
    """Whether the kernels take these shapes: a group's row is whole vectors of every thread
    (Eg a multiple of 1,024) and at most 256 chunks; T a multiple of both programs' rows; the
    in_proj width I a multiple of 64."""
    if e % groups:
        return False
    eg = e // groups
    return (eg % PIECE == 0 and eg // CHUNK <= 256 and in_columns % CHUNK == 0
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


def _pieces(n: int) -> list:
    """n values of a row, [n / 64, 64], in pieces of 1,024 values ([16, 64]), one vector a
    thread: a row held whole would be Eg / 128 registers an array a thread (32 at Eg = 4,096),
    for each of the backward's five arrays of it."""
    rows = PIECE // CHUNK
    return [pl.ds(k * rows, rows) for k in range(n // PIECE)]


def _piece_loads(interpret: bool) -> StridedLoads:
    return StridedLoads((PIECE // CHUNK, CHUNK), interpret, vec_size=_VALUES_A_VECTOR)


def _gated(loads: StridedLoads, u_s, z_s) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(u, z, sigmoid(z), g = u z sigmoid(z)) of one piece, in FP32."""
    u = loads.load(u_s).astype(jnp.float32)
    z = loads.load(z_s).astype(jnp.float32)
    sz = sigmoid(z, loads.interpret)
    return u, z, sz, u * z * sz


def _summed(terms: list[jax.Array]) -> jax.Array:
    """The sum of every value of the pieces' arrays: added elementwise first, one reduction."""
    return jnp.sum(functools.reduce(jnp.add, terms))


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
    loads = _piece_loads(interpret)
    pieces = _pieces(eg)
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
        amax = None
        for i in range(n):
            # g stays in registers between the passes: Eg / 128 a thread
            g = [_gated(loads, u_s.at[i, p], z_s.at[i, p])[3] for p in pieces]
            r = lax.rsqrt(_summed([v * v for v in g]) / eg + eps)
            for p, g_p in zip(pieces, g):
                amax = store_keeping_max(g_p * r * loads.load(s_s.at[p]), out_s.at[i, p], quantized, qscale_s, amax)
        if fp8:
            amax_s[0] = jnp.max(amax)
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
                        quantize: Quantize | None = None, rows_per_program: int = _BACKWARD_ROWS):
    """``gated_norm.gated_norm_backward`` on Mosaic GPU: (du, dz [B, T, I] with its first E columns
    written, dscale), and ``max |dz|`` with ``quantize``. ``rows_per_program`` (dividing 16):
    what ``benchmarks/norm_layer.py`` sweeps; fewer rows make more programs, and more partial
    sums of the scale's gradient for XLA to add up."""
    u_BTE, zxbcdt_BTI, scale_E = residuals
    b, t, e = u_BTE.shape
    _check(t, e, groups, zxbcdt_BTI.shape[-1])
    dz_dtype = zxbcdt_BTI.dtype if quantize is None else quantize.dtype
    du, dz, dscale, amax = _backward(u_BTE, zxbcdt_BTI, scale_E, dout_BTE, *_scale_operand(quantize), groups=groups,
                                     eps=eps, dz_dtype=jnp.dtype(dz_dtype), fp8=quantize is not None,
                                     interpret=interpret, n=rows_per_program)
    return (du, dz, dscale) if quantize is None else (du, dz, dscale, amax)


@functools.partial(jax.jit, static_argnames=("groups", "eps", "dz_dtype", "fp8", "interpret", "n"))
def _backward(u_BTE, zxbcdt_BTI, scale_E, dout_BTE, *qscale, groups, eps, dz_dtype, fp8, interpret,
              n=_BACKWARD_ROWS):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    b, t, e = u_BTE.shape
    eg = e // groups
    nc = eg // CHUNK
    loads = _piece_loads(interpret)
    pieces = _pieces(eg)
    quantized = Quantized(zxbcdt_BTI.dtype) if fp8 else None
    dz_in_place = not fp8  # dz in BF16 overwrites z's slot; as E5M2 it needs its own
    f32 = jnp.float32

    def kernel(u_g, z_g, s_g, dout_g, *refs):
        refs = list(refs)
        qscale_g = refs.pop(0) if fp8 else None
        du_g, dz_g, dscale_g = refs[:3]
        refs = refs[3:]
        amax_g = refs.pop(0) if fp8 else None
        u_s, z_s, dout_s, s_s, *refs = refs
        qscale_s = refs.pop(0) if fp8 else None
        dz_s = z_s if dz_in_place else refs.pop(0)
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
        plgpu.barrier_wait(once)

        def row_step(i, carry):
            """Row i of the program; ``carry``: the scale's gradient summed over the rows so far
            (a piece's worth a piece, in registers) and the running max |dz| (FP8). A loop, not
            unrolled in Python: 16 rows unrolled took Mosaic's lowering ~45 s a kernel."""
            dscale, amax = carry
            slot = i % 2

            @pl.when(i + 1 < n)
            def _():
                # du and dz leave from their row's input slot: the next row's inputs go into the
                # other slot once the stores of the row before have read it
                @pl.when(i >= 1)
                def _():
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                fetch(i + 1)

            plgpu.barrier_wait(loaded.at[slot])
            u_i, z_i, dout_i = u_s.at[slot], z_s.at[slot], dout_s.at[slot]
            # Pass 1: the row's two sums. Pass 2 computes g again rather than keeping it.
            squares, products = [], []
            for p in pieces:
                g = _gated(loads, u_i.at[p], z_i.at[p])[3]
                squares.append(g * g)
                products.append(g * loads.load(s_s.at[p]) * loads.load(dout_i.at[p]).astype(f32))
            square, product = _summed(squares), _summed(products)
            r = lax.rsqrt(square / eg + eps)
            c = r * r * r * (product / eg)
            dscale = list(dscale)
            for k, p in enumerate(pieces):
                u, z, sz, g = _gated(loads, u_i.at[p], z_i.at[p])
                dout = loads.load(dout_i.at[p]).astype(f32)
                dg = r * loads.load(s_s.at[p]) * dout - g * c
                dscale[k] = dscale[k] + dout * g * r
                # each thread overwrites only the values it has just read
                u_i.at[p][...] = (dg * z * sz).astype(u_s.dtype)
                amax = store_keeping_max(dg * u * sz * (1.0 + z * (1.0 - sz)), dz_s.at[slot, p], quantized,
                                         qscale_s, amax)
            plgpu.commit_smem()  # (a warpgroup barrier too: every thread is done with the slot)
            row = ti * n + i
            plgpu.copy_smem_to_gmem(u_i, du_g.at[bi, row, cols])
            plgpu.copy_smem_to_gmem(dz_s.at[slot], dz_g.at[bi, row, cols])
            return tuple(dscale), amax

        zeros = loads.zeros()  # (adding the first row's terms to zero changes no value)
        dscale, amax = lax.fori_loop(0, n, row_step, (tuple(zeros for _ in pieces), zeros if fp8 else None))
        # The scale is read no more: its buffer takes the scale's gradient (each thread its own values).
        for p, v in zip(pieces, dscale):
            s_s.at[p][...] = v
        if fp8:
            amax_s[0] = jnp.max(amax)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s_s, dscale_g.at[bi, ti, cols])
        if fp8:
            plgpu.copy_smem_to_gmem(amax_s, amax_g.at[bi, ti, gi])
        plgpu.wait_smem_to_gmem(0)

    in_cols = zxbcdt_BTI.shape[-1]
    out_type = [jax.ShapeDtypeStruct((b, t, e // CHUNK, CHUNK), u_BTE.dtype),
                jax.ShapeDtypeStruct((b, t, in_cols // CHUNK, CHUNK), dz_dtype),
                jax.ShapeDtypeStruct((b, t // n, e // CHUNK, CHUNK), f32)]
    slots = (2, nc, CHUNK)
    scratch = [plgpu.SMEM(slots, u_BTE.dtype), plgpu.SMEM(slots, zxbcdt_BTI.dtype), plgpu.SMEM(slots, dout_BTE.dtype),
               plgpu.SMEM((nc, CHUNK), f32)]
    if fp8:
        out_type.append(jax.ShapeDtypeStruct((b, t // n, groups, 32), f32))
        scratch += [plgpu.SMEM((32,), f32), plgpu.SMEM(slots, dz_dtype), plgpu.SMEM((32,), f32)]
    scratch += [plgpu.Barrier(num_arrivals=3, num_barriers=2), plgpu.Barrier(num_arrivals=1 + fp8)]
    results = kernel_on_grid(kernel, out_type, (b, t // n, groups), _GRID, scratch, interpret)(
        _chunked(u_BTE), _chunked(zxbcdt_BTI), _chunked(scale_E.astype(f32)), _chunked(dout_BTE), *qscale)
    du, dz, dscale_parts = (_unchunked(a) for a in results[:3])
    dscale = jnp.sum(dscale_parts, axis=(0, 1)).astype(scale_E.dtype)
    return du, dz, dscale, (jnp.max(results[3][..., 0]) if fp8 else None)


def lowers_at(b: int, t: int, e: int, groups: int, in_columns: int, act_dtype, scale_dtype,
              direction: str = "forward", fp8: bool = False) -> bool:
    """Whether this jax lowers ``direction``'s kernel ("forward" or "backward") for CUDA at these
    shapes, as the mixer runs it: its BF16 store, or with ``fp8`` the FP8 recipes' E4M3 forward
    or E5M2 backward store (``ssd_mosaic.lowers``: one warning and False where it does not). Only
    what the layer runs is lowered: Mosaic GPU's lowering takes ~1 s a kernel (2 CPU cores)."""
    sds = jax.ShapeDtypeStruct
    u, zx, s = sds((b, t, e), act_dtype), sds((b, t, in_columns), act_dtype), sds((e,), scale_dtype)
    q = [sds((32,), jnp.float32)]
    act = jnp.dtype(act_dtype)
    if direction == "forward":
        store = jnp.dtype(jnp.float8_e4m3fn if fp8 else act)
        return lowers(_forward, u, zx, s, *(q if fp8 else []), groups=groups, eps=1e-5, out_dtype=act,
                      store_dtype=store, fp8=fp8, interpret=False)
    return lowers(_backward, u, zx, s, u, *(q if fp8 else []), groups=groups, eps=1e-5,
                  dz_dtype=jnp.dtype(jnp.float8_e5m2 if fp8 else act), fp8=fp8, interpret=False)
