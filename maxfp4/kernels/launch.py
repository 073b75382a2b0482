"""Compiler settings shared by the Pallas kernels (Mamba-2 mixer, NVFP4 quantization, the
attention and MLP gradient kernels), where they compile, and how each distinct launch is traced
and lowered once per program."""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Callable


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


def on_hopper() -> bool:
    """Whether the device is a Hopper GPU (sm_90), whose wgmma the Mosaic GPU kernels use."""
    import jax
    device = jax.devices()[0]
    return device.platform == "gpu" and getattr(device, "compute_capability", "") == "9.0"


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether this jax has Pallas's Triton backend, which the kernels compile for on a GPU. jax
    0.11 deprecates it and says it will be removed; where it is gone, ``auto`` gives every
    kernel's place to its XLA form (slower, the same arithmetic) instead of failing."""
    try:
        from jax.experimental.pallas import triton  # noqa: F401
    except Exception:  # removed, or failing to import: either way, no kernels
        return False
    return True


def kernels_on_gpu() -> bool:
    """Whether ``auto`` picks the Pallas kernels: on a GPU whose jax has their backend."""
    return on_gpu() and triton_available()


def pallas_call(kernel: Callable, **launch: Any) -> Callable:
    """``pl.pallas_call(kernel, **launch)``, traced and lowered once for every launch of the
    same kernel, settings and operand types in a program.

    A step with unrolled blocks launches each kernel once per block with the same everything.
    ``pl.pallas_call`` traces its kernel and lowers it to Triton's IR at every launch (480 of
    them in mamba2-1p3b's step: 36 of the 54 s that lowering the step took on an H200, jax
    0.11.2, 2026-11-29). Here a launch is a ``jax.jit`` of the call, kept per launch key: jit
    traces it once per operand types, and jax lowers a repeated jitted call as one function the
    program calls again. XLA inlines those calls, so the compiled step is the same.

    The key is the launch's structure: the kernel function (with a ``functools.partial``'s
    arguments), grid, block specs (their index maps by code and captured values), output
    shapes and compiler settings. Values a kernel reads from its module's globals are taken as
    constants, as the kernels here use them. A launch with something unhashable in it is called
    uncached.
    """
    from jax.experimental import pallas as pl
    try:
        key = _structure((kernel, launch))
        hash(key)
    except (TypeError, RecursionError):  # an unhashable value, or a closure that reaches itself
        return pl.pallas_call(kernel, **launch)
    return _jitted(_Launch(key, lambda: pl.pallas_call(kernel, **launch)))


@dataclasses.dataclass(frozen=True)
class _Launch:
    """A launch, equal to another with the same structure (its builder is not compared)."""
    key: Any
    build: Callable = dataclasses.field(compare=False, hash=False)


@functools.lru_cache(maxsize=4096)
def _jitted(launch: _Launch) -> Callable:
    import jax
    return jax.jit(launch.build())


def _structure(obj: Any) -> Any:
    """A hashable value equal for two objects that launch the same kernel the same way."""
    if isinstance(obj, functools.partial):
        return ("partial", _structure(obj.func), _structure(obj.args), _structure(obj.keywords))
    if isinstance(obj, types.FunctionType):
        cells = tuple(_structure(c.cell_contents) for c in obj.__closure__ or ())
        return ("function", obj.__module__, obj.__qualname__, obj.__code__, cells, _structure(obj.__defaults__),
                _structure(obj.__kwdefaults__))
    if callable(obj) and hasattr(obj, "__wrapped__"):  # e.g. Pallas's wrapper of an index map
        return ("wrapped", type(obj).__qualname__, _structure(obj.__wrapped__))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_structure(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple(sorted((k, _structure(v)) for k, v in obj.items())))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj), tuple((f.name, _structure(getattr(obj, f.name))) for f in dataclasses.fields(obj)))
    import jax
    if isinstance(obj, jax.ShapeDtypeStruct):
        return ("array", tuple(obj.shape), str(obj.dtype), _structure(obj.sharding))
    hash(obj)  # anything else must be a hashable value (ints, dtypes, enums, None); arrays raise
    return obj
