"""Device mesh (data, pipeline, fsdp, context, expert, tensor) and the one table that maps logical axis names to it.

Layers name their axes logically (``batch``, ``embed``, ``heads`` ...); :data:`LOGICAL_RULES`
is the only place that decides which mesh axes shard them. A mesh axis is used at most once per
array: activations shard ``batch`` over data and fsdp, so their ``embed`` stays whole, while
parameters (which have no batch) shard their leading feature dim over fsdp - ``embed``, or
``heads`` / ``mlp`` / ``inner`` for the output projections - that is FSDP. ``WEIGHT_AXES``
(from :mod:`maxfp4.model_spec`) names each layer class's weight as its GEMM takes it, so a recipe
can gather a quantized weight with its tensor split kept (:func:`gathered_weight_spec`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxfp4.config import ConfigError, MeshConfig
from maxfp4.model_spec import WEIGHT_AXES  # each layer class's weight as its [K, N] GEMM takes it

# Outermost to innermost: with one process a node, data and then pipeline stages span the network
# between nodes; fsdp, context, expert and tensor stay inside a node (make_mesh). context splits
# each sequence, expert splits a mixture-of-experts block's experts.
MESH_AXES = ("data", "pipeline", "fsdp", "context", "expert", "tensor")

LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    # Outside mixture-of-experts blocks the expert axis is one more data axis (each of its
    # devices takes its own tokens), so an E block's all-to-all exchanges distinct tokens.
    "batch": ("data", "fsdp", "expert"),
    # Context parallelism splits each sequence (maxfp4.parallel.context: the batch is in its
    # zigzag order by then, so each rank's block of T/C tokens carries balanced causal work).
    "seq": ("context",),
    # The residual stream's sequence dim between blocks under mesh.sequence_parallel (Megatron's
    # sequence parallelism): split over tensor too, so norms, residual adds and other
    # elementwise work run on 1/tensor of the tokens and the tensor axis moves the stream by an
    # all-gather before each column-parallel GEMM and a reduce-scatter after each row-parallel
    # one (the bytes of one all-reduce, in two collectives XLA can overlap with the GEMMs).
    "residual_seq": ("context", "tensor"),
    # Parameters are sharded over context too (FSDP over the devices that split a sequence, as
    # MaxText does): context replicates no weight, so a long sequence does not cost the state's
    # memory C times. Activations never reach it: their seq dim takes context first.
    "embed": ("fsdp", "context"),
    # A weight whose first feature dim is "heads", "mlp" or "inner" (w_o, w_down, Mamba's out_proj)
    # shards that dim over fsdp too, so its "embed" stays whole: FSDP then gathers the weight
    # and reduce-scatters its gradient along the leading (contiguous) dim. Sharding the trailing
    # d_model dim instead made XLA transpose each such gradient after its reduce-scatter (on
    # Llama-3-8B at fsdp=2: two FP32 transposes of the stacked gradients, 33 ms a step).
    "heads": ("tensor", "fsdp", "context"),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor", "fsdp", "context"),
    "inner": ("tensor", "fsdp", "context"),  # Mamba-2's heads x head_dim: out_proj is row-parallel
    "ssm_groups": ("tensor",),  # Mamba-2's in_proj [D, G, P]: each tensor rank holds whole groups
    "vocab": ("tensor",),
    # Stacked blocks' leading dim: each pipeline stage keeps its own consecutive blocks
    # (maxfp4.parallel.pipeline); with mesh.pipeline=1 every device holds every block. A stack
    # the axis does not divide is split over it along a weight dim (logical_to_spec).
    "layers": ("pipeline",),
    # A stage's output as it crosses to the next pipeline stage: its d_model split over tensor,
    # so each tensor rank sends 1/tensor of it (Megatron's scatter-gather of the hand-over) and
    # the next stage's first use gathers it within the node (maxfp4.parallel.pipeline).
    "handover": ("tensor",),
    "norm": (),
    # A mixture-of-experts block's experts: each device on the expert axis holds X / expert of them.
    "experts": ("expert",),
}


def resolve_axes(cfg: MeshConfig, n_devices: int) -> tuple[int, ...]:
    """The size of each of :data:`MESH_AXES` (an axis of -1 takes the remaining devices)."""
    sizes = [getattr(cfg, axis) for axis in MESH_AXES]
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise ConfigError(f"mesh={dict(zip(MESH_AXES, sizes))}: the fixed axes ({known} devices) "
                              f"do not divide the {n_devices} devices")
        sizes[sizes.index(-1)] = n_devices // known
    if math.prod(sizes) != n_devices:
        raise ConfigError(f"mesh={dict(zip(MESH_AXES, sizes))}: expected axis sizes whose product is "
                          f"the device count {n_devices}, got {math.prod(sizes)}")
    return tuple(sizes)


def resolve_mesh_shape(cfg: MeshConfig, n_devices: int) -> tuple[int, int, int, int]:
    """(data, fsdp, tensor, pipeline): the axes the planner models (maxfp4.plan), pipeline last so
    that the first three read as they always have; context and expert are refused in one line."""
    data, pipeline, fsdp, context, expert, tensor = resolve_axes(cfg, n_devices)
    # Outside the experts the expert axis splits the batch like data: modelled as data, with the
    # all-to-all bytes charged apart (maxfp4.plan.cost).
    data *= expert
    for name, size in (("context", context),):
        if size != 1:
            raise ConfigError(f"mesh.{name}={size}: the planner models the data, pipeline, fsdp and tensor axes "
                              f"only; expected mesh.{name}=1")
    return data, fsdp, tensor, pipeline


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Auto axis types: shardings are given at the jit boundary and pinned on activations, and
    XLA's propagation fills in the rest (the scanned blocks need no per-op annotations).

    With several processes the devices are laid out process by process, so the innermost axes
    (tensor, then fsdp) stay inside a process's node and ``data`` and ``pipeline`` span the slow
    network between nodes whenever fsdp x tensor equals the devices per node."""
    devices = list(devices if devices is not None else jax.devices())
    shape = resolve_axes(cfg, len(devices))
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    if len({d.process_index for d in devices}) > 1:
        ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
        return Mesh(np.array(ordered, dtype=object).reshape(shape), MESH_AXES, axis_types=axis_types)
    return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)


