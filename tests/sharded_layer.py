"""One linear layer on a (data, fsdp, tensor) mesh, sharded as the trainer shards it: its
operands, its forward and VJP traced under the mesh as the trainer traces its step, and the
all-gathers XLA compiled for it. For the tests of where a recipe gathers its quantized weight
(tests/test_recipes.py on CPU devices, tests/test_gpu_precision.py on GPUs)."""

import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from maxfp4.parallel.mesh import logical_to_spec
from maxfp4.model_spec import WEIGHT_AXES

ROWS = ("data", "fsdp")  # the batch's mesh axes (mesh.LOGICAL_RULES["batch"])
SCALES = jnp.asarray([50.0, 5000.0, 1000.0], jnp.float32)  # fixed delayed-scaling state (x, w, dY)


def layer_operands(mesh, layer_class: str, k: int, n: int, tokens: int):
    """``(x[4, tokens, K], w[K, N], dY[4, tokens, N])`` placed on ``mesh``: the rows over data x
    fsdp, the weight as its parameter is sharded (``mesh.WEIGHT_AXES``). Where tensor parallelism
    splits the weight's K (a row-parallel layer) its input arrives split the same way; where it
    splits N (column-parallel), its output gradient does."""
    w_spec = logical_to_spec(WEIGHT_AXES[layer_class], (k, n), mesh)
    split_k, split_n = ("tensor" in (e if isinstance(e, tuple) else (e,)) for e in w_spec)
    x = jax.device_put(jax.random.normal(jax.random.key(0), (4, tokens, k), jnp.bfloat16),
                       NamedSharding(mesh, P(ROWS, None, "tensor" if split_k else None)))
    w = jax.device_put(0.02 * jax.random.normal(jax.random.key(1), (k, n), jnp.float32), NamedSharding(mesh, w_spec))
    dy = jax.device_put(jax.random.normal(jax.random.key(2), (4, tokens, n), jnp.bfloat16),
                        NamedSharding(mesh, P(ROWS, None, "tensor" if split_n else None)))
    return x, w, dy


def forward_and_grads(fn, options, mesh=None):
    """``(x, w, dY) -> (y, dx, dw)`` of the recipe's dot ``fn`` with ``options``, traced under
    ``mesh``'s abstract mesh when given (as the trainer traces its step)."""
    def plain(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, options, SCALES, None), x, w)
        return (y,) + vjp(dy)[:2]

    if mesh is None:
        return plain

    def layer(x, w, dy):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return plain(x, w, dy)
    return layer


def all_gathers(hlo: str) -> list[tuple[str, str]]:
    """(element type, dims) of each all-gather's output in a compiled HLO text."""
    return [re.search(r"= \(*(\w+)\[([\d,]*)\]", line).groups() for line in hlo.splitlines()
            if re.search(r" all-gather(-start)?\(", line)]
