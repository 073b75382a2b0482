"""The qkv GEMM's output gradient assembled by a Pallas kernel: RoPE's backward on dq and dk and
the interleaving of dq, dk and dv into the [B, T, K, G+2, H] layout of the GEMM's columns, in one
pass that reads each gradient once and writes the result once; optionally stored in FP8 with the
max of its |values| (FP8 delayed scaling on attn_qkv: the E5M2 cast of dY then needs no pass of
its own).

Why a kernel: XLA compiled the same assembly (``attention.assemble_qkv_grad``'s concatenation)
to a loop that moved ~1 TB/s (Llama-3-8B on an H200: 369 us a layer and GPU for 400 MB), and the
FP8 recipe's cast read its output again (152 us); the kernel takes ~0.3 ms for either
(measured 2026-11-26). A program here holds ``rows`` tokens of one KV
head group, G query heads then the key and the value, as blocks of whole half-heads, so every
load and store is a contiguous run of H/2 elements.

Rotation by (cos, -sin) is the transpose of RoPE's rotation by (cos, sin) (``layers.rotate``),
so the gradient of the rotated halves (x1, x2) is (x1 cos + x2 sin, x2 cos - x1 sin), computed
in FP32 and rounded to the gradient's dtype as ``layers.rotate`` rounds it.

Hand-written because no library op fuses a rotation with an interleaving store; it runs in
interpret mode off GPU (tests compare it with the XLA assembly there).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from maxfp4.parallel.mesh import batch_split_axes
from maxfp4.kernels.epilogue import Quantize, Quantized
from maxfp4.kernels.launch import pallas_call, triton_params

ROWS = 16  # tokens a program assembles
NUM_WARPS = 4


def _power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def supported(t: int, g: int, h: int, rows: int = ROWS) -> bool:
    """Triton blocks are powers of two: the query heads per group and half the head size must
    be (a block is [rows, G, H/2]), with H/2 >= 16, and T a multiple of ``rows``."""
    return t % rows == 0 and _power_of_2(g) and h % 2 == 0 and _power_of_2(h // 2) and h // 2 >= 16


def _kernel(dq_ref, dk_ref, dv_ref, *refs, g, h2, rows, rope, quantized):
    refs = list(refs)
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if rope else (None, None)
    qscale_ref = refs.pop(0) if quantized is not None else None
    out_ref = refs.pop(0)
    amax_ref = refs.pop(0) if quantized is not None else None
    bi, ti, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tok = pl.ds(ti * rows, rows)
    lo, hi = pl.ds(0, h2), pl.ds(h2, h2)
    heads = pl.ds(k * g, g)
    if rope:
        cos = cos_ref[bi, tok, 0, :]  # [rows, H/2], FP32
        sin = sin_ref[bi, tok, 0, :]

    def store(value, *index):
        """Writes ``value`` (FP32) at ``out_ref[bi, tok, k, *index]`` in the output's format;
        returns |value| as stored before the FP8 cast (None without quantization)."""
        if quantized is None:
            out_ref[(bi, tok, k, *index)] = value.astype(out_ref.dtype)
            return None
        r = quantized.round(value)
        out_ref[(bi, tok, k, *index)] = quantized.cast(r, qscale_ref[0], out_ref.dtype)
        return jnp.abs(r)

    def rotated_back(x1, x2, c, s):
        return x1 * c + x2 * s, x2 * c - x1 * s

    q1 = dq_ref[bi, tok, heads, lo].astype(jnp.float32)  # [rows, G, H/2]
    q2 = dq_ref[bi, tok, heads, hi].astype(jnp.float32)
    k1 = dk_ref[bi, tok, k, lo].astype(jnp.float32)  # [rows, H/2]
    k2 = dk_ref[bi, tok, k, hi].astype(jnp.float32)
    if rope:
        q1, q2 = rotated_back(q1, q2, cos[:, None, :], sin[:, None, :])
        k1, k2 = rotated_back(k1, k2, cos, sin)
    abs_q = [store(q1, pl.ds(0, g), lo), store(q2, pl.ds(0, g), hi)]
    abs_kv = [store(k1, g, lo), store(k2, g, hi),
              store(dv_ref[bi, tok, k, lo].astype(jnp.float32), g + 1, lo),
              store(dv_ref[bi, tok, k, hi].astype(jnp.float32), g + 1, hi)]
    if amax_ref is not None:
        # Elementwise maxima first, then two reductions: with one reduction per store the FP8
        # kernel was slower than the BF16 one, which writes twice the bytes (Llama-3-8B shapes,
        # an H200: 0.39 ms against 0.32; 0.28 after).
        m_rows = jnp.max(functools.reduce(jnp.maximum, abs_q), axis=1)  # over the G heads: [rows, H/2]
        m_rows = functools.reduce(jnp.maximum, abs_kv, m_rows)
        amax_ref[bi, ti, k, :] = jnp.max(m_rows, axis=0)


def _assemble_local(*arrays, out_dtype, rows, num_warps, rope, quantized, interpret):
    """The kernel on one device's rows; ``arrays``: dq, dk, dv, then (cos, sin) with ``rope``,
    then the FP8 scale [1] with ``quantized``."""
    dq_BTNH, dk_BTKH = arrays[0], arrays[1]
    b, t, n, h = dq_BTNH.shape
    kv = dk_BTKH.shape[2]
    g = n // kv
    kernel = functools.partial(_kernel, g=g, h2=h // 2, rows=rows, rope=rope, quantized=quantized)
    out_shape = [jax.ShapeDtypeStruct((b, t, kv, g + 2, h), out_dtype)]
    if quantized is not None:
        out_shape.append(jax.ShapeDtypeStruct((b, t // rows, kv, h // 2), jnp.float32))
    return tuple(pallas_call(kernel, grid=(b, t // rows, kv), in_specs=[pl.no_block_spec] * len(arrays),
                                out_specs=[pl.no_block_spec] * len(out_shape), out_shape=out_shape,
                                interpret=interpret, **triton_params(interpret, num_warps))(*arrays))


def assemble(dq_BTNH: jax.Array, dk_BTKH: jax.Array, dv_BTKH: jax.Array, tables, interpret: bool,
             quantize: Quantize | None = None, rows: int = ROWS, num_warps: int = NUM_WARPS):
    """The gradient of the qkv GEMM's [B, T, K, G+2, H] output from those of q [B, T, K*G, H]
    (rotated), k [B, T, K, H] (rotated) and v; ``tables`` = RoPE's (cos, sin), [B, T, 1, H/2]
    each, or None without RoPE. In dq's dtype; with ``quantize``, ``(FP8 values, max |value|)``,
    each value rounded to dq's dtype before the cast (``fp8_epilogue.Quantized``).

    Under a mesh that splits the batch (``batch_split_axes``) each device assembles its rows;
    the caller checks ``batch_split_axes`` is not None and ``supported``."""
    split = batch_split_axes(dq_BTNH.shape[0])
    if split is None:
        raise ValueError("qkv_grad_kernel.assemble: the mesh splits more than the batch; assemble in XLA")
    mesh, axes = split
    arrays = [dq_BTNH, dk_BTKH, dv_BTKH]
    if tables is not None:
        arrays += [t_.astype(jnp.float32) for t_ in tables]
    if quantize is not None:
        arrays.append(jnp.reshape(quantize.scale, (1,)).astype(jnp.float32))
    run = functools.partial(_assemble_local, out_dtype=dq_BTNH.dtype if quantize is None else quantize.dtype,
                            rows=rows, num_warps=num_warps, rope=tables is not None,
                            quantized=None if quantize is None else Quantized(dq_BTNH.dtype), interpret=interpret)
    if axes:
        spec, whole = PartitionSpec(axes), PartitionSpec()
        in_specs = tuple(whole if quantize is not None and i == len(arrays) - 1 else spec for i in range(len(arrays)))
        run = jax.shard_map(run, mesh=mesh, in_specs=in_specs,
                            out_specs=(spec,) if quantize is None else (spec, spec), check_vma=False)
    outs = run(*arrays)
    if quantize is None:
        return outs[0]
    return outs[0], jnp.max(outs[1])
