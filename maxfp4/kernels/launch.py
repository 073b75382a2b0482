"""Compiler settings shared by the Pallas kernels (Mamba-2 mixer, NVFP4 quantization, the
attention and MLP gradient kernels), and where they compile."""

from __future__ import annotations


def triton_params(interpret: bool, num_warps: int, num_stages: int = 1) -> dict:
    """``pallas_call`` keyword arguments: Triton's warps and pipelining stages per program when the
    kernel is compiled for a GPU, nothing in interpret mode. The Triton module is imported only
    then, so CPU runs never load it."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltriton
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def on_gpu() -> bool:
    """Whether the step runs on a GPU, where the kernels compile for Triton (elsewhere they run
    in interpret mode or give way to XLA). The device platform, not ``jax.default_backend()``:
    the latter can name the plugin ("cuda")."""
    import jax
    return jax.devices()[0].platform in ("gpu", "cuda")