def check_model_fits_mesh(model, mesh: Mesh) -> None:
    """Tensor parallelism splits kv heads (each with its query heads) and the MLP hidden size:
    both must divide evenly, or the layers would silently run unsplit. (Mamba-2 mixers whose
    groups it cannot split run whole on each tensor device: maxfp4.model.mamba.tensor_note.)"""
    t = mesh.shape["tensor"]
    for key, value in (("model.n_kv_heads", model.n_kv_heads), ("model.d_ff", model.d_ff)):
        if value % t:
            raise ConfigError(f"{key}={value}: expected a multiple of mesh.tensor={t}")


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of axes)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def spec_entry(axes: Sequence[str]):
    """The PartitionSpec entry for ``axes``: None, the one axis, or their tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def logical_to_spec(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for an array whose dims carry ``axes``. Each dim takes the mesh axes of its
    rule that no earlier dim took; a dim those do not divide drops its rule's trailing axes until
    they do, or stays whole (small norms, odd vocabularies) rather than failing. A mesh without
    one of :data:`MESH_AXES` (a sub-mesh built for one layer) reads as that axis of size 1."""
    used: set[str] = set()
    spec: list[Any] = []
    for name, size in zip(axes, shape):
        mesh_axes = [a for a in LOGICAL_RULES.get(name, ()) if name and a not in used and mesh.shape.get(a, 1) > 1]
        while mesh_axes and size % math.prod(mesh.shape[a] for a in mesh_axes):
            mesh_axes.pop()
        used.update(mesh_axes)
        spec.append(spec_entry(mesh_axes))
    if "layers" in axes and "pipeline" not in used:
        # A stack of blocks the pipeline axis does not divide (126 of Llama 3 405B's over 16
        # stages): one weight dim split over it instead, as that dim's major part, so that each
        # device keeps 1/pipeline of the stack's state and the stages' program reads a contiguous
        # part of it (maxfp4.parallel.pipeline gathers each stage's rows from those parts).
        # A dim tensor splits is tried last: the stage's gathered parts would interleave with
        # the tensor ranks' (each rank a strided share), which the GEMMs' layout must undo.
        return spread_over(PartitionSpec(*spec), shape, mesh, "pipeline", major=True, last=("tensor",))
    return PartitionSpec(*spec)


