"""Compiler settings shared by the Pallas kernels (Mamba-2 mixer, NVFP4 quantization)."""

from __future__ import annotations


def triton_params(interpret: bool, num_warps: int, num_stages: int = 1) -> dict:
    """``pallas_call`` keyword arguments: Triton's warps and pipelining stages per program when the
    kernel is compiled for a GPU, nothing in interpret mode. The Triton module is imported only
    then, so CPU runs never load it."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as pltriton
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}
