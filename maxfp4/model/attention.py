"""Grouped-query causal self-attention over packed sequences.

Segment ids keep packed documents apart: a token attends only to earlier tokens of its own
segment. Scores, softmax and the value product are never quantized.

Implementations (``model.attention``):

- ``cudnn`` (what ``auto`` picks on GPU): cuDNN's fused kernel in its packed ("ragged") layout.
  Each run of equal segment ids in a row is handed to the kernel as a sequence of its own (its
  start offset and length), so the kernel skips the tiles across documents and reads no mask.
  The layout has a static number of runs per row (``model.attention_max_segments``, and
  smaller capacities below it: :func:`packed_capacities`); a batch with a row of more runs
  takes the masked kernel below instead (a ``lax.switch``, so the result never depends on the
  cap, only the speed does). When the data bounds the runs per row in advance (``runs_per_row``:
  the trainer knows it from the packing layout, and synthetic rows are one run), the kernel is
  chosen while tracing and no switch is compiled: on GPU a switch makes the host wait for its
  branch index in the middle of the step, twice per attention layer. Rows of one run take
  cuDNN's plain causal kernel: the packed layout's backward pass adds zeroed FP32 accumulators
  and per-head reductions (Llama-3-8B, 2 x H200: 1.7% of the BF16 step).
- ``cudnn_mask``: cuDNN's fused kernel with the segment mask as an additive [B, 1, T, T] bias.
  It reads the bias in the forward and backward kernels and writes its gradient in the
  backward kernel (JAX always asks cuDNN for it), which made it the slower of the two.
- ``xla``: plain XLA (scores materialised); the CPU path and the reference of the GPU tests.

Under ``shard_map`` (pipeline stages, context ranks), and on a mesh of several devices (under
``shard_map`` then, over the batch and head axes), the cuDNN kernels are bound directly
(:mod:`maxfp4.kernels.cudnn_attention`): jax's entry wraps them for GSPMD's partitioner, which
does not compile inside a manual region and failed on a batch-split mask. One device keeps
jax's entry.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from maxfp4.config import ModelConfig
from maxfp4.parallel.context import context_attention, context_ranks
from maxfp4.parallel.mesh import batch_split_axes, logical_to_spec, traced_mesh
from maxfp4.kernels import cudnn_attention, qkv_grad as qkv_grad_kernel
from maxfp4.kernels.epilogue import Quantize
from maxfp4.model.layers import linear, rope_tables, rotate
from maxfp4.model_spec import mixer_linears
from maxfp4.model.remat import tag_attention_output
from maxfp4.kernels.launch import kernels_on_gpu, on_gpu
from maxfp4.precision import GEMM_OUT, LayerPrecision
from maxfp4.precision.formats import quantize_fp8


def resolve_implementation(name: str) -> str:
    """``auto`` picks cuDNN's fused kernel on GPU and XLA elsewhere."""
    if name == "auto":
        return "cudnn" if on_gpu() else "xla"
    return name


def segment_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """[B, 1, T, T] True where query and key share a segment (causality is added separately)."""
    return (segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :])