def gathered_weight_spec(layer_class: str, shape_KN: Sequence[int], mesh) -> PartitionSpec:
    """How a [K, N] weight of ``layer_class`` is laid out once FSDP has gathered it for its GEMM:
    its tensor-parallel split kept (column-parallel layers split N, row-parallel ones K), every
    other mesh axis whole. A recipe that quantizes the weight before the GEMM pins this on the
    quantized weight, so that the gather moves its narrow elements (maxfp4.precision.recipes.fp8)."""
    spec = logical_to_spec(WEIGHT_AXES[layer_class], shape_KN, mesh)

    return PartitionSpec(*("tensor" if "tensor" in entry_axes(entry) else None for entry in spec))


def lookup_specs(table_shape: Sequence[int], ids_shape: Sequence[int], mesh: Mesh) -> list[PartitionSpec]:
    """Layouts for the [B, T, D] rows of an embedding lookup, in order: first where they are
    computed without moving the table (d_model split as the table's ("vocab", "embed") d_model,
    the rows over the batch axes that leaves; the ids are small, the table and its gradient
    large), then one all-to-all a step, each moving one of d_model's axes to the rows' batch or
    sequence dim, towards the [batch, seq] layout of the activations. XLA's partitioner moves
    one axis between two dims at a time; asked for more at once, it gathers the whole tensor."""
    d_axes = list(entry_axes(logical_to_spec(("vocab", "embed"), table_shape, mesh)[1]))
    rules = {0: LOGICAL_RULES["batch"], 1: LOGICAL_RULES["seq"]}
    dims = {0: [a for a in rules[0] if a not in d_axes and mesh.shape.get(a, 1) > 1], 1: [], 2: list(d_axes)}
    while dims[0] and ids_shape[0] % math.prod(mesh.shape[a] for a in dims[0]):
        dims[0].pop()

    def spec():
        return PartitionSpec(*(spec_entry(dims[d]) for d in range(3)))

    specs = [spec()]
    for axis in d_axes:
        to = next((d for d in (0, 1) if axis in rules[d]), None)
        if to is None:
            break
        moved = sorted(dims[to] + [axis], key=rules[to].index)
        if ids_shape[to] % math.prod(mesh.shape[a] for a in moved):
            break
        dims[to], dims[2] = moved, [a for a in dims[2] if a != axis]
        specs.append(spec())
    return specs


def spread_over(spec: PartitionSpec, shape: Sequence[int], mesh: Mesh, axis: str,
                major: bool = False, last: Sequence[str] = ()) -> PartitionSpec:
    """``spec`` with ``axis`` added to the largest dim it divides with the axes the dim has, after
    them (``major``: before them), dims holding one of ``last`` tried after the others (``spec``
    unchanged where none does, or where ``axis`` is already used or of size 1)."""
    size = mesh.shape.get(axis, 1)
    dims = list(spec) + [None] * (len(shape) - len(spec))
    held = [entry_axes(d) for d in dims]
    if size == 1 or any(axis in h for h in held):
        return spec
    for i in sorted(range(len(shape)), key=lambda i: (any(a in held[i] for a in last), -shape[i])):
        if shape[i] % (math.prod(mesh.shape[a] for a in held[i]) * size) == 0:
            dims[i] = spec_entry((axis, *held[i]) if major else (*held[i], axis))
            return PartitionSpec(*dims)
    return spec


def tree_shardings(axes_tree: Any, shapes_tree: Any, mesh: Mesh) -> Any:
    """NamedShardings for a pytree of arrays (or ShapeDtypeStructs) given a matching axes tree."""
    return jax.tree.map(
        lambda axes, x: NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh)),
        axes_tree, shapes_tree, is_leaf=lambda a: isinstance(a, tuple))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(LOGICAL_RULES["batch"], *([None] * (ndim - 1))))


