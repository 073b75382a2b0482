"""The MLP activation's backward under FP8 delayed scaling, alone: XLA's passes
(``fp8_mlp.swiglu_grad_e5m2`` or ``relu2_grad_e5m2``, ``activation_e4m3`` of the recomputed
activation, then the transposes the wgrad GEMMs need) against ``mlp_grad_kernel`` by tile and
warps. Prints ms, the bandwidth of the kernel's traffic (one read of the inputs, one write of
each output: 11 bytes a SwiGLU pair, 7 a squared-ReLU feature), and the fraction of stored bytes
that differ from XLA's.

    python benchmarks/probes/mlp_grad_fp8.py
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.model import fp8_mlp, mlp_grad_kernel  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
SHAPES = {  # name: (B, T, F, activation); one GPU's share of a step
    "llama3-8b": (2, 8192, 14336, "swiglu") if ON_GPU else (1, 128, 256, "swiglu"),
    "dense-1p3b": (8, 2048, 5632, "swiglu") if ON_GPU else (1, 128, 256, "swiglu"),
    "hybrid-1b": (8, 2048, 8192, "relu2") if ON_GPU else (1, 128, 256, "relu2"),
}
CONFIGS = ([(64, 64, 4), (128, 32, 4), (128, 32, 8), (256, 32, 8), (128, 16, 4), (64, 32, 4), (256, 16, 4)]
           if ON_GPU else [(64, 32, 4)])
DY_SCALE, H_SCALE = jnp.float32(3.0e5), jnp.float32(40.0)


def _xla(y, dh, kind):
    b, t, k = y.shape
    f = dh.shape[-1]
    if kind == "swiglu":
        qdy, amax = fp8_mlp.swiglu_grad_e5m2(y.reshape(b, t, f, 2), dh, DY_SCALE)
    else:
        qdy, amax = fp8_mlp.relu2_grad_e5m2(y, dh, DY_SCALE)
    qh, _ = fp8_mlp.activation_e4m3(y, kind, H_SCALE)
    # The barrier keeps the transposes as the separate passes the step ran before.
    dy_t, h_t = jax.lax.optimization_barrier((qdy.reshape(b * t, k).T, qh.reshape(b * t, f).T))
    return qdy.reshape(b, t, k), dy_t, h_t, amax


def _bytes(outs):
    return [np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) if a.dtype.itemsize == 1 else np.asarray(a)
            for a in outs]


def main():
    for name, (b, t, f, kind) in SHAPES.items():
        k1, k2 = jax.random.split(jax.random.key(0))
        gates = 2 if kind == "swiglu" else 1
        y = (2.0 * jax.random.normal(k1, (b, t, gates * f), jnp.float32)).astype(jnp.bfloat16)
        dh = (1e-3 * jax.random.normal(k2, (b, t, f), jnp.float32)).astype(jnp.bfloat16)
        features = b * t * f
        forms = {"xla": jax.jit(lambda y, dh, kind=kind: _xla(y, dh, kind))}
        for bm, bf, warps in CONFIGS:
            if mlp_grad_kernel.supported(b * t, f, bm, bf):
                forms[f"kernel m{bm} f{bf} w{warps}"] = jax.jit(
                    lambda y, dh, bm=bm, bf=bf, w=warps, kind=kind: mlp_grad_kernel.activation_grad_fp8(
                        y, dh, DY_SCALE, H_SCALE, kind, not ON_GPU, block_m=bm, block_f=bf, num_warps=w))
        ref = _bytes(forms["xla"](y, dh))
        for form, fn in forms.items():
            ms = median_ms(fn, y, dh, iters=20)
            got = _bytes(fn(y, dh))
            differ = max(float(np.mean(a != r)) for a, r in zip(got[:3], ref[:3]))
            print(f"{name:<11} {form:<22} {ms:8.3f} ms {features * (4 * gates + 3) / 1e6 / ms:7.0f} GB/s  "
                  f"bytes differing from XLA: {differ:.2e}  amax {float(got[3]):.6g} / {float(ref[3]):.6g}",
                  flush=True)


if __name__ == "__main__":
    main()
