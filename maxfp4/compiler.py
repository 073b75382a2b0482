"""XLA compile options for the train step (``train.compiler_options`` adds to or overrides them),
and JAX's persistent compilation cache (``run.compile_cache_dir``).

On GPU, XLA may lower a GEMM whose operands come from converts and scalings as a Triton GEMM
fusion instead of a cuBLASLt call. For FP8 that loses the cuBLASLt FP8 GEMM (one of the three
GEMMs of a linear layer ran as a Triton BF16 GEMM at 512 x 1024 x 2048 on an H200, jax 0.11.2),
and autotuning the Triton tilings of every such fusion made the 1.3B FP8 step take minutes to
compile instead of seconds. cuBLASLt is as fast for the GEMM shapes of these models, so Triton
GEMMs are off by default.

``run.deterministic`` adds XLA's deterministic options to the step's own compile options
(they are per-program debug options, so nothing has to be set before the GPU backend starts).
This module also reads back, from a compiled program, how XLA configured its cuBLASLt FP8 GEMMs.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping

from maxfp4.config import describe
from maxfp4.errors import ConfigError
from maxfp4.model_spec import model_spec

GPU_OPTIONS: dict[str, Any] = {
    "xla_gpu_enable_triton_gemm": False,
}


# run.deterministic. Both are read per compiled module (XLA's RequireDeterminism in
# service/gpu/stream_executor_util.cc): with either, scatters (the embedding's and the loss's
# gradients) are rewritten without atomics, cuDNN's fused attention backward is built with
# force_deterministic (its dQ is otherwise summed with atomics), convolutions pick deterministic
# algorithms, and the autotuner takes its first candidate instead of the fastest it timed (a
# timing can pick another GEMM algorithm, hence another summation order, in another process).
# The second also makes compilation fail on an op that has no deterministic form
# (select-and-scatter) rather than run it silently.
DETERMINISTIC_OPTIONS: dict[str, Any] = {
    "xla_gpu_deterministic_ops": True,
    "xla_gpu_exclude_nondeterministic_ops": True,
}


def compiler_options(platform: str, overrides: Mapping[str, Any] | None = None,
                     deterministic: bool = False) -> dict[str, Any]:
    """The options for a jit compiled for ``platform`` (a device's ``.platform``); with
    ``deterministic`` on every platform (the CPU ignores them), so the step's options say so."""
    check_deterministic_options(overrides or {}, deterministic)
    options = dict(GPU_OPTIONS) if platform in ("gpu", "cuda") else {}
    options.update(overrides or {})
    if deterministic:
        options.update(DETERMINISTIC_OPTIONS)
    return options


def check_deterministic_options(overrides: Mapping[str, Any], deterministic: bool) -> None:
    """With ``run.deterministic``, ``train.compiler_options`` may repeat XLA's deterministic
    options but not contradict them (run at start-up, before the run directory is touched)."""
    if not deterministic:
        return
    for key, value in DETERMINISTIC_OPTIONS.items():
        if overrides.get(key, value) != value:
            raise ConfigError(f"train.compiler_options.{key}={describe(overrides.get(key))}: "
                              f"expected {value} or unset with run.deterministic=true")


def determinism_summary(options: Mapping[str, Any]) -> str:
    """One line for the run's log: whether the step is compiled deterministic, and how."""
    on = [k for k, v in DETERMINISTIC_OPTIONS.items() if options.get(k) == v]
    if len(on) == len(DETERMINISTIC_OPTIONS):
        return f"deterministic: on ({', '.join(on)})"
    return "deterministic: off (run.deterministic=true makes reruns bit-identical)"


def check_compiler_options(options: Mapping[str, Any], device) -> None:
    """Compile an empty program with ``options`` so an unknown or ill-typed option is a config
    error before anything else runs, not a traceback from the first train step."""
    import jax

    try:
        with jax.default_device(device):  # jit's own device argument is deprecated
            jax.jit(lambda: 0, compiler_options=dict(options)).lower().compile()
    except Exception as error:  # XLA reports bad options as a runtime error
        # describe() bounds the message: the options came from YAML and are never printed whole
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(f"XLA options {describe(dict(options))} (train.compiler_options, run.deterministic): {first}") from None


# ----------------------------------------------------------------------------- cuBLASLt FP8 GEMMs

FP8_GEMM_TARGET = "__cublas$lt$matmul$f8"


def fast_accumulation(precision_config: Mapping[str, Any]) -> bool:
    """Whether cuBLASLt runs an FP8 GEMM with CUBLASLT_MATMUL_DESC_FAST_ACCUM, from the
    ``precision_config`` of its backend config, as XLA decides it (IsFastAccumEnabled in
    stream_executor/cuda/cuda_blas_lt.cc): with no dot algorithm set, fast exactly when every
    operand precision is DEFAULT; with one, exactly for ALG_DOT_ANY_F8_ANY_F8_F32_FAST_ACCUM."""
    algorithm = precision_config.get("algorithm", "ALG_UNSET")
    if algorithm not in ("ALG_UNSET", 0):
        return algorithm == "ALG_DOT_ANY_F8_ANY_F8_F32_FAST_ACCUM"
    precisions = precision_config["operand_precision"]
    return all(p in ("DEFAULT", 0) for p in precisions)


def fp8_gemms(hlo_text: str) -> list[dict[str, Any]]:
    """Each cuBLASLt FP8 GEMM of an optimized HLO (``compiled.as_text()``), in program order:
    ``name``, ``dtype`` and ``shape`` (its output, padded to multiples of 16 as cuBLASLt FP8
    needs), ``dims`` (dot dimension numbers), ``precision_config`` and ``fast_accumulation``.
    A GEMM whose backend config has no precision config raises ValueError with its line, so a
    change of XLA's format cannot pass for a result."""
    gemms = []
    for line in hlo_text.splitlines():
        if FP8_GEMM_TARGET not in line or "custom-call(" not in line:
            continue
        name = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)", line)
        out = re.search(r"=\s*\(?(\w+)\[([\d,]*)\]", line)
        start = line.find("backend_config=")
        try:
            config, _ = json.JSONDecoder().raw_decode(line[start + len("backend_config="):]) if start >= 0 else ({}, 0)
            gemm = config["gemm_backend_config"]
            precision = gemm["precision_config"]
            fast = fast_accumulation(precision)
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{FP8_GEMM_TARGET} without a readable precision_config ({error!r}): {line[:1500]}")
        gemms.append({"name": name.group(1) if name else "?", "dtype": out.group(1) if out else "?",
                      "shape": tuple(int(d) for d in out.group(2).split(",") if d) if out else (),
                      "dims": gemm.get("dot_dimension_numbers", {}), "precision_config": precision,
                      "fast_accumulation": fast})
    return gemms


