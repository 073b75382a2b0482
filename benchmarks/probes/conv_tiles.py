"""The Mamba-2 convolution kernels' launch: each program's tile (rows x channels) and Triton warps,
timed forward and backward at a model's shapes, with the bytes each moves at least (x read and
the output written forward; x and the output gradient read, the pre-activation gradient written
and read, the input gradient written backward) as an effective bandwidth.

    python benchmarks/probes/conv_tiles.py [--config configs/mamba2-1p3b.yaml]

Every variant's outputs are compared with the default launch's: the values are the same, the
weight and bias gradients up to the order of their FP32 partial sums.
"""

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.config import load_config  # noqa: E402
from maxfp4.model.conv_kernel import ConvTiling, conv_backward, conv_forward, default_conv_tiling  # noqa: E402
from maxfp4.model.mamba import dims  # noqa: E402

INTERPRET = jax.default_backend() != "gpu"  # CPU: interpret mode, for checking the probe itself
VARIANTS = ["64:128:8:4", "32:128:8:4", "16:128:4:4", "64:64:4:4", "32:64:4:2", "64:256:8:8", "128:128:8:8",
            "128:64:8:4", "32:256:8:4", "16:256:4:4", "64:128:4:2", "64:128:8:8"]


def conv_inputs(config: str):
    """A model's convolution inputs, random (seed 0): x [B, T, C] BF16, weights [W, C] and bias
    [C] in FP32, one document a row; and the config, for the probes beside this file."""
    cfg = load_config(config)
    b, t, c = cfg.data.global_batch, cfg.data.seq_len, dims(cfg.model)["conv"]
    width = cfg.model.mamba.conv_kernel
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((b, t, c)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((width, c)) * 0.5, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(c) * 0.1, jnp.float32)
    return x, w, bias, jnp.ones((b, t), jnp.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/mamba2-1p3b.yaml")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma-separated ROWS:CHANNELS:FORWARD_WARPS:BACKWARD_WARPS")
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    x, w, bias, ids = conv_inputs(a.config)
    (b, t, c), width = x.shape, w.shape[0]
    dout = jnp.asarray(np.random.default_rng(1).standard_normal((b, t, c)), jnp.bfloat16)
    elem = b * t * c * x.dtype.itemsize
    fwd_bytes, bwd_bytes = 2 * elem, 5 * elem
    default = default_conv_tiling(t, c)
    print(f"convolution [B, T, C] = [{b}, {t}, {c}], W={width}, {jax.devices()[0].device_kind}, jax {jax.__version__}; "
          f"default tiling {tuple(default)}")
    print(f"{'rows:chan:fw:bw':<18}{'fwd us':>9}{'GB/s':>7}{'bwd us':>9}{'GB/s':>7}{'max diff':>11}")
    reference = None
    for spec in [":".join(map(str, default))] + a.variants.split(","):
        tiling = ConvTiling(*map(int, spec.split(":")))
        fwd = jax.jit(lambda x, tiling=tiling: conv_forward(x, w, bias, ids, INTERPRET, tiling))
        bwd = jax.jit(lambda res, dout, tiling=tiling: conv_backward(res, dout, INTERPRET, tiling=tiling))
        try:
            out, res = fwd(x)
            grads = bwd(res, dout)
            outs = [np.asarray(v, np.float32) for v in (out, *grads)]
        except Exception as exc:  # a launch Triton refuses is reported, not fatal
            print(f"{spec:<18} failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            continue
        reference = reference or outs
        diff = max(float(np.max(np.abs(o - r)) / max(np.max(np.abs(r)), 1e-30)) for o, r in zip(outs, reference))
        fwd_us = 1e3 * median_ms(fwd, x, iters=a.iters)
        bwd_us = 1e3 * median_ms(bwd, res, dout, iters=a.iters)
        print(f"{spec:<18}{fwd_us:>9.1f}{fwd_bytes / fwd_us / 1e3:>7.0f}{bwd_us:>9.1f}{bwd_bytes / bwd_us / 1e3:>7.0f}"
              f"{diff:>11.1e}", flush=True)


if __name__ == "__main__":
    main()
