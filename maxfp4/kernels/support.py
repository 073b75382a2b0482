"""Whether the Pallas kernels a config asks for can tile its shapes, checked at start-up (before
compiling) with one line naming the key; each kernel module owns its own ``supported`` rule."""

from __future__ import annotations

from maxfp4.config import ModelConfig, describe
from maxfp4.errors import ConfigError
from maxfp4.kernels import conv, ssd
from maxfp4.model_spec import mamba_dims, model_spec


def check_mamba_kernels(model: ModelConfig, seq_len: int) -> None:
    """``model.mamba.kernels=pallas`` forces the SSD and convolution kernels: refuse shapes they
    cannot tile (``auto`` falls back to XLA by itself)."""
    mb = model.mamba
    if not model_spec(model).blocks_with("mamba") or mb.kernels != "pallas":
        return
    value = describe(mb.kernels)
    if not ssd.supported(mb.chunk_size, mb.head_dim, mb.d_state):
        raise ConfigError(f"model.mamba.kernels={value}: expected xla or auto unless chunk_size, head_dim and "
                          f"d_state are powers of two >= 16")
    channels = mamba_dims(model)["conv"]
    if not conv.supported(seq_len, channels):
        raise ConfigError(f"model.mamba.kernels={value}: expected xla or auto unless data.seq_len ({seq_len}) is a "
                          f"multiple of 8 and the convolution's {channels} channels a multiple of 16")
