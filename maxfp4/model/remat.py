"""Activation rematerialisation policies for the blocks (``train.remat``).

- ``none``: keep every residual the backward pass needs (fastest, most memory).
- ``full``: keep only each block's input; the whole block is recomputed in the backward pass.
- ``save_gemm``: keep the outputs of the linear layers and of attention (with cuDNN, also its
  softmax statistics) and the per-tensor amaxes of the low-precision recipes, recompute the cheap
  element-wise work between them (norms, RoPE, activations, quantization of the inputs). The
  expensive parts -- GEMMs and the fused attention kernel -- are not run twice, while the many
  FP32/BF16 temporaries of the element-wise chains are not kept.
- ``save_gemm_io``: ``save_gemm``, and also each linear layer's activation operand in the form
  its recipe's backward pass reads it (FP8 bytes for the FP8 recipes, BF16 for BF16 and NVFP4).
  The backward pass then recomputes only the norms' statistics, RoPE and the weights' casts, not
  the norm, activation and cast chains that made those operands. With FP8 this costs one byte
  an input feature a token, a block: about half of the inputs' BF16 size.

With unrolled blocks (``train.scan_layers=false``) both also keep each linear layer's weight as
its recipe's backward pass reads it (cast to BF16 or quantized, still sharded; ``GEMM_WEIGHT``).
Each unrolled block's FP32 weights are slices of the stacked parameters, and a slice that the
recomputation reads is an operand of its optimization barrier, which XLA materialises: on
Llama-3-8B at fsdp=2 that was a copy of every FP32 weight shard (14 GB a GPU) made at the start
of the step, kept until the backward pass cast it again. The cast weights are half that
(BF16) or a quarter (E4M3), and nothing is cast twice. A scan reads its blocks' slices in place,
so scanned blocks keep recomputing the casts.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from maxfp4.precision import GEMM_IN, GEMM_OUT, GEMM_WEIGHT  # every linear layer's operands and output carry these

ATTENTION_OUT = "attention_out"

# cuDNN's fused attention is a primitive whose outputs (the attention output and the softmax
# statistics) are exactly what its backward kernel needs. Naming only the output would still
# recompute the forward kernel to regain the statistics: on dense-1p3b (H200) the forward kernel
# then ran twice per step, 16 ms of a 290 ms step. Saving the primitive's outputs avoids that.
_CUDNN_ATTENTION_FORWARD = ("dot_product_attention_fwd_wrapper", "dot_product_attention_fwd")


def _whole_tensor_max(prim, *args, **params) -> bool:
    """A max over every axis of a tensor: the FP8 and NVFP4 recipes' per-tensor amaxes. Kept, four
    bytes each. Recomputed, an amax reads its whole operand again, and in the backward pass
    nothing else may need that read: under FP8 the SwiGLU product's amax was such a pass once
    the MLP's backward kernel wrote the product's E4M3 itself (Llama-3-8B, 430 us a layer and
    GPU)."""
    return prim is jax.lax.reduce_max_p and len(params["axes"]) == len(args[0].shape)


def _saving(*names: str):
    """A policy that keeps the named values, cuDNN attention's forward outputs and the amaxes."""
    save_named = jax.checkpoint_policies.save_only_these_names(*names)

    def policy(prim, *args, **params) -> bool:
        return (prim.name in _CUDNN_ATTENTION_FORWARD or _whole_tensor_max(prim, *args, **params)
                or save_named(prim, *args, **params))

    return policy


_SAVED_NAMES = {
    "save_gemm": (GEMM_OUT, ATTENTION_OUT),
    "save_gemm_io": (GEMM_OUT, ATTENTION_OUT, GEMM_IN),
}


def tag_attention_output(y: jax.Array) -> jax.Array:
    return checkpoint_name(y, ATTENTION_OUT)


def remat_body(body: Callable, remat: str, *, scanned: bool = True) -> Callable:
    """Wrap a block body according to the ``train.remat`` policy name.

    ``scanned``: the body runs inside ``lax.scan``, whose loop boundary already keeps XLA from
    merging the backward pass's recomputation with the forward computation, so the
    recomputation needs no barrier (``prevent_cse=False``, cheaper). Unrolled blocks need it:
    without it XLA merged them, and the remat policy saved nothing. (An H200 build of hybrid-1b
    with unrolled blocks and save_gemm ran each Mamba-2 forward kernel once, as without remat,
    and peaked at 63 GiB against 43 GiB scanned.)
    """
    if remat == "none":
        return body
    if remat == "full":
        return jax.checkpoint(body, prevent_cse=not scanned)
    names = _SAVED_NAMES[remat] + (() if scanned else (GEMM_WEIGHT,))
    return jax.checkpoint(body, prevent_cse=not scanned, policy=_saving(*names))
