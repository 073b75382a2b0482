"""The MLP activation's backward under FP8 delayed scaling as one Pallas kernel that stores every
FP8 operand the MLP's backward GEMMs read, each in the layout its GEMM reads it.

The GEMMs after the activation's backward read: mlp_up's output gradient dY in E5M2 as [M, K]
for the dgrad and as [K, M] for the wgrad (cuBLASLt takes FP8 only in its TN layout, both
operands contiguous along the contracted dimension), and mlp_down's input h in E4M3 as [F, M] for
its wgrad (K = 2F for SwiGLU's interleaved (gate, up) pairs, F for the squared ReLU). Left to XLA
these took five passes a layer (SwiGLU, Llama-3-8B on an H200, per layer and GPU): the gradients
and the recomputed product written in BF16 (681 us), the E5M2 cast and amax of the pairs (602
us), the E4M3 cast of the product (315 us), and the transposes of both (415 + 202 us). A program
here holds a tile of ``block_m`` tokens by ``block_f`` features (for SwiGLU, pairs read as one
32-bit word each, as ``activations.bf16_pairs_as_fp32`` reads them) and writes all three from
registers: dY (a SwiGLU pair's two bytes as one 16-bit word, the gate's low, as
``fp8_mlp.swiglu_grad_e5m2`` packs them), dY and h transposed, and the max |dY| of its tile.

Every value is the formula of ``fp8_mlp.swiglu_grad_e5m2`` or ``relu2_grad_e5m2`` (and of
``activation_e4m3`` for h): computed in FP32, rounded to BF16 as the BF16 path hands it to the
recipe, then scaled, clipped and cast (``fp8_epilogue.Quantized``). The same bits as those XLA
functions in interpret mode and compiled on an H200 (tests/test_mlp_grad_kernel.py).

Hand-written because no library op writes a tensor and its transpose from one read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import PartitionSpec

from maxfp4.parallel.mesh import batch_split_axes
from maxfp4.kernels.epilogue import Quantized
from maxfp4.kernels.launch import pallas_call, triton_params
from maxfp4.precision.formats import FP8_E4M3, FP8_E5M2

# Tiles (block_m tokens, block_f features: SwiGLU's (gate, up) pairs) and warps: the fastest of
# those tried on an H200 (2026-11-27, the kernel alone), for SwiGLU at Llama-3-8B's and
# dense-1p3b's shapes, for the squared ReLU at hybrid-1b's (and in whole steps).
# block_m is also the length of the runs of bytes the transposed stores write.
TILES = {"swiglu": (64, 32), "relu2": (64, 64)}
NUM_WARPS = 4

_ROUNDED = Quantized(jnp.bfloat16)


def supported(m: int, f: int, block_m: int, block_f: int) -> bool:
    """Tiles must cover the tokens and the features (SwiGLU's pairs) exactly."""
    return m % block_m == 0 and f % block_f == 0


def _fp8_bits(v_f32: jax.Array, scale: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """``v`` rounded to BF16, scaled, clipped and cast to ``dtype``, as its uint8 bits, with the
    rounded value's |v| (what the amax is taken over)."""
    r = _ROUNDED.round(v_f32)
    return jax.lax.bitcast_convert_type(_ROUNDED.cast(r, scale, dtype), jnp.uint8), jnp.abs(r)


def _kernel(y_ref, dh_ref, scales_ref, dy_ref, dy_t_ref, h_t_ref, amax_ref, *, block_m, block_f, kind):
    i, j = pl.program_id(0), pl.program_id(1)
    toks, cols = pl.ds(i * block_m, block_m), pl.ds(j * block_f, block_f)
    dh = dh_ref[toks, cols].astype(jnp.float32)
    dy_scale, h_scale = scales_ref[0], scales_ref[1]
    if kind == "swiglu":
        w = y_ref[toks, cols]  # uint32 [block_m, block_f]: (gate, up) in the (low, high) halves
        g = jax.lax.bitcast_convert_type(w << 16, jnp.float32)
        u = jax.lax.bitcast_convert_type(w & jnp.uint32(0xFFFF0000), jnp.float32)
        # sigmoid written out: Pallas on Triton has no lowering for lax.logistic, and XLA
        # expands it to this formula too.
        sig = 1.0 / (1.0 + jnp.exp(-g))
        grads = [dh * (u * sig * (1.0 + g * (1.0 - sig))), dh * (g * sig)]
        h = g * sig * u  # jax.nn.silu(g) * u, as the forward
    else:
        r = jnp.maximum(y_ref[toks, cols].astype(jnp.float32), 0.0)  # jax.nn.relu
        grads = [2.0 * r * dh]
        h = r * r
    bits, abs_ = zip(*(_fp8_bits(d, dy_scale, FP8_E5M2) for d in grads))
    h_bits, _ = _fp8_bits(h, h_scale, FP8_E4M3)
    if kind == "swiglu":
        dy_ref[toks, cols] = bits[0].astype(jnp.uint16) | (bits[1].astype(jnp.uint16) << 8)
    else:
        dy_ref[toks, cols] = bits[0]
    # The FP8 bytes are transposed, not the FP32 values: transposing those and casting again
    # was no faster (H200).
    for gate, b in enumerate(bits):
        dy_t_ref[cols, gate, toks] = b.T
    h_t_ref[cols, toks] = h_bits.T
    amax_ref[i, cols] = jnp.max(functools.reduce(jnp.maximum, abs_), axis=0)


def _local(y_BTK, dh_BTF, scales, *, kind, block_m, block_f, num_warps, interpret):
    """The kernel on one device's tokens; outputs are the raw bits (see ``activation_grad_fp8``)."""
    b, t, f = dh_BTF.shape
    m = b * t
    gates = 2 if kind == "swiglu" else 1
    y_MF = (jax.lax.bitcast_convert_type(y_BTK.reshape(m, f, 2), jnp.uint32) if gates == 2
            else y_BTK.reshape(m, f))
    out_shape = (jax.ShapeDtypeStruct((m, f), jnp.uint16 if gates == 2 else jnp.uint8),
                 jax.ShapeDtypeStruct((f, gates, m), jnp.uint8), jax.ShapeDtypeStruct((f, m), jnp.uint8),
                 jax.ShapeDtypeStruct((m // block_m, f), jnp.float32))
    kernel = functools.partial(_kernel, block_m=block_m, block_f=block_f, kind=kind)
    return pallas_call(kernel, grid=(m // block_m, f // block_f), in_specs=[pl.no_block_spec] * 3,
                          out_specs=[pl.no_block_spec] * 4, out_shape=out_shape, interpret=interpret,
                          **triton_params(interpret, num_warps))(y_MF, dh_BTF.reshape(m, f), scales)


def activation_grad_fp8(y_BTK: jax.Array, dh_BTF: jax.Array, dy_scale: jax.Array, h_scale: jax.Array, kind: str,
                        interpret: bool, block_m: int | None = None, block_f: int | None = None,
                        num_warps: int = NUM_WARPS):
    """From mlp_up's BF16 output ``y`` ([B, T, K]: for ``kind`` "swiglu" K = 2F interleaved
    (gate, up) pairs, for "relu2" K = F) and the BF16 gradient of the activation ``dh``
    ([B, T, F]), with M = B*T tokens:

    - ``dy``: f8e5m2[B, T, K], mlp_up's output gradient, ``fp8(clip(bf16(dY) * dy_scale))``;
    - ``dy_t``: f8e5m2[K, M], the same values transposed;
    - ``h_t``: f8e4m3fn[F, M], ``fp8(clip(bf16(activation(y)) * h_scale))`` transposed;
    - ``amax_dy``: max |bf16(dY)|.

    Under a mesh that splits only the batch each device runs its own tokens (``batch_split_axes``);
    the caller checks that and ``supported`` for each device's M. Tiles default to ``TILES[kind]``."""
    block_m, block_f = block_m or TILES[kind][0], block_f or TILES[kind][1]
    split = batch_split_axes(y_BTK.shape[0])
    if split is None:
        raise ValueError("mlp_grad_kernel: the mesh splits more than the batch; use the XLA path")
    mesh, axes = split
    scales = jnp.stack([jnp.asarray(dy_scale, jnp.float32), jnp.asarray(h_scale, jnp.float32)])
    run = functools.partial(_local, kind=kind, block_m=block_m, block_f=block_f, num_warps=num_warps,
                            interpret=interpret)
    if axes:
        rows = PartitionSpec(axes)
        run = jax.shard_map(run, mesh=mesh, in_specs=(rows, rows, PartitionSpec()),
                            out_specs=(rows, PartitionSpec(None, None, axes), PartitionSpec(None, axes), rows),
                            check_vma=False)
    dy_MF, dy_t_FGM, h_t_FM, amax_partial = run(y_BTK, dh_BTF, scales)
    b, t, k = y_BTK.shape
    # A SwiGLU word [M, F] is read as [M, F, 2] bytes, low byte first.
    dy_BTK = jax.lax.bitcast_convert_type(dy_MF, FP8_E5M2).reshape(b, t, k)
    dy_t_KM = jax.lax.bitcast_convert_type(dy_t_FGM, FP8_E5M2).reshape(k, b * t)
    return dy_BTK, dy_t_KM, jax.lax.bitcast_convert_type(h_t_FM, FP8_E4M3), jnp.max(amax_partial)
