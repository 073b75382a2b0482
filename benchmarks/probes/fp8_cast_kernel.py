"""A one-pass FP8 cast + transpose + amax kernel (Pallas, Triton on GPU) against XLA's passes at
model shapes, tile sizes and warps, and its bits against XLA's cast. Tried as the FP8 recipes'
caster and not kept (docs/PERFORMANCE.md, section "FP8 casts: a one-pass cast kernel ..."): XLA
fuses the producer of x or dY into its cast, which a kernel boundary prevents, and at these
shapes the kernel was no faster than XLA's three passes.

    python benchmarks/probes/fp8_cast_kernel.py
"""

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, "benchmarks")
from timing import median_ms  # noqa: E402

from maxfp4.model import layers  # noqa: E402
from maxfp4.pallas_params import triton_params  # noqa: E402
from maxfp4.precision import formats as F  # noqa: E402
from maxfp4.precision.recipes import _amax  # noqa: E402  (the recipes' own amax form)

_MAX_BLOCK = 128  # tile side: 128 x 128 BF16 is 32 KiB in, 2 x 16 KiB out
_MIN_BLOCK = 16   # Triton's smallest tile side
_NUM_WARPS = 8


def _block(n: int) -> int | None:
    """The largest power of two <= _MAX_BLOCK that divides n, if it is at least _MIN_BLOCK."""
    b = _MAX_BLOCK
    while b >= _MIN_BLOCK:
        if n % b == 0:
            return b
        b //= 2
    return None


def _kernel(scale_ref, x_ref, q_ref, qt_ref, amax_ref, *, fp8_max: float, dtype):
    x_BM_BK = x_ref[...].astype(jnp.float32)
    amax_ref[...] = jnp.max(jnp.abs(x_BM_BK), axis=1)
    y_BM_BK = jnp.clip(x_BM_BK * scale_ref[...][None, :], -fp8_max, fp8_max)
    q_ref[...] = y_BM_BK.astype(dtype)
    if qt_ref is not None:
        qt_ref[...] = y_BM_BK.T.astype(dtype)


def _kernel_no_t(scale_ref, x_ref, q_ref, amax_ref, **kw):
    _kernel(scale_ref, x_ref, q_ref, None, amax_ref, **kw)


@functools.partial(jax.jit, static_argnames=("dtype", "interpret", "max_block", "num_warps", "transpose"))
def fp8_cast_transpose(x_MK: jax.Array, scale: jax.Array, dtype, interpret: bool = False,
                       max_block: int = _MAX_BLOCK, num_warps: int = _NUM_WARPS, transpose: bool = True
                       ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q[M, K], q^T[K, M], amax)``: ``q = fp8(clip(x * scale))`` in ``dtype`` (an FP8 type),
    its transpose, and ``max |x|`` in FP32, from one read of ``x``. ``scale`` is an FP32 scalar.
    ``transpose=False`` leaves the transpose out (``None``), to time the cast alone."""
    m, k = x_MK.shape
    if _block(m) is None or _block(k) is None:
        raise ValueError(f"fp8_cast_transpose: shape {x_MK.shape} does not tile into power-of-two blocks "
                         f"of {_MIN_BLOCK} to {_MAX_BLOCK}")
    bm, bk = min(_block(m), max_block), min(_block(k), max_block)
    # The scale rides as a [BK] vector: a Triton program loads tiles, not scalars.
    scale_BK = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), (bk,))
    kernel = functools.partial(_kernel, fp8_max=float(jnp.finfo(dtype).max), dtype=dtype)
    out_specs = [pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
                 pl.BlockSpec((bk, bm), lambda i, j: (j, i)),
                 pl.BlockSpec((pl.squeezed, bm), lambda i, j: (j, i))]
    out_shape = [jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((k, m), dtype),
                 jax.ShapeDtypeStruct((k // bk, m), jnp.float32)]
    if not transpose:
        kernel = functools.partial(_kernel_no_t, fp8_max=float(jnp.finfo(dtype).max), dtype=dtype)
        out_specs, out_shape = [out_specs[0], out_specs[2]], [out_shape[0], out_shape[2]]
    outs = pl.pallas_call(
        kernel,
        grid=(m // bm, k // bk),
        in_specs=[pl.BlockSpec((bk,), lambda i, j: (0,)),
                  pl.BlockSpec((bm, bk), lambda i, j: (i, j))],
        out_specs=out_specs, out_shape=out_shape,
        interpret=interpret, **triton_params(interpret, num_warps),
    )(scale_BK, x_MK)
    if not transpose:
        return outs[0], None, jnp.max(outs[1])
    q_MK, q_KM, amax_rows = outs
    return q_MK, q_KM, jnp.max(amax_rows)


def relu2(a):
    """The model's squared ReLU, stored in the activation dtype as mlp_down's input is."""
    return layers.relu2(a).astype(layers.ACT_DTYPE)


def xla_form(a, s):
    """What the FP8 recipes leave to XLA: the cast, its transpose and the amax."""
    x = relu2(a)
    return F.quantize_fp8(x, s, F.FP8_E5M2).T, _amax(x)


def main():
    if jax.default_backend() != "gpu":
        sys.exit("fp8_cast_kernel.py times a Triton kernel: run it on a GPU")
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    s = jnp.float32(64.0)
    for dtype in (F.FP8_E4M3, F.FP8_E5M2):
        x = jax.random.normal(jax.random.key(1), (16384, 8512), jnp.bfloat16) * 300
        q, _, _ = fp8_cast_transpose(x, s, dtype)
        want = jax.jit(lambda x: F.quantize_fp8(x, s, dtype))(x)
        qb, wb = np.asarray(q).view(np.uint8), np.asarray(want).view(np.uint8)
        bad = np.argwhere(qb != wb)
        print(f"{jnp.dtype(dtype).name}: {len(bad)} of {qb.size} differ", flush=True)
        for i, j in bad[:5]:
            v = float(x[i, j]) * float(s)
            print(f"   x*s={v!r} kernel={float(q[i, j])!r} xla={float(want[i, j])!r}")
    variants = [(128, 8, True), (128, 4, True), (64, 4, True), (64, 8, True), (32, 4, True),
                (128, 8, False), (64, 4, False)]
    for m, k in ((16384, 2048), (16384, 8192), (16384, 8512)):
        a = jax.random.normal(jax.random.key(0), (m, k), jnp.bfloat16)
        gb = m * k * 2 / 1e9
        rows = [("xla cast+T+amax", jax.jit(xla_form))]
        for blk, warps, t in variants:
            fn = jax.jit(lambda a, s, blk=blk, warps=warps, t=t: fp8_cast_transpose(
                relu2(a), s, F.FP8_E5M2, max_block=blk, num_warps=warps, transpose=t))
            rows.append((f"kernel {blk} w{warps} {'T' if t else 'noT'}", fn))
        rows.append(("kernel 64 w4 T, no producer", jax.jit(
            lambda a, s: fp8_cast_transpose(a, s, F.FP8_E5M2, max_block=64, num_warps=4))))
        for name, fn in rows:
            ms = median_ms(fn, a, s, iters=30)
            print(f"[{m}, {k}] {name:<30}{ms * 1e3:>9.1f} us  {gb / ms:>6.2f} TB/s of BF16 input", flush=True)


if __name__ == "__main__":
    main()
