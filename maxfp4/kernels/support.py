"""Whether the Pallas kernels a config asks for can tile its shapes, checked at start-up (before
compiling) with one line naming the key; each kernel module owns its own ``supported`` rule."""

from __future__ import annotations

from maxfp4.config import ModelConfig, describe
from maxfp4.errors import ConfigError
from maxfp4.kernels import conv, grouped_gemm, ssd
from maxfp4.kernels.launch import on_gpu, triton_available
from maxfp4.model_spec import mamba_dims, model_spec


def check_mamba_kernels(model: ModelConfig, seq_len: int) -> None:
    """``model.mamba.kernels=pallas`` forces the SSD and convolution kernels: refuse shapes they
    cannot tile (``auto`` falls back to XLA by itself)."""
    mb = model.mamba
    if not model_spec(model).blocks_with("mamba") or mb.kernels != "pallas":
        return
    value = describe(mb.kernels)
    if on_gpu() and not triton_available():
        raise ConfigError(f"model.mamba.kernels={value}: expected xla or auto: this jax has no Pallas Triton "
                          f"backend to compile the kernels for the GPU")
    if not ssd.supported(mb.chunk_size, mb.head_dim, mb.d_state):
        raise ConfigError(f"model.mamba.kernels={value}: expected xla or auto unless chunk_size, head_dim and "
                          f"d_state are powers of two >= 16")
    channels = mamba_dims(model)["conv"]
    if not conv.supported(seq_len, channels):
        raise ConfigError(f"model.mamba.kernels={value}: expected xla or auto unless data.seq_len ({seq_len}) is a "
                          f"multiple of 8 and the convolution's {channels} channels a multiple of 16")


def check_grouped_gemm(model: ModelConfig, tensor: int = 1) -> None:
    """``model.moe.grouped_gemm=mosaic`` forces the Mosaic GPU kernels: refuse a machine or expert
    shapes they cannot run, as each of ``tensor`` devices holds them (``auto`` falls back to XLA
    by itself)."""
    if not model_spec(model).blocks_with("moe") or model.moe.grouped_gemm != "mosaic":
        return
    if not grouped_gemm.experts_tile(model, tensor):
        share = f" / mesh.tensor={tensor}" if model.moe.expert_tensor_parallel and tensor > 1 else ""
        raise ConfigError(f"model.moe.grouped_gemm=mosaic: expected auto or xla unless model.d_model "
                          f"({model.d_model}) and model.moe.d_ff ({model.moe.d_ff}{share}) are multiples of 128")
    if not grouped_gemm.available():
        raise ConfigError("model.moe.grouped_gemm=mosaic: expected auto or xla off a Hopper GPU (the Mosaic GPU "
                          "kernels run on sm_90)")
