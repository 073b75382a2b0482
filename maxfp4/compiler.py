"""XLA compile options for the train step (``train.compiler_options`` adds to or overrides them),
and JAX's persistent compilation cache (``run.compile_cache_dir``).

On GPU, XLA may lower a GEMM whose operands come from converts and scalings as a Triton GEMM
fusion instead of a cuBLASLt call. For FP8 that loses the cuBLASLt FP8 GEMM (one of the three
GEMMs of a linear layer ran as a Triton BF16 GEMM at 512 x 1024 x 2048 on an H200, jax 0.11.2),
and autotuning the Triton tilings of every such fusion made the 1.3B FP8 step take minutes to
compile instead of seconds. cuBLASLt is as fast for the GEMM shapes of these models, so Triton
GEMMs are off by default.
"""

from __future__ import annotations

import os
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

    from maxfp4.config import ConfigError, describe

    try:
        with jax.default_device(device):  # jit's own device argument is deprecated
            jax.jit(lambda: 0, compiler_options=dict(options)).lower().compile()
    except Exception as error:  # XLA reports bad options as a runtime error
        # describe() bounds the message: the options came from YAML and are never printed whole
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(f"train.compiler_options={describe(dict(options))}: {first}") from None


def use_compile_cache(directory: str) -> str | None:
    """Point JAX's persistent compilation cache at ``directory`` unless a cache directory is
    set already (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``), and return the one in use
    (None: off). Called before the first compile: JAX reads the setting once.

    Why on by default: the step of a large or unrolled model, and any NVFP4 step, takes minutes
    to compile (dense-1p3b NVFP4: ~290 s on an H100), and a resume after a preemption compiles
    the same program again. JAX keys each entry by the program, the compile options, the
    device and its own version, so a changed config or JAX compiles anew."""
    import jax

    current = jax.config.jax_compilation_cache_dir
    if current:
        return current
    if not directory:
        return None
    path = os.path.expanduser(directory)
    jax.config.update("jax_compilation_cache_dir", path)
    return path
