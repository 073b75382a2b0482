"""Activation rematerialisation policies for the scanned blocks (``train.remat``).

- ``none``: keep every residual the backward pass needs (fastest, most memory).
- ``full``: keep only each block's input; the whole block is recomputed in the backward pass.
- ``save_gemm``: keep the outputs of the linear layers and of attention, recompute the cheap
  element-wise work between them (norms, RoPE, activations, quantization of the inputs). The
  expensive parts -- GEMMs and the fused attention kernel -- are not run twice, while the many
  FP32/BF16 temporaries of the element-wise chains are not kept.
"""

from __future__ import annotations

from typing import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from maxfp4.precision import GEMM_OUT  # every linear layer's output carries this name

ATTENTION_OUT = "attention_out"

_POLICIES = {
    "save_gemm": jax.checkpoint_policies.save_only_these_names(GEMM_OUT, ATTENTION_OUT),
}


def tag_attention_output(y: jax.Array) -> jax.Array:
    return checkpoint_name(y, ATTENTION_OUT)


def remat_body(body: Callable, remat: str) -> Callable:
    """Wrap a scan body according to the ``train.remat`` policy name."""
    if remat == "none":
        return body
    if remat == "full":
        return jax.checkpoint(body, prevent_cse=False)
    return jax.checkpoint(body, prevent_cse=False, policy=_POLICIES[remat])
