"""The Mamba-2 mixer's epilogue as Pallas kernels, forward and backward: the SiLU gate and the
RMSNorm per group,

    g = u * silu(z),   out = g * rsqrt(mean over the group of g^2 + eps) * scale

with u the SSD output with its D skip already added ([B, T, E]; the SSD kernel adds D x, where
it holds x anyway) and z the first E columns of the in_proj output, read in place (no sliced
copy).

Why a kernel: in XLA, the parameter gradient of this epilogue (the norm scale) is a
reduction over (B, T), and it made XLA's layout assignment give the [B, T, E] gradients a
T-minor layout, with transposes of several [B, T, E] arrays around them in every Mamba layer
(H100 profile, 2026-11-22/23). Here a forward program holds a [Tr, Eg] block (whole rows of one group,
4096 elements) and reads and writes it once, as it lies in memory; a backward program walks 16
rows that way and sums the scale's gradient over them (partial sums that XLA adds up).
(A first version walked each group in 256-column steps, twice: with Eg = 4096 the second walk
read from memory again and both kernels were 2-4x slower than one pass.)

Backward, with r = rsqrt(mean g^2 + eps) per row and group, and Eg the group width:

    dg = r scale dout - g r^3 mean(g scale dout)
    du = dg z sig(z);  dz = dg u sig(z) (1 + z (1 - sig(z)))
    dscale = sum over rows of dout g r

Hand-written for the same reason as ``conv_kernel``; it runs in interpret mode off GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from maxfp4.kernels.epilogue import Quantize, Quantized
from maxfp4.kernels.launch import pallas_call, triton_params

_TILE_ELEMENTS = 4096  # elements of one [Tr, Eg] tile: a row block of one group, held whole
_BLOCK_ROWS = 16  # rows one backward program walks (its parameter-gradient partial sums cover them)
# Triton warps per program. The backward holds about twice the forward's live values per row
# (three inputs, two gradients); 16 warps spread them (H200, mamba2-1p3b shapes, the kernel and
# its XLA epilogue: 0.70 ms with 8 warps, 0.48 with 16; the forward is no faster with 16).
_FORWARD_WARPS, _BACKWARD_WARPS = 8, 16


def _tile_rows(group_width: int) -> int:
    """Rows of a tile: as many as fit, up to the backward's block (which walks whole tiles)."""
    return min(_BLOCK_ROWS, max(1, _TILE_ELEMENTS // group_width))


def gated_norm_supported(t: int, e: int, groups: int) -> bool:
    """Triton tiles are powers of two: the group width must be one, from 16 up to the tile size
    (a row of the group is held whole), and T a multiple of the backward's 16-row blocks."""
    if e % groups or t % _BLOCK_ROWS:
        return False
    eg = e // groups
    return 16 <= eg <= _TILE_ELEMENTS and eg & (eg - 1) == 0


def _gate(u_ref, z_ref, cdt, bi, t0, tr, c0, eg):
    """u, z and sigmoid(z) of the [tr, eg] tile at row t0, column c0, in the compute dtype cdt
    (FP32, or float64 in tests)."""
    rows, cols = pl.ds(t0, tr), pl.ds(c0, eg)
    z = z_ref[bi, rows, cols].astype(cdt)
    return u_ref[bi, rows, cols].astype(cdt), z, jax.nn.sigmoid(z)


def _normed(u_ref, z_ref, scale_ref, bi, t0, tr, c0, eg, eps):
    """The epilogue's value on the [tr, eg] tile at row t0, column c0, in the compute dtype."""
    u, z, sz = _gate(u_ref, z_ref, scale_ref.dtype, bi, t0, tr, c0, eg)
    g = u * z * sz
    r = jax.lax.rsqrt(jnp.mean(g * g, axis=1, keepdims=True) + eps)
    return g * r * scale_ref[pl.ds(c0, eg)][None, :]


def _forward_kernel(u_ref, z_ref, scale_ref, out_ref, *, eg, tr, eps):
    bi, t0, c0 = pl.program_id(0), pl.program_id(1) * tr, pl.program_id(2) * eg
    out = _normed(u_ref, z_ref, scale_ref, bi, t0, tr, c0, eg, eps)
    out_ref[bi, pl.ds(t0, tr), pl.ds(c0, eg)] = out.astype(out_ref.dtype)


def _forward_kernel_fp8(u_ref, z_ref, scale_ref, qscale_ref, out_ref, amax_ref, *, eg, tr, eps, quantized):
    """The forward storing FP8 (an ``fp8_epilogue.Quantized``: the value rounded to the output
    dtype the BF16 path stores, then scaled, clipped and cast) and each column's max of the
    rounded |value| over the program's rows. A program walks _BLOCK_ROWS rows, as the backward
    does, so the maxima are a sixteenth of the output's rows."""
    bi, ti, c0 = pl.program_id(0), pl.program_id(1), pl.program_id(2) * eg

    def rows(i, amax):
        t0 = ti * _BLOCK_ROWS + i * tr
        out = quantized.round(_normed(u_ref, z_ref, scale_ref, bi, t0, tr, c0, eg, eps))
        out_ref[bi, pl.ds(t0, tr), pl.ds(c0, eg)] = quantized.cast(out, qscale_ref[0], out_ref.dtype)
        return jnp.maximum(amax, jnp.max(jnp.abs(out), axis=0))

    amax_ref[bi, ti, pl.ds(c0, eg)] = jax.lax.fori_loop(0, _BLOCK_ROWS // tr, rows, jnp.zeros((eg,), jnp.float32))


def _backward_kernel(u_ref, z_ref, scale_ref, dout_ref, *refs, eg, tr, eps, quantized=None):
    """``quantized`` (an ``fp8_epilogue.Quantized``): dz is stored as FP8,
    ``fp8(clip(dz_rounded * s))`` with dz first rounded to the activation dtype as the BF16 path
    stores it, and each column's max of |dz_rounded| over the program's rows goes to
    ``amax_ref``."""
    if quantized is None:
        (du_ref, dz_ref, dscale_ref), qscale_ref, amax_ref = refs, None, None
    else:
        qscale_ref, du_ref, dz_ref, dscale_ref, amax_ref = refs
    bi, ti, c0 = pl.program_id(0), pl.program_id(1), pl.program_id(2) * eg
    cols = pl.ds(c0, eg)
    scale = scale_ref[cols][None, :]

    def rows(i, carry):
        dscale_sum, amax = carry
        t0 = ti * _BLOCK_ROWS + i * tr
        u, z, sz = _gate(u_ref, z_ref, scale.dtype, bi, t0, tr, c0, eg)
        g = u * z * sz
        dout = dout_ref[bi, pl.ds(t0, tr), cols].astype(g.dtype)
        r = jax.lax.rsqrt(jnp.mean(g * g, axis=1, keepdims=True) + eps)
        dg = r * scale * dout - g * (r * r * r * jnp.mean(g * scale * dout, axis=1, keepdims=True))
        du = dg * z * sz
        du_ref[bi, pl.ds(t0, tr), cols] = du.astype(du_ref.dtype)
        dz = dg * u * sz * (1.0 + z * (1.0 - sz))
        if quantized is None:
            dz_ref[bi, pl.ds(t0, tr), cols] = dz.astype(dz_ref.dtype)
        else:
            dz = quantized.round(dz)
            amax = jnp.maximum(amax, jnp.max(jnp.abs(dz), axis=0))
            dz_ref[bi, pl.ds(t0, tr), cols] = quantized.cast(dz, qscale_ref[0], dz_ref.dtype)
        return dscale_sum + jnp.sum(dout * g * r, axis=0), amax

    init = (jnp.zeros((eg,), scale.dtype), jnp.zeros((eg,), jnp.float32))
    dscale, amax = jax.lax.fori_loop(0, _BLOCK_ROWS // tr, rows, init)
    dscale_ref[bi, ti, cols] = dscale
    if amax_ref is not None:
        amax_ref[bi, ti, cols] = amax


def _launch(kernel, rows_per_program, num_warps, b, t, e, groups, eps, interpret, out_shape, *args):
    eg = e // groups
    kernel = functools.partial(kernel, eg=eg, tr=_tile_rows(eg), eps=eps)
    params = triton_params(interpret, num_warps)
    whole = [pl.no_block_spec] * len(args)
    outs = [pl.no_block_spec] * len(out_shape)
    return pallas_call(kernel, grid=(b, t // rows_per_program, groups), in_specs=whole, out_specs=outs,
                          out_shape=out_shape, interpret=interpret, **params)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def gated_norm_fused(u_BTE: jax.Array, zxbcdt_BTI: jax.Array, scale_E: jax.Array, groups: int, eps: float,
                     out_dtype, interpret: bool) -> jax.Array:
    """RMSNorm per group of u * silu(z) times scale, in out_dtype; z is the first E columns of
    zxbcdt_BTI."""
    return gated_norm_forward(u_BTE, zxbcdt_BTI, scale_E, groups, eps, out_dtype, interpret)[0]


def _compute_dtype(u_BTE):
    return jnp.promote_types(u_BTE.dtype, jnp.float32)


def gated_norm_forward(u_BTE, zxbcdt_BTI, scale_E, groups, eps, out_dtype, interpret,
                       quantize: Quantize | None = None):
    """(``gated_norm_fused``'s value, the residuals ``gated_norm_backward`` takes).

    With ``quantize`` the value is stored in its FP8 format instead (rounded to ``out_dtype``
    first, ``fp8_epilogue.Quantize`` says the rest) and comes back as ``(q, max |value|)``."""
    b, t, e = u_BTE.shape
    cdt = _compute_dtype(u_BTE)
    inputs = (u_BTE, zxbcdt_BTI, scale_E.astype(cdt))
    if quantize is None:
        (out,) = _launch(_forward_kernel, _tile_rows(e // groups), _FORWARD_WARPS, b, t, e, groups, eps, interpret,
                         [jax.ShapeDtypeStruct((b, t, e), out_dtype)], *inputs)
        return out, (u_BTE, zxbcdt_BTI, scale_E)
    kernel = functools.partial(_forward_kernel_fp8, quantized=Quantized(out_dtype))
    q, amax_parts = _launch(kernel, _BLOCK_ROWS, _FORWARD_WARPS, b, t, e, groups, eps, interpret,
                            [jax.ShapeDtypeStruct((b, t, e), quantize.dtype),
                             jax.ShapeDtypeStruct((b, t // _BLOCK_ROWS, e), jnp.float32)],
                            *inputs, jnp.reshape(quantize.scale, (1,)).astype(jnp.float32))
    return (q, jnp.max(amax_parts)), (u_BTE, zxbcdt_BTI, scale_E)


def _bwd(groups, eps, out_dtype, interpret, residuals, dout_BTE):
    du, dz_BTI, dscale = gated_norm_backward(residuals, dout_BTE, groups, eps, interpret)
    # The gradient of the wider in_proj output whose first E columns were read: the rest is zero.
    return du, dz_BTI.at[..., du.shape[-1]:].set(0), dscale


def gated_norm_backward(residuals, dout_BTE: jax.Array, groups: int, eps: float, interpret: bool,
                        quantize: Quantize | None = None):
    """(du, dz, dscale) from the forward residuals (``gated_norm_forward``). dz has the shape of the in_proj
    output z was read from, [B, T, I], with only its first E columns written: the Mamba-2 mixer
    fills the others in place with the gradients of x, B, C and dt (``gated_norm_fused``'s own
    VJP zeroes them).

    With ``quantize`` dz is written in its FP8 format instead (``fp8_epilogue.Quantize`` says
    how) and a fourth value comes back: ``max |dz|`` over the written columns, in FP32."""
    u_BTE, zxbcdt_BTI, scale_E = residuals
    b, t, e = u_BTE.shape
    cdt = _compute_dtype(u_BTE)
    # Each [B, T, E] gradient is written in its input's dtype (BF16 in training): FP32 copies
    # would double the traffic of the kernel and of the adds that merge them downstream.
    partial = jax.ShapeDtypeStruct((b, t // _BLOCK_ROWS, e), cdt)
    du_shape = jax.ShapeDtypeStruct(u_BTE.shape, u_BTE.dtype)
    inputs = (u_BTE, zxbcdt_BTI, scale_E.astype(cdt), dout_BTE)
    if quantize is None:
        dz_shape = jax.ShapeDtypeStruct(zxbcdt_BTI.shape, zxbcdt_BTI.dtype)
        outs = _launch(_backward_kernel, _BLOCK_ROWS, _BACKWARD_WARPS, b, t, e, groups, eps, interpret,
                       [du_shape, dz_shape, partial], *inputs)
        return _finish(outs, scale_E)
    dz_shape = jax.ShapeDtypeStruct(zxbcdt_BTI.shape, quantize.dtype)
    amax_parts = jax.ShapeDtypeStruct((b, t // _BLOCK_ROWS, e), jnp.float32)
    kernel = functools.partial(_backward_kernel, quantized=Quantized(zxbcdt_BTI.dtype))
    *outs, amax_parts = _launch(kernel, _BLOCK_ROWS, _BACKWARD_WARPS, b, t, e, groups, eps, interpret,
                                [du_shape, dz_shape, partial, amax_parts], *inputs,
                                jnp.reshape(quantize.scale, (1,)).astype(jnp.float32))
    return (*_finish(outs, scale_E), jnp.max(amax_parts))


def _finish(outs, scale_E):
    """(du, dz, dscale) with the scale's partial sums added up."""
    du, dz_BTI, dscale_parts = outs
    return du, dz_BTI, jnp.sum(dscale_parts, axis=(0, 1)).astype(scale_E.dtype)


gated_norm_fused.defvjp(gated_norm_forward, _bwd)
