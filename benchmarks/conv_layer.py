"""The Mamba-2 mixer's causal convolution + SiLU alone, at a model's shapes: the forward kernel on
Triton and on Mosaic GPU (``maxfp4.kernels.conv_mosaic``), and the backward (both kernels, dx
into in_proj's gradient as the mixer asks) on each, each timed alone, with the Mosaic forward's
largest difference from the Triton one and the memory floor (bytes each kernel must move at the
GPU's bandwidth); and the model's XLA form (``mamba.causal_conv`` in FP32, then SiLU), forward
and forward + backward, the bar any kernel must clear. A call's time counts its dispatch and wait
and the XLA work around the kernels (padding, masks; the backward's copy of ``into``, which is
not donated); ``--kernels`` adds each call's GPU kernels from a profiler trace, the device time
of each.

    python benchmarks/conv_layer.py [--config configs/mamba2-1p3b.yaml] [--iters 30] [--kernels] [--json out.json]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from layer_report import layer_arguments, report
from maxfp4.config import load_config
from maxfp4.kernels.conv import conv_backward, conv_forward
from maxfp4.model.mamba import causal_conv
from maxfp4.model_spec import mamba_dims as dims


def main() -> None:
    args = layer_arguments(__doc__)
    cfg = load_config(args.config, [])
    d = dims(cfg.model)
    b, t, c, width = cfg.data.global_batch, cfg.data.seq_len, d["conv"], cfg.model.mamba.conv_kernel
    rng = np.random.default_rng(0)
    # x as the mixer has it: columns [E, E + C) of the in_proj output [B, T, I]
    e = d["E"]
    zx = jnp.asarray(rng.standard_normal((b, t, d["in"])), jnp.bfloat16)
    x = zx[..., e:e + c]
    w = jnp.asarray(rng.standard_normal((width, c)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(c) * 0.1, jnp.float32)
    ids = jnp.asarray(np.repeat(np.arange(b * 4).reshape(b, 4), t // 4, axis=1), jnp.int32)  # 4 documents a row
    dout = jnp.asarray(rng.standard_normal((b, t, c)), jnp.bfloat16)
    # Each from the in_proj output: the Triton kernels from a padded copy of its x columns (which
    # XLA makes in one fusion), the Mosaic ones reading them in place.
    forward = {k: jax.jit(lambda zx, w, bias, k=k: conv_forward(zx[..., e:e + c], w, bias, ids, False, kernel=k,
                                                                source_BTI=zx, source_offset=e))
               for k in ("triton", "mosaic")}
    residuals = {k: f(zx, w, bias)[1] for k, f in forward.items()}
    # Timed: the value alone. Returning the residuals would make XLA copy the Mosaic kernels'
    # (the in_proj output itself, not donated) into an output: 130 us the mixer never spends.
    forward = {k: jax.jit(lambda *a, f=f: f(*a)[0]) for k, f in forward.items()}
    # As the mixer runs it: dx into in_proj's output gradient [B, T, I] at column E.
    into = jnp.zeros((b, t, d["in"]), jnp.bfloat16)
    backward = {k: jax.jit(lambda res, dout, into, k=k: conv_backward(res, dout, False, into_BTI=into,
                                                                     column_offset=e, kernel=k, source_offset=e))
                for k in ("triton", "mosaic")}

    def xla_forward(x, w, bias):
        return jax.nn.silu(causal_conv(x.astype(jnp.float32), w, bias, ids)).astype(x.dtype)

    def xla_forward_backward(x, w, bias, dout):
        y, pull = jax.vjp(xla_forward, x, w, bias)
        return pull(dout)
    xla = (jax.jit(xla_forward), jax.jit(xla_forward_backward))
    y = {k: np.asarray(f(zx, w, bias), np.float32) for k, f in forward.items()}
    diff = float(np.abs(y["mosaic"] - y["triton"]).max() / np.abs(y["triton"]).max())
    same = float(np.mean(y["mosaic"] == y["triton"]))
    tensor = b * t * c * 2
    calls = {"forward, Triton": (forward["triton"], (zx, w, bias), 2 * tensor),
             "forward, Mosaic GPU": (forward["mosaic"], (zx, w, bias), 2 * tensor),
             "backward, Triton": (backward["triton"], (residuals["triton"], dout, into), 5 * tensor),
             "backward, Mosaic GPU": (backward["mosaic"], (residuals["mosaic"], dout, into), 5 * tensor),
             "forward, XLA": (xla[0], (x, w, bias), 2 * tensor),
             "forward + backward, XLA": (xla[1], (x, w, bias, dout), 5 * tensor)}
    report(f"causal conv + SiLU, {args.config}: B={b} T={t} C={c} W={width}", calls, same, diff, args)

if __name__ == "__main__":
    main()