def segment_runs(segment_ids_BT: jax.Array, max_runs: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The packed layout of each row: its runs of equal segment ids (documents, and the padding
    tail as one more run, so every token belongs to a run and gets an output).

    Returns ``lengths_BM`` (int32 [B, M]: run lengths, -1 past the row's last run),
    ``starts_BM`` (int32 [B, M]: run start offsets, -1 past the last run) and ``runs_B``
    (int32 [B]: runs in the row; rows with more than M runs are not described correctly and
    must not take the packed kernel). The first m columns describe the rows for m slots.
    """
    b, t = segment_ids_BT.shape
    new_run_BT = jnp.concatenate(
        [jnp.ones((b, 1), bool), segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]], axis=1)
    run_BT = jnp.cumsum(new_run_BT, axis=1, dtype=jnp.int32) - 1
    runs_B = run_BT[:, -1] + 1
    m_M = jnp.arange(max_runs, dtype=jnp.int32)
    lengths_BM = jnp.sum(run_BT[:, :, None] == m_M, axis=1, dtype=jnp.int32)
    starts_BM = jnp.cumsum(lengths_BM, axis=1, dtype=jnp.int32) - lengths_BM
    present_BM = m_M < runs_B[:, None]
    lengths_BM = jnp.where(present_BM, lengths_BM, -1)
    starts_BM = jnp.where(present_BM, starts_BM, -1)
    return lengths_BM, starts_BM, runs_B


def _under_shard_map() -> bool:
    """Whether the trace is inside ``shard_map``, where every array is one device's block."""
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def _cudnn_on_each_device(q_BTNH, k_BTKH, v_BTKH, rows: tuple, mask_of: Callable[..., cudnn_attention.Mask]):
    """cuDNN's kernel with the mask ``mask_of(*rows)`` (``rows``: arrays with the batch first), run
    on each device's rows and heads when the traced mesh splits them: the direct binding under
    ``shard_map``. jax's public entry, which GSPMD partitions, failed to build its cuDNN graph for a
    batch-split mask on two H200s (jax 0.11.2: "dimensions mismatch as broadcasting 2 non-one
    dimension sizes"); per device every array is one block and the kernel sees no sharding."""
    def run(q, k, v, *row_arrays):
        return cudnn_attention.attention(q, k, v, mask_of(*row_arrays))

    if _under_shard_map():
        return run(q_BTNH, k_BTKH, v_BTKH, *rows)
    mesh = traced_mesh()
    q_spec = logical_to_spec(("batch", "seq", "heads", "head_dim"), q_BTNH.shape, mesh)
    kv_spec = logical_to_spec(("batch", "seq", "kv_heads", "head_dim"), k_BTKH.shape, mesh)
    row_specs = tuple(PartitionSpec(q_spec[0], *([None] * (r.ndim - 1))) for r in rows)
    return jax.shard_map(run, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec) + row_specs, out_specs=q_spec,
                         check_vma=False)(q_BTNH, k_BTKH, v_BTKH, *rows)


def _one_device() -> bool:
    """Whether the trace is outside ``shard_map`` and its mesh (if any) has one device."""
    mesh = traced_mesh()
    return not _under_shard_map() and (mesh is None or mesh.size == 1)


def _cudnn_causal(q_BTNH, k_BTKH, v_BTKH):
    if _one_device():  # jax's public entry: the one-GPU step as measured (docs/PERFORMANCE.md)
        return jax.nn.dot_product_attention(q_BTNH, k_BTKH, v_BTKH, is_causal=True, implementation="cudnn")
    return _cudnn_on_each_device(q_BTNH, k_BTKH, v_BTKH, (), lambda: cudnn_attention.Mask(causal=True))


def _cudnn_packed(q_BTNH, k_BTKH, v_BTKH, lengths_BM, starts_BM):
    if not _one_device():
        return _cudnn_on_each_device(q_BTNH, k_BTKH, v_BTKH, (lengths_BM, starts_BM), lambda lengths, starts:
                                     cudnn_attention.Mask(causal=True, lengths_BM=lengths, starts_BM=starts))
    # jax.nn.dot_product_attention does not take segment offsets; the cuDNN module behind it
    # does (the packed layout of jax's own sequence-packing tests). Its offsets are [B, M+1],
    # the last column -1.
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    starts_BM1 = jnp.concatenate([starts_BM, jnp.full((starts_BM.shape[0], 1), -1, jnp.int32)], axis=1)
    return dot_product_attention(
        q_BTNH, k_BTKH, v_BTKH, q_seqlen=lengths_BM, kv_seqlen=lengths_BM, q_offsets=starts_BM1,
        kv_offsets=starts_BM1, scale=q_BTNH.shape[-1] ** -0.5, mask_type=MaskType.PADDING_CAUSAL)


def _masked(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, implementation):
    if implementation == "cudnn" and not _one_device():
        return _cudnn_on_each_device(q_BTNH, k_BTKH, v_BTKH, (segment_ids_BT,), lambda segment_ids:
                                     cudnn_attention.Mask(causal=True, allowed_B1TS=segment_mask(segment_ids)))
    return jax.nn.dot_product_attention(
        q_BTNH, k_BTKH, v_BTKH, mask=segment_mask(segment_ids_BT), is_causal=True,
        implementation=implementation)


def packed_capacities(max_segments: int) -> tuple[int, ...]:
    """The packed kernels compiled for a cap of ``max_segments`` runs per row, smallest first.

    The packed kernel's grid covers every (row, run slot, head, query tile), empty slots
    included, so a smaller capacity is faster when the rows hold few documents (one H200,
    dense-1p3b's attention, one document a row: forward + backward 2.31 ms at 8 slots, 2.59 at
    16, 2.93 at 32, against 2.08 without segments and 2.95 masked). The batch picks the
    smallest capacity that holds its fullest row."""
    return tuple(m for m in (4, 16) if m < max_segments) + (max_segments,)


def static_kernel(max_segments: int, runs_per_row: int) -> int | str:
    """The cuDNN kernel for batches known to hold at most ``runs_per_row`` runs in any row:
    ``"causal"`` for one run a row (every row one document: plain causal attention, cuDNN's
    kernel without the packed layout), else the smallest packed capacity that holds them, else
    ``"masked"``."""
    if runs_per_row < 1:
        raise ValueError(f"runs_per_row={runs_per_row}: expected at least 1")
    if runs_per_row == 1:
        return "causal"
    return next((m for m in packed_capacities(max_segments) if m >= runs_per_row), "masked")


def _in_pipeline_stage() -> bool:
    return "pipeline" in jax.sharding.get_abstract_mesh().manual_axes


def stage_implementation(implementation: str, runs_per_row: int | None) -> str:
    """The implementation a pipeline stage runs (``implementation`` outside one). XLA (jax 0.11.2)
    segfaults compiling cuDNN's packed or masked kernel inside the stages' ``shard_map`` (Shardy's
    ManualComputationUnusedInputsPattern; two H200s, dense and hybrid alike), while cuDNN's causal
    kernel compiles and runs there: a stage keeps cuDNN for rows known to hold one document
    (``runs_per_row`` 1, as synthetic data's) and runs XLA's attention for any other rows.
    Unequal stages' slots run XLA's attention whatever the rows
    (maxfp4.parallel.pipeline_stages.StageProgram.stage_model)."""
    if not _in_pipeline_stage() or implementation not in ("cudnn", "cudnn_mask"):
        return implementation
    return "cudnn" if implementation == "cudnn" and runs_per_row == 1 else "xla"


def attend(q_BTNH: jax.Array, k_BTKH: jax.Array, v_BTKH: jax.Array, segment_ids_BT: jax.Array,
           implementation: str, max_segments: int = 16, runs_per_row: int | None = None) -> jax.Array:
    """``runs_per_row``: a bound on the runs of equal segment ids in every row of every batch
    this is traced for, when the caller knows one (see the module docstring); None decides per
    batch on the device."""
    if context_ranks() > 1:  # the sequence is split over the context axis (maxfp4.parallel.context)
        return context_attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, implementation)
    implementation = stage_implementation(implementation, runs_per_row)
    if implementation != "cudnn":
        kernel = "cudnn" if implementation == "cudnn_mask" else implementation
        return _masked(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, kernel)
    if runs_per_row is not None:
        kernel = static_kernel(max_segments, runs_per_row)
        if kernel == "causal":
            return _cudnn_causal(q_BTNH, k_BTKH, v_BTKH)
        if kernel == "masked":
            return _masked(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, "cudnn")
        lengths_BM, starts_BM, _ = segment_runs(segment_ids_BT, kernel)
        return _cudnn_packed(q_BTNH, k_BTKH, v_BTKH, lengths_BM, starts_BM)
    capacities = packed_capacities(max_segments)
    lengths_BM, starts_BM, runs_B = segment_runs(segment_ids_BT, max_segments)

    def packed(m):
        return lambda q, k, v: _cudnn_packed(q, k, v, lengths_BM[:, :m], starts_BM[:, :m])

    # Branch i: the i-th capacity holds every row; the last branch is the masked kernel.
    branch = jnp.sum(jnp.max(runs_B) > jnp.asarray(capacities, jnp.int32))
    return jax.lax.switch(
        branch, [packed(m) for m in capacities] + [lambda q, k, v: _masked(q, k, v, segment_ids_BT, "cudnn")],
        q_BTNH, k_BTKH, v_BTKH)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def split_heads(qkv_BTKGH: jax.Array, positions_BT: jax.Array,
                rope_theta: float | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(q [B, T, K*G, H], k [B, T, K, H], v [B, T, K, H]) from the qkv GEMM's [B, T, K, G+2, H]
    output; q and k rotated when ``rope_theta`` is set."""
    return _split_heads_fwd(qkv_BTKGH, positions_BT, rope_theta)[0]


def _split_heads_fwd(qkv_BTKGH, positions_BT, rope_theta):
    b, t, k, g2, h = qkv_BTKGH.shape
    g = g2 - 2
    q_BTNH = qkv_BTKGH[:, :, :, :g, :].reshape(b, t, k * g, h)
    k_BTKH = qkv_BTKGH[:, :, :, g, :]
    v_BTKH = qkv_BTKGH[:, :, :, g + 1, :]
    tables = None
    if rope_theta is not None:
        # Computed once for q and k, and kept for the backward pass ([B, T, 1, H/2] each):
        # recomputed there, XLA evaluated sin and cos inside the gradient's assembly, once per
        # head and element.
        tables = jax.lax.optimization_barrier(rope_tables(positions_BT, rope_theta, h))
        q_BTNH, k_BTKH = rotate(q_BTNH, *tables), rotate(k_BTKH, *tables)
    return (q_BTNH, k_BTKH, v_BTKH), tables


def _split_heads_bwd(rope_theta, tables, cotangents):
    return assemble_qkv_grad(*cotangents, tables), None


def assemble_qkv_grad(dq_BTNH: jax.Array, dk_BTKH: jax.Array, dv_BTKH: jax.Array, tables,
                      quantize: Quantize | None = None, kernel: bool | None = None):
    """The qkv GEMM's [B, T, K, G+2, H] output gradient from the gradients of ``split_heads``'s
    outputs (``tables``: its RoPE tables, or None); with ``quantize``, stored in that FP8 format
    as ``quantize_fp8`` casts the BF16 gradient, with the max of its |values|.

    ``kernel``: assemble with ``qkv_grad_kernel`` (interpret mode off GPU); None picks it on GPU
    for the shapes it supports when the mesh splits nothing but the batch."""
    b, t, n, h = dq_BTNH.shape
    kv = dk_BTKH.shape[2]
    if kernel is None:
        kernel = (kernels_on_gpu() and qkv_grad_kernel.supported(t, n // kv, h)
                  and batch_split_axes(b) is not None)
    if kernel:
        return qkv_grad_kernel.assemble(dq_BTNH, dk_BTKH, dv_BTKH, tables, not on_gpu(), quantize)
    # In XLA, one concatenation. Autodiff of the slicing transposes each slice to a zero-padded
    # copy of the whole [B, T, K, G+2, H] tensor, and of RoPE's halves to padded halves, all
    # added up: XLA computed that sum in one pass at ~1 TB/s (Llama-3-8B on an H200: 409 us a
    # layer for two sequences, where reading and writing the bytes once takes ~100).
    if tables is not None:
        cos, sin = tables
        dq_BTNH, dk_BTKH = rotate(dq_BTNH, cos, -sin), rotate(dk_BTKH, cos, -sin)
    dq_BTKGH = dq_BTNH.reshape(b, t, kv, n // kv, h)
    d_qkv = jnp.concatenate([dq_BTKGH, dk_BTKH[:, :, :, None], dv_BTKH[:, :, :, None]], axis=3)
    if quantize is None:
        return d_qkv
    return quantize_fp8(d_qkv, quantize.scale, quantize.dtype), jnp.max(jnp.abs(d_qkv)).astype(jnp.float32)


split_heads.defvjp(_split_heads_fwd, _split_heads_bwd)


class Attention(nnx.Module):
    """Grouped-query attention: ``w_qkv`` [D, K, G+2, H] (per kv head its G query heads, then its
    key and value, so that splitting K over devices keeps each head group's q, k and v together)
    and ``w_o`` [N*H, D]; ``n`` of each stacked on a leading L axis (None: one layer)."""

    def __init__(self, cfg: ModelConfig, key_qkv: jax.Array, key_o: jax.Array, n: int | None, *,
                 std: float, out_std: float):
        qkv, o = mixer_linears(cfg, "attention")
        self.w_qkv = linear(key_qkv, qkv, n, std=std)
        self.w_o = linear(key_o, o, n, std=out_std)

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, segment_ids_BT: jax.Array,
                 lp: LayerPrecision, *, rope_theta: float | None, implementation: str, max_segments: int = 16,
                 runs_per_row: int | None = None) -> jax.Array:
        b, t, _ = x_BTD.shape
        q_BTNH, k_BTKH, v_BTKH = qkv_heads(x_BTD, self.w_qkv[...], positions_BT, rope_theta, lp)
        out_BTNH = tag_attention_output(
            attend(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, implementation, max_segments, runs_per_row))
        return self.w_o(out_BTNH.reshape(b, t, -1), lp)


def attention_block(x_BTD: jax.Array, w_qkv_DKGH: jax.Array, w_o_ND: jax.Array,
                    positions_BT: jax.Array, segment_ids_BT: jax.Array, *, rope_theta: float | None,
                    implementation: str, lp: LayerPrecision, max_segments: int = 16,
                    runs_per_row: int | None = None) -> jax.Array:
    """:class:`Attention` over plain arrays (``w_qkv`` [D, K, G+2, H], ``w_o`` [N*H, D])."""
    b, t, d = x_BTD.shape
    _, k, g2, h = w_qkv_DKGH.shape
    g = g2 - 2
    q_BTNH, k_BTKH, v_BTKH = qkv_heads(x_BTD, w_qkv_DKGH, positions_BT, rope_theta, lp)
    out_BTNH = tag_attention_output(
        attend(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, implementation, max_segments, runs_per_row))
    return lp.dot(out_BTNH.reshape(b, t, k * g * h), w_o_ND, "attn_out")


def qkv_heads(x_BTD: jax.Array, w_qkv_DKGH: jax.Array, positions_BT: jax.Array, rope_theta: float | None,
              lp: LayerPrecision) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``split_heads`` of the qkv GEMM's output. When attn_qkv's recipe offers operand hooks (FP8
    delayed scaling, with the layer's scaling state), the GEMM and the split are one VJP whose
    backward assembles dY straight into its low-precision format (``assemble_qkv_grad``): on GPU
    the cast then costs no pass of its own."""
    d = x_BTD.shape[-1]
    _, k, g2, h = w_qkv_DKGH.shape
    w_DN = w_qkv_DKGH.reshape(d, k * g2 * h)
    ops = lp.fused("attn_qkv")
    if ops is not None:
        return fused_qkv_heads(x_BTD, w_DN, lp.scales["attn_qkv"], positions_BT, (k, g2, h), rope_theta,
                               lp.options("attn_qkv"), None, ops)
    qkv = lp.dot(x_BTD, w_DN, "attn_qkv")
    return split_heads(qkv.reshape(*x_BTD.shape[:2], k, g2, h), positions_BT, rope_theta)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def fused_qkv_heads(x_BTD, w_DN, scales, positions_BT, heads, rope_theta, options, kernel, ops):
    """``split_heads(dot(x, w))`` through the recipe's operand hooks ``ops``
    (:class:`maxfp4.precision.FusedOperands`); ``heads`` = (K, G+2, H); ``kernel`` as in
    ``assemble_qkv_grad``."""
    return _fused_qkv_heads_fwd(x_BTD, w_DN, scales, positions_BT, heads, rope_theta, options, kernel, ops)[0]


def _fused_qkv_heads_fwd(x_BTD, w_DN, scales, positions_BT, heads, rope_theta, options, kernel, ops):
    del kernel
    qkv, gemm_res = ops.forward(x_BTD, w_DN, options, scales)
    qkv = checkpoint_name(qkv, GEMM_OUT)  # what train.remat=save_gemm keeps, as lp.dot names it
    qkv_heads_, tables = _split_heads_fwd(qkv.reshape(*x_BTD.shape[:2], *heads), positions_BT, rope_theta)
    return qkv_heads_, (gemm_res, tables)


def _fused_qkv_heads_bwd(heads, rope_theta, options, kernel, ops, residuals, cotangents):
    gemm_res, tables = residuals
    quantize = Quantize(ops.dy_scale(gemm_res), ops.dy_format)
    qdy_BTKGH, amax = assemble_qkv_grad(*cotangents, tables, quantize, kernel)
    qdy_BTN = qdy_BTKGH.reshape(*qdy_BTKGH.shape[:2], -1)
    dx, dw, amaxes = ops.backward_quantized(options, gemm_res, qdy_BTN, amax)
    return dx, dw, amaxes, None


fused_qkv_heads.defvjp(_fused_qkv_heads_fwd, _fused_qkv_heads_bwd)