def xla_knows_cpu_fusion_emitters_flag() -> bool:
    """Whether this jaxlib's XLA takes ``--xla_cpu_use_fusion_emitters`` (the choice between its
    CPU fusion emitters and the older loop emitters): jaxlib 0.10 does; 0.11's XLA has the
    emitters only and aborts the process at the flag, as at any unknown flag. Read from the
    package's metadata, so that nothing of JAX starts before XLA_FLAGS is set."""
    from importlib.metadata import version

    major, minor = (int(part) for part in version("jaxlib").split(".")[:2])
    return (major, minor) < (0, 11)


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


def check_deterministic_attention(cfg, platform: str) -> None:
    """run.deterministic with cuDNN attention in unrolled blocks compiles, then fails at the first
    step inside XLA (jax 0.11.2 on H200: ``IndexError: raw_hash_map<>::at``); scanned blocks and
    XLA's attention run deterministically. Refused before anything compiles, naming both ways out."""
    m = cfg.model
    has_attention = bool(model_spec(m).blocks_with("attention"))
    attention = m.attention if m.attention != "auto" else ("cudnn" if platform in ("gpu", "cuda") else "xla")
    if cfg.run.deterministic and has_attention and attention.startswith("cudnn") and not cfg.train.scan_layers:
        raise ConfigError(f"run.deterministic=true with train.scan_layers=false and model.attention={m.attention!r} "
                          f"(cuDNN): XLA fails at the first step on this combination; expected "
                          f"train.scan_layers=true or model.attention=xla")
