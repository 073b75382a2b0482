"""Linear-layer recipes, one module per family: how the operands of ``Y = X W`` and of its two
gradient GEMMs are quantized.

Every linear layer makes three GEMMs: fprop ``Y = X W``, dgrad ``dX = dY W^T`` and wgrad
``dW = X^T dY``. A recipe is a ``jax.custom_vjp`` that decides each operand's format. Master
weights arrive in FP32; the weight gradient leaves in FP32; activations travel in BF16.

Signature of a recipe's dot: ``fn(x[..., K], w[K, N], options, scales, key) -> y[..., N]`` where
``options`` is a hashable tuple of (name, value) pairs, ``scales`` is the layer's scaling state
(f32[3]: x, w, dY, for a stateful recipe) or None, and ``key`` a PRNG key for stochastic rounding.

Each family module (:mod:`.bf16`, :mod:`.fp8`, :mod:`.nvfp4`, :mod:`.mx`, :mod:`.fp8_block`)
defines one :class:`Recipe` record per recipe; :mod:`maxfp4.precision.registry` lists them.
Adding a recipe: its JAX-free facts in :mod:`maxfp4.precision.catalog`, its module (or a record
in an existing one), and one registry line.

Dimension letters: M tokens (batch x sequence), K input features, N output features.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from maxfp4.parallel.mesh import traced_mesh
from maxfp4.precision.catalog import RecipeSpec
from maxfp4.precision.formats import power_2_floor
from maxfp4.precision.fused import FusedOperands

COMPUTE_DTYPE = jnp.bfloat16
TN = (((1,), (1,)), ((), ()))  # contract dim 1 of both operands: the fast cuBLASLt FP8 layout
# The name of each recipe's activation operand as its backward pass keeps it (FP8 for the FP8
# recipes, BF16 for the others), so a remat policy can keep it rather than recompute the norm,
# activation and cast that made it (train.remat=save_gemm_io, maxfp4.model.remat).
GEMM_IN = "gemm_in"
# The name of each recipe's weight operand as its backward pass keeps it: cast (BF16) or
# quantized (E4M3, NVFP4 tiles), still sharded as the parameter is, before any all-gather. A remat
# policy keeps it for unrolled blocks, whose FP32 weights are slices of the stacked parameters
# that XLA would otherwise copy for the backward pass to cast again (maxfp4.model.remat).
GEMM_WEIGHT = "gemm_weight"


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """Everything about one recipe: what the catalog knows of it, its dot, and what it offers."""

    spec: RecipeSpec  # options and defaults, block size, peak class, bytes per element (catalog)
    dot: Callable  # fn(x, w, options, scales, key) -> y: a custom_vjp over x and w
    fused: FusedOperands | None = None  # operand hooks for layers that fuse its casts (fused.py)
    # Stateful recipes (spec.stateful): one state slot per quantized layer, kept in
    # TrainState.precision (maxfp4.precision.state). ``init_state(options, lead) -> slot`` with
    # ``slot["scale"]`` f32[*lead, 3] (what the dot takes as ``scales``); ``update_state(slot,
    # amax, options) -> slot`` from this step's amaxes f32[*lead, 3] (the scales' cotangents).
    init_state: Callable | None = None
    update_state: Callable | None = None
    # The grouped GEMM of mixture-of-experts layers (maxfp4.precision.recipes.grouped):
    # ``grouped(x[M, K], w[G, K, N], sizes[G], options, scales, key) -> y[M, N]``; None: the
    # recipe cannot run expert layers.
    grouped: Callable | None = None
    # ``with_reciprocals(scales[..., 3], options) -> [..., 6]``: a stateful recipe's scales with
    # what its layers would otherwise compute from them one layer at a time (the exact
    # reciprocals), computed once over a class's [L, 3] array; its dot and operand hooks take
    # either width (maxfp4.precision.state.with_reciprocals). None: the scales go as they are.
    with_reciprocals: Callable | None = None
    # The same for the expert classes, in the form ``grouped`` takes (None: they go as they are).
    grouped_with_reciprocals: Callable | None = None

    def __post_init__(self):
        if self.spec.stateful != (self.init_state is not None and self.update_state is not None):
            raise TypeError(f"recipe {self.spec.name}: a stateful spec needs init_state and update_state, "
                            f"and only a stateful one has them")

    @property
    def name(self) -> str:
        return self.spec.name


def _split_sequence(shape) -> int:
    """Context ranks the sequence dim (1) of a [B, T, K] activation is split over under the
    traced mesh (1: none, not [B, T, K], or inside a shard_map that owns the context axis)."""
    mesh = traced_mesh()
    if mesh is None or len(shape) != 3:
        return 1
    c = mesh.shape.get("context", 1)
    if c == 1 or shape[1] % c or "context" in getattr(mesh, "manual_axes", ()):
        return 1
    return c


def flat(x: jax.Array) -> jax.Array:
    """[..., K] -> [M, K], the tokens of a GEMM as its rows. A [B, T, K] activation whose T is
    split over ``context`` goes rank-major, [C, B, T/C] (each rank's rows contiguous, as its
    tokens are on the device): flattened as [B, T], the rows of a rank were B runs apart, so
    XLA's partitioner gathered the whole sequence on every rank and each computed every
    token's GEMM (C times the work, whenever a device held more than one row)."""
    c = _split_sequence(x.shape)
    if c > 1:
        b, t, k = x.shape
        return x.reshape(b, c, t // c, k).swapaxes(0, 1).reshape(-1, k)
    return x.reshape(-1, x.shape[-1])


def unflat(y_MN: jax.Array, lead: tuple[int, ...]) -> jax.Array:
    """[M, N] rows of :func:`flat` -> [*lead, N]."""
    c = _split_sequence((*lead, y_MN.shape[-1]))
    if c > 1:
        b, t = lead
        return y_MN.reshape(c, b, t // c, -1).swapaxes(0, 1).reshape(b, t, -1)
    return y_MN.reshape(*lead, y_MN.shape[-1])


def power_2_scale(options) -> bool:
    """The FP8 recipes' ``power_2_scale`` option (scales rounded down to powers of two)."""
    return bool(dict(options).get("power_2_scale", False))


def delayed_scales(scales: jax.Array, options) -> jax.Array:
    """The three delayed-scaling scales (x, w, dY) a step quantizes with, from ``[..., 3]`` or
    ``[..., 6]`` (with their reciprocals appended). With power_2_scale the state's scales are
    already powers of two (state.py rounds them); rounding again is a no-op then, and keeps the
    BF16 GEMM form exact for scales that are not (a state initialised or restored by other code,
    scales passed in by a caller)."""
    scales = scales[..., :3]
    return power_2_floor(scales) if power_2_scale(options) else scales


def dtype_token(dtype) -> jax.Array:
    """A zero-size array that carries a dtype (of x, whose gradient takes it) through the
    residuals: dtypes are not JAX types."""
    return jnp.zeros((0,), dtype)


def amax(x: jax.Array) -> jax.Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def check_multiple(name: str, what: str, size: int, block: int, shape) -> None:
    """A block-scaled recipe's dimension check, raised when its dot is traced."""
    if size % block:
        raise ValueError(f"{name}: {what} ({size}) of shape {tuple(shape)} must be a multiple of {block}")
