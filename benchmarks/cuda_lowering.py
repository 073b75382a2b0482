"""jax's tracing and lowering of a config's train step for CUDA, on any machine: the part of a GPU
run's first step that runs in Python before XLA compiles (and that a warm persistent cache does
not spare), with the kernels a Hopper GPU takes.

Without a GPU, the functions that pick kernels by device (``maxfp4.kernels.launch.on_gpu``,
``on_hopper``, ``kernels_on_gpu``, wherever a maxfp4 module imported them) are told the device is
a Hopper GPU, and the step is lowered with ``lowering_platforms=("cuda",)``: Pallas's Mosaic GPU
and Triton kernels lower as they would on the GPU, whose compilers are not needed for it. The
mesh is this machine's (one device unless told otherwise). cuDNN's attention needs cuDNN's
library to lower: configs with attention blocks take ``model.attention=xla`` here.

    python benchmarks/cuda_lowering.py configs/mamba2-1p3b.yaml configs/precision/fp8.yaml \\
        [key=value ...] [--cache-dir DIR] [--profile N]

``--cache-dir``: JAX's compilation cache directory for the process (the trainer's
``run.compile_cache_dir``), where the Mosaic kernels' lowering verdicts are kept
(``maxfp4.kernels.lowering_verdicts``): run twice to see a restarted run's time. ``--profile N``:
the N functions of maxfp4 and of Mosaic GPU's lowering with the most cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compile_cost import abstract_step  # noqa: E402  (benchmarks/ is not a package)

from maxfp4.config import add_config_arguments, config_from_arguments  # noqa: E402
from maxfp4.model_spec import model_spec  # noqa: E402

_DEVICE_PROBES = ("on_gpu", "on_hopper", "kernels_on_gpu")


def triton_targets_hopper() -> None:
    """Pallas's Triton lowering asks the device for its compute capability first from jax 0.11
    on (0.10 lowers without asking): answer with an H100's."""
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration
    except ImportError:
        return
    if hasattr(gpu_info, "get_gpu_info_from_version"):
        hopper = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
        pallas_call_registration.gpu_info_lib.get_gpu_info = lambda: hopper


def pretend_hopper() -> int:
    """Point every maxfp4 module's device probes at a Hopper GPU (and Triton's lowering, at an
    H100's compute capability); returns how many probes were set."""
    import maxfp4.train  # noqa: F401  (imports the model, kernels and recipes that probe)
    triton_targets_hopper()
    from maxfp4.kernels import launch
    originals = {getattr(launch, name) for name in _DEVICE_PROBES}
    count = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("maxfp4"):
            continue
        for probe in _DEVICE_PROBES:
            if getattr(module, probe, None) in originals:
                setattr(module, probe, lambda: True)
                count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--cache-dir", help="JAX's compilation cache directory for this process")
    parser.add_argument("--profile", type=int, default=0, help="functions listed by cumulative time")
    ns = parser.parse_args(argv)
    if ns.cache_dir:
        jax.config.update("jax_compilation_cache_dir", ns.cache_dir)
    cfg = config_from_arguments(ns)
    if cfg.model.attention != "xla" and model_spec(cfg.model).blocks_with("attention"):
        parser.error(f"model.attention={cfg.model.attention}: cuDNN's attention does not lower without cuDNN; "
                     "pass model.attention=xla")
    probes = pretend_hopper()
    jitted, state, batch, _ = abstract_step(cfg)
    profiler = cProfile.Profile() if ns.profile else None
    t0 = time.perf_counter()
    if profiler:
        profiler.enable()
    traced = jitted.trace(state, batch)
    t1 = time.perf_counter()
    lowered = traced.lower(lowering_platforms=("cuda",))
    t2 = time.perf_counter()
    if profiler:
        profiler.disable()
    print(f"{' '.join([ns.config, *ns.overrides])} for CUDA (Hopper; {probes} device probes set), jax {jax.__version__}: trace {t1 - t0:.1f} s, "
          f"lower {t2 - t1:.1f} s, {len(lowered.as_text()) / 1e6:.1f} MB of StableHLO")
    if profiler:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(r"maxfp4|mosaic/gpu", ns.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
