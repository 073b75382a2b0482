"""XLA compile options for the train step (``train.compiler_options`` adds to or overrides them).

On GPU, XLA may lower a GEMM whose operands come from converts and scalings as a Triton GEMM
fusion instead of a cuBLASLt call. For FP8 that loses the cuBLASLt FP8 GEMM (one of the three
GEMMs of a linear layer ran as a Triton BF16 GEMM at 512 x 1024 x 2048 on an H200, jax 0.11.2),
and autotuning the Triton tilings of every such fusion made the 1.3B FP8 step take minutes to
compile instead of seconds. cuBLASLt is as fast for the GEMM shapes of these models, so Triton
GEMMs are off by default.
"""

from __future__ import annotations

from typing import Any, Mapping

GPU_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_triton_gemm": False,
}


def compiler_options(platform: str, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The options for a jit compiled for ``platform`` (a device's ``.platform``)."""
    options = dict(GPU_OPTIONS) if platform in ("gpu", "cuda") else {}
    options.update(overrides or {})
    return options


def check_compiler_options(options: Mapping[str, Any], device) -> None:
    """Compile an empty program with ``options`` so an unknown or ill-typed option is a config
    error before anything else runs, not a traceback from the first train step."""
    import jax

    from maxfp4.config import ConfigError

    try:
        jax.jit(lambda: 0, compiler_options=dict(options), device=device).lower().compile()
    except Exception as error:  # XLA reports bad options as a runtime error
        raise ConfigError(f"train.compiler_options={dict(options)}: {str(error).splitlines()[0]}") from None
