"""How Mamba-2's in_proj weight is stored, and the column orders its GEMM and other tools need.

Stored: [D, G, P], one slab of P columns per Mamba group g, holding that group's z, x, B, C and
dt columns side by side (widths E/G, E/G, N, N, H/G: :func:`in_proj_parts`). The logical axes
("embed", "ssm_groups", None) split G over ``tensor``, so a tensor rank holds whole groups and
the weight is divided by fsdp x tensor like every other matmul weight.

The mixer's core (convolution, SSD, gated norm) reads its input part by part: [z | x | B | C | dt],
each part group-major. :func:`columns` makes that order from the stored slabs, for the whole
mixer (``ranks=1``: the order Hugging Face's NemotronH / Mamba2 ``in_proj`` has, and the
``[D, I]`` layout checkpoints stored before this one) or for each of ``ranks`` tensor ranks on
its own block of G / ranks groups, so that a rank's columns of the result are exactly the
stored columns it holds, reordered in place. :func:`grouped` is the inverse of ``columns(w, 1)``.

Written against the array API (``x.__array_namespace__()``), so NumPy arrays (export, import,
checkpoint conversion on the host) and JAX arrays or tracers (the mixer) go through the same code.

Dimension letters: D d_model, G groups, P one group's in_proj columns, I = G x P, E inner width,
H Mamba heads, N state size.
"""

from __future__ import annotations

from typing import Any

from maxfp4.model_spec import mamba_dims


def in_proj_parts(cfg: Any) -> tuple[int, int, int, int, int]:
    """One group's in_proj columns: the widths of its z, x, B, C and dt parts (sum: P)."""
    d = mamba_dims(cfg)
    g = d["G"]
    return d["E"] // g, d["E"] // g, d["N"], d["N"], d["H"] // g


def _concat(parts: list, axis: int):
    return parts[0].__array_namespace__().concat(parts, axis=axis)


def columns(w_DGP, parts: tuple[int, ...], ranks: int = 1):
    """[..., D, G, P] -> [..., D, I]: ``ranks`` blocks of G / ranks groups, within each block
    z, x, B, C, dt one after the other, each of them group-major. Static slices, reshapes and
    one concatenation: the gradient comes back the same way (a gather's would be a scatter-add),
    and with G split over ``ranks`` devices each one reorders its own columns."""
    *lead, g, p = w_DGP.shape
    if sum(parts) != p or g % ranks:
        raise ValueError(f"in_proj of shape {w_DGP.shape}: expected {sum(parts)} columns a group and groups "
                         f"divisible by {ranks}")
    if g == ranks:  # one group a block: the stored slab is already in the core's order
        return w_DGP.reshape(*lead, g * p)
    blocks, start = [], 0
    for width in parts:
        part = w_DGP[..., start:start + width]  # [..., D, G, width]
        blocks.append(part.reshape(*lead, ranks, (g // ranks) * width))
        start += width
    return _concat(blocks, axis=-1).reshape(*lead, g * p)


def grouped(w_DI, parts: tuple[int, ...], groups: int):
    """[..., D, I] with columns z, x, B, C, dt (each group-major: ``columns(w, parts, 1)``'s order)
    -> the stored [..., D, G, P]."""
    *lead, i = w_DI.shape
    if sum(parts) * groups != i:
        raise ValueError(f"in_proj of shape {w_DI.shape}: expected {sum(parts) * groups} columns")
    slabs, start = [], 0
    for width in parts:
        slabs.append(w_DI[..., start:start + groups * width].reshape(*lead, groups, width))
        start += groups * width
    return _concat(slabs, axis=-1)
