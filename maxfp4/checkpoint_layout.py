"""Arrays a checkpoint holds in an earlier layout than the model's, converted as they are restored.

One conversion so far: Mamba-2's in_proj was stored [.., D, I], its columns z, x, B, C, dt one
after the other (each group-major), before it was stored [.., D, G, P] group by group
(:mod:`maxfp4.model.mamba_layout`). A checkpoint is recognised by the stored shape of each
in_proj array: the parameters, and the optimizer's moments, which are element-wise and convert
the same way. Those arrays are read in their stored shape, sharded as the target shards its
leading dims, and converted on the devices onto the target's sharding; every other array, and
every checkpoint in today's layout, restores as before. The conversion is a permutation of
columns: the values are bit for bit those saved.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding, PartitionSpec

from maxfp4.model.mamba_layout import grouped, in_proj_parts
from maxfp4.model_spec import LAYOUT

IN_PROJ = next(name for name, layer_class, _, _ in LAYOUT["mamba"] if layer_class == "mamba_in")

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Conversion:
    """``abstract``: the restore target with the arrays to convert in their stored shape;
    ``convert``: the restored tree -> the target's layout; ``note``: one line saying what was done."""

    abstract: Any
    convert: Callable[[Any], Any]
    note: str


def _path(keys) -> Path:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in keys)


def stored_shapes(item_dir: str) -> dict[Path, tuple[int, ...]]:
    """The shape of every array of an Orbax PyTree item (its metadata file only)."""
    import orbax.checkpoint as ocp
    from etils import epath

    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(epath.Path(item_dir)).tree
    finally:
        handler.close()
    return {_path(keys): tuple(x.shape) for keys, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if getattr(x, "shape", None) is not None}


def _columns_shape(shape_DGP: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape_DGP[:-2], shape_DGP[-2] * shape_DGP[-1])


def _stored_sharding(sharding, ndim: int):
    """The target's sharding of its leading dims, with the stored [.., I] last dim whole."""
    if not isinstance(sharding, NamedSharding):
        return sharding  # one device: the same placement
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], None))


def is_former_in_proj(path: Path, stored_shape: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether an array stored at ``path`` with ``stored_shape`` is an in_proj of the former layout
    of a parameter now of ``shape``."""
    return path[-1:] == (IN_PROJ,) and len(shape) >= 3 and tuple(stored_shape) == _columns_shape(tuple(shape))


def from_former_layout(path: Path, array, shape: tuple[int, ...], model_cfg: Any):
    """``array`` (NumPy, a file's tensor at ``path``) in the layout of a parameter of ``shape``:
    converted if it is a former-layout in_proj, as it is otherwise (a native export's reader)."""
    if not is_former_in_proj(path, array.shape, shape):
        return array
    return grouped(array, in_proj_parts(model_cfg), shape[-2])


def conversion(item_dir: str, target: Any, model_cfg_of: Callable[[], Any]) -> Conversion | None:
    """How to restore ``target`` (ShapeDtypeStructs with shardings) from the item at ``item_dir``
    when some in_proj array there has the former [.., D, I] layout; None when none has.
    ``model_cfg_of()`` gives the model config the checkpoint was written with (read only then)."""
    try:
        stored = stored_shapes(item_dir)
    except Exception:  # noqa: BLE001 - an unreadable item: the restore itself says what is wrong
        return None
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    old = {i for i, (keys, leaf) in enumerate(flat)
           if _path(keys) in stored and is_former_in_proj(_path(keys), stored[_path(keys)], leaf.shape)}
    if not old:
        return None
    parts = in_proj_parts(model_cfg_of())

    def as_stored(i, leaf):
        if i not in old:
            return leaf
        shape = _columns_shape(leaf.shape)
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=_stored_sharding(leaf.sharding, len(leaf.shape)))

    abstract = treedef.unflatten([as_stored(i, leaf) for i, (_, leaf) in enumerate(flat)])

    def convert(restored: Any) -> Any:
        leaves = jax.tree.leaves(restored)
        out = []
        for i, (a, (_, leaf)) in enumerate(zip(leaves, flat)):
            if i in old:
                groups = leaf.shape[-2]
                a = jax.jit(lambda w: grouped(w, parts, groups), out_shardings=leaf.sharding)(a)
            out.append(a)
        return jax.tree.unflatten(jax.tree.structure(restored), out)

    some = _path(flat[min(old)][0])
    note = (f"note: checkpoint {item_dir} holds Mamba-2's in_proj in its former [D, I] layout ({len(old)} arrays, "
            f"{'/'.join(some)} among them): converted to [D, G, P] as it was restored")
    return Conversion(abstract, convert, note)
