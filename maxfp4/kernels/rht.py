"""NVFP4's weight-gradient operands with the random Hadamard transform, as two Pallas kernels.

``hadamard_block_dequantize_nvfp4_columns(x_MK, key)`` returns, bit for bit,
``formats.block_dequantize_nvfp4_columns(formats.hadamard16(x_MK, axis=0), key)``: the 16-point
Hadamard transform down every group of 16 tokens, then NVFP4 with blocks of 16 tokens (the same
groups), block-dequantized in x's own [M, K] layout for the emulated BF16 GEMM. With
``rht_bf16`` the transform is rounded to BF16 first (``formats.round_bf16``), as Transformer
Engine's RHT cast kernel does, in both passes.

Why kernels: in XLA the transform fuses into the quantizer's two passes (amaxes, then elements),
and each output element re-evaluates its whole butterfly tree (16 loads and the index arithmetic
of the pairings) in both. On an H100, with a 16384 x 2048 x 5632 layer, the transform made
the emulated NVFP4 layer 1.4 ms slower (2026-11-25). Here a program holds one group
of 16 rows of a column tile, as 16 row vectors, and transforms them once with 32 adds per
column; a group is also an NVFP4 block, so its amax is a maximum over the 16 vectors.

  pass 1 (kernel): transform, block amax              -> f32[M/16, K]
  between (XLA):   the tensor amax, E4M3 block scales and encode factors (formats.nvfp4_block_scales)
  pass 2 (kernel): transform again, scale, round to E2M1 (stochastically, with random words
                   hashed in the kernel as formats draws them), times the block scale -> [M, K]

The random words are hashed inside pass 2 (formats.threefry2x32) rather than drawn by XLA
into an array the kernel reads: a separate draw was a compute-bound pass of its own (145 us for
the words of a [16384, 5632] dY on an H100), while inside the kernel the hash runs as the
program waits on memory.

On a mesh whose batch axes split the tokens, each device runs both kernels on its own rows
(``mesh`` and ``row_axes``): XLA cannot partition a kernel and would otherwise gather the whole
operand onto every device. Only the tensor amax crosses devices (one scalar max); each row's
random words are those of its global position, so the bits equal one device's.

Every operation is the one ``formats`` performs, in the same order (the butterflies pair the
same elements; rounding is formats.round_e2m1 itself), so the result equals the XLA path's on
any backend; off GPU the kernels run in interpret mode.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from maxfp4.parallel.mesh import split_size
from maxfp4.kernels.launch import pallas_call, triton_params
from maxfp4.precision import formats as F

_GROUP = F.NVFP4_BLOCK  # rows of a Hadamard group, which is also an NVFP4 block
_COLUMN_TILES = (512, 256, 128, 64, 32, 16)  # columns a program takes: the widest dividing K
_NUM_WARPS = 4


def _column_tile(k: int) -> int | None:
    return next((t for t in _COLUMN_TILES if k % t == 0), None)


def rht_columns_supported(m: int, k: int, devices: int = 1) -> bool:
    """Whole groups of 16 rows on each of ``devices`` that split the rows, and a power-of-two
    column tile (Triton's) that divides K."""
    return m % (_GROUP * devices) == 0 and _column_tile(k) is not None


def _transformed_rows(x_ref, g, c0, bk, rht_bf16) -> list[jax.Array]:
    """``hadamard16`` of rows 16 g .. 16 g + 15, columns c0 .. c0 + bk: 16 float32 vectors.
    The signs first, then the butterflies (bit 3 first: element i with the bit clear becomes
    a + b and its partner a - b, as formats.walsh16 pairs them), then 1/4; then, with
    ``rht_bf16``, the rounding to BF16 values."""
    rows = [x_ref[g * _GROUP + i, pl.ds(c0, bk)].astype(jnp.float32) * jnp.float32(sign)
            for i, sign in enumerate(F.HADAMARD16_SIGNS)]
    for bit in (3, 2, 1, 0):
        stride = 1 << bit
        for i in range(_GROUP):
            if not i & stride:
                a, b = rows[i], rows[i | stride]
                rows[i], rows[i | stride] = a + b, a - b
    rows = [r * jnp.float32(0.25) for r in rows]
    return [F.round_bf16(r) for r in rows] if rht_bf16 else rows


def _amax_kernel(x_ref, amax_ref, *, bk, rht_bf16):
    g, c0 = pl.program_id(0), pl.program_id(1) * bk
    rows = _transformed_rows(x_ref, g, c0, bk, rht_bf16)
    amax_ref[g, pl.ds(c0, bk)] = functools.reduce(jnp.maximum, [jnp.abs(r) for r in rows])


def _block_words(stream_ref, g, c0, bk, groups) -> list[jax.Array]:
    """The four random words of block g in each column c0 .. c0 + bk, as formats draws them for
    the [K, M] transpose: words (column, g, 0..3) of a [K, M/16, 4] draw. ``stream_ref`` holds
    the uint32 threefry key and the global index of this operand's first group (its first row
    / 16: nonzero for a device's rows of a tensor split over the mesh)."""
    key = (stream_ref[0], stream_ref[1])
    column = (c0 + jnp.arange(bk, dtype=jnp.int32)).astype(jnp.uint32)
    first = (column * jnp.uint32(groups) + (g.astype(jnp.uint32) + stream_ref[2])) * jnp.uint32(4)
    return [F.random_words_at(key, first + jnp.uint32(w)) for w in range(4)]


def _quantize_kernel(x_ref, enc_ref, scale_ref, *refs, bk, groups, stochastic, rht_bf16):
    stream_ref, out_ref = refs if stochastic else (None, refs[0])
    g, c0 = pl.program_id(0), pl.program_id(1) * bk
    cols = pl.ds(c0, bk)
    enc, scale = enc_ref[g, cols], scale_ref[g, cols]
    words = _block_words(stream_ref, g, c0, bk, groups) if stochastic else None
    for i, row in enumerate(_transformed_rows(x_ref, g, c0, bk, rht_bf16)):
        # Row i of the group is element i of its block: byte i % 4 of the block's word i // 4.
        rand = F.byte_of_word(words[i // 4], i % 4) if stochastic else None
        q = F.round_e2m1(F.scale_to_e2m1_range(row, enc), rand)
        out_ref[g * _GROUP + i, cols] = (q * scale).astype(out_ref.dtype)


def _launch(kernel, grid, out_shape, interpret, *args):
    whole = [pl.no_block_spec] * len(args)
    return pallas_call(kernel, grid=grid, in_specs=whole, out_specs=pl.no_block_spec, out_shape=out_shape,
                          interpret=interpret, **triton_params(interpret, _NUM_WARPS))(*args)


def _rows_kernels(x_MK, word_key, dtype, interpret, row_axes, all_groups, rht_bf16):
    """Both passes over the rows this device holds (all of them when ``row_axes`` is empty)."""
    m, k = x_MK.shape
    bk = _column_tile(k)
    grid = (m // _GROUP, k // bk)
    block_amax = _launch(functools.partial(_amax_kernel, bk=bk, rht_bf16=rht_bf16), grid,
                         jax.ShapeDtypeStruct((m // _GROUP, k), jnp.float32), interpret, x_MK)
    amax = jax.lax.pmax(jnp.max(block_amax), row_axes) if row_axes else None
    s_e4m3, enc, s_dec = F.nvfp4_block_scales(block_amax, amax)
    args = [x_MK, enc, s_e4m3.astype(jnp.float32)]
    if word_key is not None:
        first_group = jax.lax.axis_index(row_axes) * (m // _GROUP) if row_axes else 0
        args.append(jnp.concatenate([word_key, jnp.asarray(first_group, jnp.uint32)[None]]))
    kernel = functools.partial(_quantize_kernel, bk=bk, groups=all_groups, stochastic=word_key is not None,
                               rht_bf16=rht_bf16)
    v = _launch(kernel, grid, jax.ShapeDtypeStruct((m, k), dtype), interpret, *args)
    return v, s_dec.astype(jnp.float32)


def hadamard_block_dequantize_nvfp4_columns(x_MK: jax.Array, key: jax.Array | None = None, dtype=jnp.bfloat16,
                                            interpret: bool = False, *, mesh=None,
                                            row_axes: tuple[str, ...] = (),
                                            rht_bf16: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(v_MK, S_dec)``, equal bit for bit to
    ``formats.block_dequantize_nvfp4_columns(formats.hadamard16(x_MK, axis=0), key, dtype)``
    (see the module docstring), or with ``rht_bf16`` to the same of
    ``formats.round_bf16(formats.hadamard16(x_MK, axis=0))`` (TE's kernel). With ``mesh`` and
    ``row_axes`` (mesh axes that split x's rows) each device transforms and quantizes its own
    rows; v comes back split the same way. Needs ``rht_columns_supported`` for the rows of one
    device."""
    m, k = x_MK.shape
    devices = split_size(mesh, row_axes)
    if not rht_columns_supported(m, k, devices):
        raise ValueError(f"hadamard_block_dequantize_nvfp4_columns: shape {x_MK.shape} needs rows divisible by "
                         f"{_GROUP} x {devices} device(s) and columns divisible by {_COLUMN_TILES[-1]}")
    word_key = None
    if key is not None:
        F.check_word_count((k, m // _GROUP, 4))  # the words of the [K, M/16, 4] draw (_block_words)
        word_key = F.random_word_key(key)
    run = functools.partial(_rows_kernels, dtype=dtype, interpret=interpret, row_axes=tuple(row_axes),
                            all_groups=m // _GROUP, rht_bf16=rht_bf16)
    if not row_axes:
        return run(x_MK, word_key)
    rows, whole = PartitionSpec(tuple(row_axes), None), PartitionSpec()
    # check_vma=False: the kernels' outputs carry no varying-axis type (as mesh.per_batch_row).
    return jax.shard_map(run, mesh=mesh, in_specs=(rows, whole), out_specs=(rows, whole),
                         check_vma=False)(x_MK, word_key)