def batch_reader(mesh: Mesh, global_batch: int) -> tuple[int, int]:
    """(reader, readers): which contiguous block of the batch's rows this process loads, of how
    many. The batch is split over data x fsdp only, so processes whose devices sit at the same
    data x fsdp position (a tensor axis spanning processes) hold the same rows and must load the
    same ones; with one process per data x fsdp block this is (process index, process count)."""
    shards = batch_sharding(mesh).addressable_devices_indices_map((global_batch, 1))
    spans = sorted({(rows.indices(global_batch)[:2]) for rows, _ in shards.values()})
    start, stop = spans[0][0], spans[-1][1]
    if sum(b - a for a, b in spans) != stop - start:  # mesh.py lays devices out process by process
        raise ConfigError(f"mesh {dict(mesh.shape)}: process {jax.process_index()} holds rows {spans} of the "
                          f"batch, expected one contiguous block")
    return start // (stop - start), global_batch // (stop - start)


# How the mesh reaches a layer: one way, JAX's abstract mesh. The trainer traces its step under
# the mesh (:func:`traced_in_mesh`), and a layer asks for what it needs where it needs it
# (:func:`constrain`, :func:`per_batch_row` ...), so no module takes a mesh or a callable that
# carries one, and code deep in the step (a recipe's backward pass, a kernel) reads the same
# mesh as the model does. Without a mesh (one device, a test) each of these is the identity.

def traced_in_mesh(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn`` traced with ``mesh`` as JAX's abstract mesh (``fn`` itself when ``mesh`` is None)."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)
    return traced


def traced_mesh():
    """The abstract mesh the step is traced under (:func:`traced_in_mesh`), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def residual_axes(sequence_parallel: bool) -> tuple[str, str, str]:
    """The logical axes of the [B, T, D] residual stream between blocks."""
    return ("batch", "residual_seq" if sequence_parallel else "seq", "embed")


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """``x`` pinned to the sharding of its logical ``axes`` (inside jit, under a mesh)."""
    mesh = traced_mesh()
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh)))


def split_microbatches(batch: dict[str, jax.Array], m: int) -> dict[str, jax.Array]:
    """[B, T] -> [M, B/M, T], taking every M-th row so each microbatch spans all devices of the
    batch-sharded input instead of living on a few of them (the step's microbatches and the
    pipeline's)."""
    def split(x):
        x = x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)
        return constrain(x, (None, "batch", "seq"))
    return {k: split(v) for k, v in batch.items()}


def tensor_ranks() -> int:
    """Devices on the ``tensor`` axis of the mesh the step is traced under (1 without one)."""
    mesh = traced_mesh()
    return 1 if mesh is None else mesh.shape.get("tensor", 1)


def splits_batch(batch: int) -> bool:
    """Whether a batch of this many rows is split over several devices."""
    mesh = traced_mesh()
    return mesh is not None and logical_to_spec(("batch",), (batch,), mesh)[0] is not None


# The next two are for Pallas kernels: XLA cannot partition a kernel (a custom call on GPU, a
# loop over the grid in interpret mode), so without them every device gathers the whole global
# batch and runs the kernel on all of it: N times the work and the memory on N devices.

def per_batch_row(fn: Callable, batched: Sequence[Any], whole: Sequence[Any]) -> Any:
    """``fn(*batched, *whole)``, where every array in ``batched`` and every output has the
    batch first and is split over the batch axes, and ``whole`` (a pytree, parameters say)
    is given whole to every device. ``fn`` must treat batch rows independently."""
    mesh = traced_mesh()
    batch_axes = None if mesh is None else _batch_axes(batched, mesh)
    if batch_axes is None:  # one device on the batch axes, or a batch they do not divide
        return fn(*batched, *whole)
    rows = PartitionSpec(batch_axes)
    return per_device(fn, batched, whole, rows, rows, mesh)


def per_row_and_tensor_rank(fn: Callable, batched: Sequence[Any], whole: Sequence[Any]) -> Any:
    """As :func:`per_batch_row`, and the last dim of the first array in ``batched`` and of the
    output is split over ``tensor`` too: ``fn`` runs on each device's rows and its tensor rank's
    block of channels (``jax.lax.axis_index("tensor")`` says which). Without a batch split it
    still runs under ``shard_map``, over the tensor axis alone. Needs a mesh."""
    mesh = traced_mesh()
    batch_axes = _batch_axes(batched, mesh)
    split = PartitionSpec(batch_axes, *([None] * (batched[0].ndim - 2)), "tensor")
    return per_device(fn, batched, whole, split, PartitionSpec(batch_axes), mesh)


def _batch_axes(batched: Sequence[Any], mesh):
    return logical_to_spec(("batch",), batched[0].shape[:1], mesh)[0]


def per_device(fn: Callable, batched: Sequence[Any], whole: Sequence[Any], first: PartitionSpec,
                rest: PartitionSpec, mesh) -> Any:
    """``fn`` under ``shard_map``: the first batched array and the output laid out as
    ``first``, the other batched arrays as ``rest``, ``whole`` replicated."""
    in_specs = ((first,) + tuple(rest for _ in batched[1:])
                + tuple(jax.tree.map(lambda _: PartitionSpec(), w) for w in whole))
    # check_vma=False: the kernels' outputs carry no varying-axis type; the cotangents of
    # the whole inputs are summed over the devices by shard_map's transpose all the same.
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=first, check_vma=False)(*batched, *whole)


