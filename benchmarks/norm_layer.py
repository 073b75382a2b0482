"""The Mamba-2 mixer's gated RMSNorm alone, at a model's shapes: the forward and the backward on
Triton (``maxfp4.kernels.gated_norm``) and on Mosaic GPU (``maxfp4.kernels.gated_norm_mosaic``),
each timed alone, with the Mosaic forward's largest difference from the Triton one and the
memory floor (bytes each must move at the GPU's bandwidth). A call's time counts its dispatch
and wait; ``--kernels`` adds each call's GPU kernels from a profiler trace, the device time of
each.

    python benchmarks/norm_layer.py [--config configs/mamba2-1p3b.yaml] [--iters 30] [--kernels] [--json out.json]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from layer_report import layer_arguments, report
from maxfp4.config import load_config
from maxfp4.kernels import gated_norm as triton_norm
from maxfp4.kernels import gated_norm_mosaic as mosaic_norm
from maxfp4.model_spec import mamba_dims as dims


def main() -> None:
    args = layer_arguments(__doc__)
    cfg = load_config(args.config, [])
    d = dims(cfg.model)
    b, t, e, groups, width = cfg.data.global_batch, cfg.data.seq_len, d["E"], d["G"], d["in"]
    eps = cfg.model.norm_eps
    rng = np.random.default_rng(0)
    u = jnp.asarray(rng.standard_normal((b, t, e)), jnp.bfloat16)
    zx = jnp.asarray(rng.standard_normal((b, t, width)), jnp.bfloat16)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(e), jnp.float32)
    dout = jnp.asarray(rng.standard_normal((b, t, e)), jnp.bfloat16)
    modules = {"Triton": triton_norm, "Mosaic GPU": mosaic_norm}
    forward = {k: jax.jit(lambda u, zx, s, m=m: m.gated_norm_forward(u, zx, s, groups, eps, jnp.bfloat16, False)[0])
               for k, m in modules.items()}
    backward = {k: jax.jit(lambda u, zx, s, d, m=m: m.gated_norm_backward((u, zx, s), d, groups, eps, False))
                for k, m in modules.items()}
    y = {k: np.asarray(f(u, zx, scale), np.float32) for k, f in forward.items()}
    diff = float(np.abs(y["Mosaic GPU"] - y["Triton"]).max() / np.abs(y["Triton"]).max())
    same = float(np.mean(y["Mosaic GPU"] == y["Triton"]))
    tensor = b * t * e * 2
    calls = {}
    for k in modules:
        calls[f"forward, {k}"] = (forward[k], (u, zx, scale), 3 * tensor)  # u, z in; out
        calls[f"backward, {k}"] = (backward[k], (u, zx, scale, dout), 5 * tensor)  # u, z, dout in; du, dz
    for rows in (1, 4):  # the Mosaic forward's rows a program (2 above): fewer, more programs resident
        fn = jax.jit(lambda u, zx, s, rows=rows: mosaic_norm.gated_norm_forward(
            u, zx, s, groups, eps, jnp.bfloat16, False, rows_per_program=rows)[0])
        calls[f"forward, Mosaic GPU, {rows} rows"] = (fn, (u, zx, scale), 3 * tensor)
    for rows in (4, 1):  # the Mosaic backward's rows a program (16 above)
        fn = jax.jit(lambda u, zx, s, d, rows=rows: mosaic_norm.gated_norm_backward(
            (u, zx, s), d, groups, eps, False, rows_per_program=rows))
        calls[f"backward, Mosaic GPU, {rows} rows"] = (fn, (u, zx, scale, dout), 5 * tensor)
    report(f"gated norm, {args.config}: B={b} T={t} E={e} groups={groups} in_proj={width}", calls, same, diff, args)

if __name__ == "__main__":
    main()