def batch_split():
    """``(mesh, axes)``: the abstract mesh the step is traced under and those of its batch axes
    that split the tokens (size > 1); ``(None, ())`` when no mesh is set. For code deep in the
    step that runs a kernel on each device's rows."""
    mesh = traced_mesh()
    if mesh is None:
        return None, ()
    return mesh, tuple(a for a in LOGICAL_RULES["batch"] if a in mesh.axis_names and mesh.shape[a] > 1)


def splits_only(mesh, axes: tuple[str, ...]) -> bool:
    """Whether no axis of ``mesh`` but ``axes`` has more than one device."""
    return all(size == 1 for name, size in mesh.shape.items() if name not in axes)


def split_size(mesh, axes: tuple[str, ...]) -> int:
    """Devices that ``axes`` of ``mesh`` split an array over (1 for no axes)."""
    return math.prod(mesh.shape[a] for a in axes) if axes else 1


def batch_split_axes(batch: int):
    """``(mesh, axes)`` when the step is traced under a mesh whose only axes of more than one
    device are batch axes that divide ``batch``: a kernel XLA cannot partition then runs on each
    device's rows under ``shard_map`` over ``axes``. ``(None, ())`` when no mesh splits anything;
    None when the mesh splits something else (heads over ``tensor``): the caller keeps its XLA
    form then."""
    mesh, axes = batch_split()
    if mesh is None:
        return None, ()
    if not splits_only(mesh, axes) or batch % split_size(mesh, axes):
        return None
    return mesh, axes


def _fan_out_by(combine: Callable) -> Callable:
    """``fan(tree, valid_N)``: every leaf of ``tree`` repeated N times, one copy for each device or
    tick that ``shard_map`` runs, its cotangent ``combine``d (``jnp.max``, ``jnp.sum``) over the
    copies where ``valid_N`` is true, in place of the sum shard_map's transpose would give a
    replicated input."""
    @jax.custom_vjp
    def fan(tree: Any, valid_N: jax.Array) -> Any:
        return jax.tree.map(lambda s: jnp.broadcast_to(s, (valid_N.shape[0], *s.shape)), tree)

    def fwd(tree, valid_N):
        return fan(tree, valid_N), valid_N

    def bwd(valid_N, ct):
        def reduce(c):
            mask = valid_N.reshape(-1, *([1] * (c.ndim - 1)))
            return combine(jnp.where(mask, c, 0.0), axis=0)
        return jax.tree.map(reduce, ct), None

    fan.defvjp(fwd, bwd)
    return fan


# FP8 delayed-scaling states: the cotangent (an amax) is the max over the copies, as every
# replica must use the same scale.
fan_out_max = _fan_out_by(jnp.max)
# The routers' statistics probe: the cotangent (token counts) is the sum over the copies.
fan_out_sum = _fan_out_by(jnp.sum)
