"""On GPU: the Pallas SSD, convolution and gated-norm kernels compile through Triton (not interpret mode)
and match their references (the sequential scan; the jax.numpy convolution), forward and
gradients, with packed segments.

Bounds: FP32 operands (ieee FP32 dots) 1e-4 of max |y| (FP32 rounding over T=256 positions,
~1e-6 typical; the margin covers differing summation orders); BF16 operands as on CPU (2e-2,
1e-1 for dL/dA, see test_ssd.py); convolution and gated norm 1e-5 (FP32 sums over at most
1024 terms; as on CPU, test_conv_kernel.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.kernels.conv import causal_conv_silu, conv_backward, conv_forward
from maxfp4.kernels.epilogue import Quantize
from maxfp4.kernels.gated_norm import gated_norm_fused
from maxfp4.model.mamba import causal_conv, gated_group_norm
from maxfp4.model.ssd import ssd_reference
from maxfp4.kernels import ssd_mosaic
from maxfp4.kernels.ssd import Tiling, chunk_outputs, kernel_inputs, ssd_fused
from tests.test_ssd import ARG_NAMES, _inputs, _rel

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("matmul_dtype", [None, jnp.bfloat16])
def test_compiled_kernel_matches_reference(matmul_dtype):
    """With the D skip (the kernel adds D x): y + D x of the scan, and D's gradient too."""
    b, t, h, p, g, n, q = 2, 256, 4, 64, 2, 64, 64
    args = _inputs(1, b, t, h, p, g, n, dtype=np.float32)
    args += (jnp.asarray(np.random.default_rng(5).uniform(0.5, 1.5, h), jnp.float32),)
    ids = jnp.asarray(np.repeat(np.array([[1, 2, 3], [4, 4, 5]], np.int32), [70, 100, 86], axis=1))
    w = jnp.asarray(np.random.default_rng(2).standard_normal((b, t, h, p)), jnp.float32)

    def fused(x, dt, A, B, C, D, ids):
        return ssd_fused(x, dt, A, B, C, ids, q, matmul_dtype=matmul_dtype, interpret=False, D_H=D)

    def reference(x, dt, A, B, C, D, ids):
        return ssd_reference(x, dt, A, B, C, ids) + D[:, None] * x
    hlo = jax.jit(fused).lower(*args, ids).compile().as_text()
    assert "triton" in hlo.lower(), "the kernel did not compile through Triton"

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a, ids) * w)
    with jax.default_matmul_precision("highest"):
        y_ref = jax.jit(reference)(*args, ids)
        g_ref = jax.jit(jax.grad(loss(reference), argnums=range(6)))(*args)
    y = jax.jit(fused)(*args, ids)
    g_got = jax.jit(jax.grad(loss(fused), argnums=range(6)))(*args)
    fwd_bound = 1e-4 if matmul_dtype is None else 2e-2
    assert _rel(y, y_ref) < fwd_bound
    for name, a, e in zip(ARG_NAMES + ("D",), g_got, g_ref):
        bound = fwd_bound if matmul_dtype is None else (1e-1 if name == "A" else 2e-2)
        assert _rel(a, e) < bound, name


def test_compiled_conv_kernel_matches_reference():
    rng = np.random.default_rng(3)
    b, t, c = 2, 256, 320
    x = jnp.asarray(rng.standard_normal((b, t, c)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, c)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(c), jnp.float32)
    ids = jnp.asarray(np.repeat(np.array([[1, 2, 3], [4, 4, 5]], np.int32), [70, 100, 86], axis=1))
    dout = jnp.asarray(rng.standard_normal((b, t, c)), jnp.float32)
    kernel = jax.jit(lambda *a: causal_conv_silu(*a, ids, False))
    assert "triton" in kernel.lower(x, w, bias).compile().as_text().lower()

    def reference(x, w, bias):
        return jax.nn.silu(causal_conv(x, w, bias, ids))
    assert _rel(kernel(x, w, bias), reference(x, w, bias)) < 1e-5
    g_got = jax.jit(jax.grad(lambda *a: jnp.sum(kernel(*a) * dout), argnums=(0, 1, 2)))(x, w, bias)
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(reference(*a) * dout), argnums=(0, 1, 2)))(x, w, bias)
    for name, a, e in zip(("x", "w", "b"), g_got, g_ref):
        assert _rel(a, e) < 1e-5, name


def test_compiled_gated_norm_kernel_matches_reference():
    """Gated norm epilogue through Triton against its jax.numpy form, FP32 (1e-5)."""
    rng = np.random.default_rng(4)
    b, t, e, groups = 2, 64, 1024, 2
    u = jnp.asarray(rng.standard_normal((b, t, e)), jnp.float32)
    zx = jnp.asarray(rng.standard_normal((b, t, e + 200)), jnp.float32)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, e), jnp.float32)
    dout = jnp.asarray(rng.standard_normal((b, t, e)), jnp.float32)

    def kernel(u, zx, scale):
        return gated_norm_fused(u, zx, scale, groups, 1e-5, jnp.float32, False)

    def reference(u, zx, scale):
        return gated_group_norm(u, zx[..., :e], scale, groups, 1e-5)

    args = (u, zx, scale)
    assert "triton" in jax.jit(kernel).lower(*args).compile().as_text().lower()
    assert _rel(jax.jit(kernel)(*args), reference(*args)) < 1e-5
    g_got = jax.jit(jax.grad(lambda *a: jnp.sum(kernel(*a) * dout), argnums=range(3)))(*args)
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(reference(*a) * dout), argnums=range(3)))(*args)
    for name, a, r in zip(("u", "zxbcdt", "scale"), g_got, g_ref):
        assert _rel(a, r) < 1e-5, name


def test_unrolled_save_gemm_runs_the_forward_kernels_again_in_the_backward_pass():
    """With unrolled blocks and train.remat=save_gemm, the compiled gradient launches each
    Mamba-2 forward kernel twice per block (forward, then recomputed for the backward pass); with
    remat none, once. (Before the recomputation had its barrier, XLA merged the two.)"""
    import re

    from maxfp4.config import load_config
    from maxfp4.model import get_model
    from maxfp4.precision import resolve_policy

    cfg = load_config("configs/hybrid-tiny.yaml", ["model.mamba.kernels=pallas", "model.mamba.head_dim=16",
                                                   "model.mamba.chunk_size=16"])
    model = get_model(cfg.model)
    params = model.init_params(cfg.model, jax.random.key(0))
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    t = cfg.data.seq_len
    tok = jnp.zeros((2, t), jnp.int32)
    pos, seg = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (2, t)), jnp.ones((2, t), jnp.int32)
    launches = {}
    for remat in ("none", "save_gemm"):
        def loss(p, remat=remat):
            logits = model.forward(p, tok, pos, seg, cfg=cfg.model, policy=policy, remat=remat, scan_layers=False)
            return jnp.sum(logits.astype(jnp.float32))
        hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
        launches[remat] = len(re.findall(r'name = "_forward_kernel', hlo))
    assert launches["none"] > 0 and launches["save_gemm"] == 2 * launches["none"], launches


def test_compiled_mixer_core_assembles_the_in_proj_gradient_in_place():
    """Compiled, the kernel core's in_proj gradient buffer starts uninitialised outside z's
    columns: every other column must be written (dt's in place, x/B/C's by the aliased
    convolution kernel). Against the piece-by-piece core: equal up to one BF16 rounding of the
    largest value (2^-8 relative to max |g|, for XLA fusing the small FP32 parts differently);
    garbage or an unwritten column would be off by O(1) or not finite."""
    from tests.test_hybrid import mixer_core_outputs_and_gradients

    value, grads = mixer_core_outputs_and_gradients("_kernel_core")
    value_ref, grads_ref = mixer_core_outputs_and_gradients("_composed_core")
    assert abs(float(value) - float(value_ref)) <= 2 ** -8 * abs(float(value_ref))
    for (path, a), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(grads_ref)):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        assert np.all(np.isfinite(a)), jax.tree_util.keystr(path)
        assert np.max(np.abs(a - r)) <= 2 ** -8 * np.max(np.abs(r)), jax.tree_util.keystr(path)


def test_compiled_fp8_operands_stored_by_the_kernels_equal_the_recipes_casts():
    """Compiled, the kernels' own E5M2 store of in_proj's output gradient and E4M3 store of
    out_proj's input (Triton's casts) give the recipes' path (XLA's casts of the BF16 tensors):
    the same output, and every gradient within 2^-20 of its largest value: the FP8 operands are
    the same, but XLA may tile a GEMM differently when an operand comes from a kernel, and FP32
    accumulation order moves the last bit (measured: 1 of 8192 elements of out_proj's weight
    gradient, by 1 ulp). Except where dt's columns of in_proj's gradient enter: XLA may cast
    dt's gradient from FP32 in the recipes' path (it allows excess precision), where the fused
    path rounds it to BF16 first as specified. There in_proj's weight gradient agrees to one
    E5M2 step (2^-2 of the column's largest value) and dY's amax to one BF16 rounding (2^-8)."""
    from maxfp4.model import mamba
    from tests.test_hybrid import TINY, _fp8_mixer_value_and_grads
    from maxfp4.config import load_config

    cfg = load_config(TINY, ["model.mamba.head_dim=16"]).model
    d = mamba.dims(cfg)
    dt_cols = slice(d["E"] + d["conv"], d["in"])
    used, (value, grads) = _fp8_mixer_value_and_grads(True)
    not_used, (value_ref, grads_ref) = _fp8_mixer_value_and_grads(False)
    assert used and not not_used
    assert value == value_ref
    from maxfp4.model.mamba_layout import columns, in_proj_parts
    # in_proj is stored group by group: compare it in the [D, I] column order dt_cols indexes
    dw, dw_ref = (columns(np.asarray(g[1]["in_proj"]), in_proj_parts(cfg)) for g in (grads, grads_ref))
    other = np.delete(np.arange(dw.shape[1]), np.r_[dt_cols])
    assert np.max(np.abs(dw[:, other] - dw_ref[:, other])) <= 2.0 ** -20 * np.max(np.abs(dw_ref[:, other]))
    bound = 2.0 ** -2 * np.max(np.abs(dw_ref[:, dt_cols]), axis=0)
    assert np.all(np.abs(dw[:, dt_cols] - dw_ref[:, dt_cols]) <= bound)
    amax, amax_ref = float(grads[2]["mamba_in"][2]), float(grads_ref[2]["mamba_in"][2])
    assert abs(amax - amax_ref) <= 2.0 ** -8 * amax_ref
    rest = (grads[0], {k: v for k, v in grads[1].items() if k != "in_proj"}, grads[2]["mamba_out"],
            grads[2]["mamba_in"][:2])
    rest_ref = (grads_ref[0], {k: v for k, v in grads_ref[1].items() if k != "in_proj"},
                grads_ref[2]["mamba_out"], grads_ref[2]["mamba_in"][:2])
    for (path, a), r in zip(jax.tree_util.tree_leaves_with_path(rest), jax.tree_util.tree_leaves(rest_ref)):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        assert np.max(np.abs(a - r)) <= 2.0 ** -20 * np.max(np.abs(r)), jax.tree_util.keystr(path)


def test_tensor_parallel_mixer_on_two_gpus_equals_one_gpu(tiny_cfg):
    """The mixer split over tensor=2 (2 groups, one a GPU; the Triton kernels under shard_map on
    each GPU's heads and channels) against one GPU running it whole: loss and gradients agree to
    BF16 rounding (``tests/test_step._assert_same_gradients``). Needs 2 GPUs."""
    from tests.test_step import _PALLAS_MIXER, _assert_same_gradients, _gradients

    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("tensor parallelism needs 2 GPUs")
    hybrid = ["model.kind=hybrid", "model.pattern=M*-", "model.mamba.head_dim=16", "model.mamba.n_groups=2",
              "model.mamba.expand=3", *_PALLAS_MIXER]
    one, _ = _gradients(tiny_cfg("mesh.data=1", *hybrid), gpus[:1])
    two, _ = _gradients(tiny_cfg("mesh.data=1", "mesh.fsdp=1", "mesh.tensor=2", *hybrid), gpus[:2])
    _assert_same_gradients(one, two)


def test_mosaic_forward_matches_the_triton_kernel_at_the_benchmark_shapes():
    """mamba2-1p3b's SSD a layer (2 of its 8 rows): the Mosaic GPU forward, compiled, against the
    Triton one, bound as in tests/test_ssd_mosaic.py: one BF16 step of values up to half the
    largest (summation order and exp; the earlier probe's largest difference: 0.031 at 22.9)."""
    assert ssd_mosaic.available()
    b, t, h, p, g, n, q = 2, 2048, 64, 64, 1, 128, 128
    x, dt, A, B, C = _inputs(7, b, t, h, p, g, n, dtype=np.float32, dt_range=(0.01, 0.3))
    ids = jnp.asarray(np.repeat(np.array([[1, 2, 3], [4, 4, 4]], np.int32), [700, 1000, 348], axis=1))
    inputs = jax.jit(lambda *a: kernel_inputs(*a, ids, q, jnp.bfloat16))(x.astype(jnp.bfloat16), dt, A, B, C)
    d = jnp.broadcast_to(jnp.linspace(0.5, 1.5, h, dtype=jnp.float32)[:, None], (h, p))
    mosaic = jax.jit(lambda *a: ssd_mosaic.chunk_outputs_forward(*a, jnp.bfloat16))
    assert "mosaic_gpu" in mosaic.lower(*inputs, d).as_text()
    y_m = np.asarray(mosaic(*inputs, d), np.float64)
    y_t = np.asarray(jax.jit(lambda *a: chunk_outputs(*a, jnp.bfloat16, jnp.bfloat16, False, Tiling(heads=16)))(
        *inputs, d), np.float64)
    assert np.abs(y_t).max() > 1
    assert np.abs(y_m - y_t).max() <= 2.0 ** -8 * np.abs(y_t).max()
    assert np.mean(y_m == y_t) >= 0.99


def test_mosaic_input_gradients_match_the_triton_kernel_at_the_benchmark_shapes():
    """The backward's Mosaic GPU kernels (``ssd_fused(backward="mosaic")``: input and score
    gradients, and the recurrence between chunks, forward and backward), compiled, against the Triton kernels' gradients through the whole SSD; bound as
    for BF16 operands on CPU (test_ssd_kernel.py: 2e-2 of the largest, 1e-1 for dL/dA)."""
    b, t, h, p, g, n, q = 2, 2048, 64, 64, 1, 128, 128
    x, dt, A, B, C = _inputs(9, b, t, h, p, g, n, dtype=np.float32, dt_range=(0.01, 0.3))
    args = (x.astype(jnp.bfloat16), dt, A, B.astype(jnp.bfloat16), C.astype(jnp.bfloat16))
    ids = jnp.asarray(np.repeat(np.array([[1, 2, 3], [4, 4, 4]], np.int32), [700, 1000, 348], axis=1))
    w = jnp.cos(jnp.arange(b * t * h * p, dtype=jnp.float32).reshape(b, t, h, p))

    def grads(backward):
        def loss(*a):
            y = ssd_fused(*a, ids, q, matmul_dtype=jnp.bfloat16, interpret=False, backward=backward)
            return jnp.sum(y.astype(jnp.float32) * w)
        return jax.jit(jax.grad(loss, argnums=range(5)))(*args)
    for name, got, want in zip(ARG_NAMES, grads("mosaic"), grads("triton")):
        assert _rel(got, want) < (1e-1 if name == "A" else 2e-2), name


def test_mosaic_conv_forward_matches_the_triton_kernel_at_the_benchmark_shapes():
    """mamba2-1p3b's convolution a layer (2 of its 8 rows, 4 documents a row): the Mosaic GPU
    forward, compiled, against the Triton one. Same sums in the same order; the sigmoid's exp is
    ex2.approx there (2 ulp in FP32), so an output may differ by one BF16 step."""
    b, t, c, width = 2, 2048, 4352, 4
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((b, t, c)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((width, c)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(c) * 0.1, jnp.float32)
    ids = jnp.asarray(np.repeat(np.arange(b * 4).reshape(b, 4), t // 4, axis=1), jnp.int32)
    y = {k: np.asarray(jax.jit(lambda *a, k=k: conv_forward(*a, ids, False, kernel=k)[0])(x, w, bias), np.float32)
         for k in ("triton", "mosaic")}
    assert np.abs(y["triton"]).max() > 1
    assert np.abs(y["mosaic"] - y["triton"]).max() <= 2.0 ** -7 * np.abs(y["triton"]).max()
    assert np.mean(y["mosaic"] == y["triton"]) >= 0.99
    # x read in place from in_proj's [B, T, 8512] output at column 4096: the same outputs.
    zx = jnp.zeros((b, t, 8512), jnp.bfloat16).at[..., 4096:4096 + c].set(x)
    in_place = jax.jit(lambda *a: conv_forward(zx[..., 4096:4096 + c], *a, ids, False, kernel="mosaic",
                                               source_BTI=zx, source_offset=4096)[0])(w, bias)
    np.testing.assert_array_equal(np.asarray(in_place, np.float32), y["mosaic"])
    # The backward's first kernel: dx within one BF16 step, dw and db to FP32 summation order.
    residuals = {k: jax.jit(lambda *a, k=k: conv_forward(*a, ids, False, kernel=k)[1])(x, w, bias)
                 for k in ("triton", "mosaic")}
    dout = jnp.asarray(rng.standard_normal((b, t, c)), jnp.bfloat16)
    grads = {k: jax.jit(lambda res, d, k=k: conv_backward(res, d, False, kernel=k))(residuals[k], dout)
             for k in ("triton", "mosaic")}
    for name, got, want in zip(("dx", "dw", "db"), grads["mosaic"], grads["triton"]):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        bound = 2.0 ** -7 if name == "dx" else 1e-5
        assert np.abs(got - want).max() <= bound * np.abs(want).max(), name
    # Into in_proj's gradient at column 4096 of 8512, BF16 and E5M2 (the FP8 recipe's store):
    # the other columns are the wider array's own (the output is its buffer), dx's as above.
    for dtype in (jnp.bfloat16, jnp.float8_e5m2):
        into = jnp.full((b, t, 8512), 3.0, dtype)
        quantize = Quantize(jnp.float32(2.0), dtype) if dtype == jnp.float8_e5m2 else None
        out = {k: jax.jit(lambda res, d, into, k=k: conv_backward(res, d, False, into_BTI=into, column_offset=4096,
                                                                   quantize=quantize, kernel=k))(residuals[k], dout,
                                                                                                 into)
               for k in ("triton", "mosaic")}
        got, want = np.asarray(out["mosaic"][0], np.float32), np.asarray(out["triton"][0], np.float32)
        assert (got[..., :4096] == 3.0).all() and (got[..., 4096 + c:] == 3.0).all()
        step = 2.0 ** -2 if quantize else 2.0 ** -7  # one E5M2 (or BF16) step of the largest
        assert np.abs(got - want).max() <= step * np.abs(want).max()
        if quantize:
            assert abs(float(out["mosaic"][3]) - float(out["triton"][3])) <= 2.0 ** -7 * float(out["triton"][3])


def _assert_convolutions_agree(got: dict, offset: int, c: int) -> None:
    """Mosaic's (y, dx into in_proj's gradient, dw, db) against Triton's: one BF16 step for y and
    dx, FP32 summation order for dw and db (as at the benchmark shapes), and the gradient's
    columns outside [offset, offset + c) left as they were (3.0)."""
    for name, a, want, bound in zip(("y", "dx", "dw", "db"), got["mosaic"], got["triton"],
                                    (2.0 ** -7, 2.0 ** -7, 1e-5, 1e-5)):
        assert np.abs(a - want).max() <= bound * np.abs(want).max(), name
    dx = got["mosaic"][1]
    assert (dx[..., :offset] == 3.0).all() and (dx[..., offset + c:] == 3.0).all()


@pytest.mark.parametrize("b, t, c, in_width, offset", [(4, 256, 640, 1160, 512), (4, 256, 640, 1216, 512),
                                                     (2, 2048, 640, 1160, 512), (2, 256, 4352, 8512, 4096)])
def test_mosaic_conv_matches_the_triton_kernel_at_small_shapes(b, t, c, in_width, offset):
    """The Mosaic GPU convolution against the Triton one, compiled, as the mixer runs them (x
    read in place from in_proj's output at ``offset``, dx written into a BF16 in_proj gradient
    there): forward, dx, dw, db, and the gradient's other columns kept. The first shape is
    tests/test_gpu_pipeline.py's hybrid (d_model 256: E 512, 640 channels, in_proj 1,160
    wide), where unequal stages with FP8 gave gradients ~10% from fsdp=2 on two H200s, and
    within 3.4e-3 with every kernel on Triton: by the kernels' selection rules the convolution was
    the one kernel the two sides ran differently (the stages' fused FP8 path on Triton, whose E5M2
    store Mosaic does not lower at that width; fsdp=2's BF16 path on Mosaic). The others vary one
    of its dimensions toward the benchmark shapes, where the two kernels agree. Bounds as at
    the benchmark shapes: one BF16 step for y and dx, FP32 summation order for dw and db."""
    rng = np.random.default_rng(4)
    zx = jnp.asarray(rng.standard_normal((b, t, in_width)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, c)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(c) * 0.1, jnp.float32)
    ids = jnp.zeros((b, t), jnp.int32).at[:, t // 3:].set(1)  # two documents a row
    dout = jnp.asarray(rng.standard_normal((b, t, c)), jnp.bfloat16)
    into = jnp.full((b, t, in_width), 3.0, jnp.bfloat16)
    got = {}
    for k in ("triton", "mosaic"):
        y, res = jax.jit(lambda zx, w, bias, k=k: conv_forward(zx[..., offset:offset + c], w, bias, ids, False,
                                                                kernel=k, source_BTI=zx, source_offset=offset))(zx, w, bias)
        dx, dw, db = jax.jit(lambda res, d, into, k=k: conv_backward(res, d, False, into_BTI=into, column_offset=offset,
                                                                     kernel=k, source_offset=offset))(res, dout, into)[:3]
        got[k] = [np.asarray(v, np.float32) for v in (y, dx, dw, db)]
    _assert_convolutions_agree(got, offset, c)


def test_mosaic_conv_matches_the_triton_kernel_inside_shard_map():
    """The same comparison at the pipeline test's hybrid shapes, each kernel run on every local
    GPU's rows under ``jax.shard_map`` (as the mixer's kernels run on a mesh,
    maxfp4.parallel.mesh.per_batch_row): x read in place and dx written into in_proj's gradient
    there, forward, dx, dw and db within the single-GPU test's bounds."""
    from jax.sharding import PartitionSpec as P
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    b, t, c, in_width, offset = 2 * n, 256, 640, 1160, 512
    rng = np.random.default_rng(5)
    zx = jnp.asarray(rng.standard_normal((b, t, in_width)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((4, c)) * 0.3, jnp.float32)
    bias = jnp.asarray(rng.standard_normal(c) * 0.1, jnp.float32)
    ids = jnp.zeros((b, t), jnp.int32)
    dout = jnp.asarray(rng.standard_normal((b, t, c)), jnp.bfloat16)
    into = jnp.full((b, t, in_width), 3.0, jnp.bfloat16)

    def run(kernel):
        def per_device(zx, ids, dout, into, w, bias):
            y, res = conv_forward(zx[..., offset:offset + c], w, bias, ids, False, kernel=kernel, source_BTI=zx,
                                  source_offset=offset)
            dx, dw, db = conv_backward(res, dout, False, into_BTI=into, column_offset=offset, kernel=kernel,
                                       source_offset=offset)[:3]
            return y, dx, jax.lax.psum(dw, "data"), jax.lax.psum(db, "data")
        rows = P("data")
        return jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(rows, rows, rows, rows, P(), P()),
                                     out_specs=(rows, rows, P(), P()), check_vma=False))(zx, ids, dout, into, w, bias)
    got = {k: [np.asarray(v, np.float32) for v in run(k)] for k in ("triton", "mosaic")}
    _assert_convolutions_agree(got, offset, c)


@pytest.mark.parametrize("fp8", [False, True])
def test_mosaic_gated_norm_matches_the_triton_kernels_at_the_benchmark_shapes(fp8):
    """mamba2-1p3b's gated norm a layer (2 of its 8 rows; E = 4,096 in one group, in_proj 8,512
    wide), compiled: the Mosaic GPU kernels against the Triton ones, forward (BF16 or E4M3 store)
    and backward (du, dz in BF16 or E5M2 with its max, the scale's gradient). The row sums run
    in another order and exp is ex2.approx: an output may differ by one step of its format."""
    from maxfp4.kernels import gated_norm as triton_norm
    from maxfp4.kernels import gated_norm_mosaic as mosaic_norm
    b, t, e, width = 2, 2048, 4096, 8512
    rng = np.random.default_rng(7)
    u = jnp.asarray(rng.standard_normal((b, t, e)), jnp.bfloat16)
    zx = jnp.asarray(rng.standard_normal((b, t, width)), jnp.bfloat16)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(e), jnp.float32)
    dout = jnp.asarray(rng.standard_normal((b, t, e)), jnp.bfloat16)
    forward_q = Quantize(jnp.float32(8.0), jnp.float8_e4m3fn) if fp8 else None
    backward_q = Quantize(jnp.float32(8.0), jnp.float8_e5m2) if fp8 else None

    def run(module):
        fwd = jax.jit(lambda u, zx, s: module.gated_norm_forward(u, zx, s, 1, 1e-5, jnp.bfloat16, False, forward_q)[0])
        bwd = jax.jit(lambda u, zx, s, d: module.gated_norm_backward((u, zx, s), d, 1, 1e-5, False, backward_q))
        return fwd(u, zx, scale), bwd(u, zx, scale, dout)
    got, want = run(mosaic_norm), run(triton_norm)
    step = (2.0 ** -3, 2.0 ** -2) if fp8 else (2.0 ** -7, 2.0 ** -7)  # E4M3 / E5M2 or BF16
    pairs = [("out", got[0][0] if fp8 else got[0], want[0][0] if fp8 else want[0], step[0]),
             ("du", got[1][0], want[1][0], 2.0 ** -7), ("dz", got[1][1][..., :e], want[1][1][..., :e], step[1])]
    for name, a, w, bound in pairs:
        a, w = np.asarray(a, np.float32), np.asarray(w, np.float32)
        assert np.mean(a == w) >= 0.999, name
        assert np.abs(a - w).max() <= bound * np.abs(w).max(), name
    dscale, want_dscale = np.asarray(got[1][2], np.float64), np.asarray(want[1][2], np.float64)
    assert np.abs(dscale - want_dscale).max() <= 1e-5 * np.abs(want_dscale).max()
    if fp8:
        for a, w in ((got[0][1], want[0][1]), (got[1][3], want[1][3])):
            assert abs(float(a) - float(w)) <= 2.0 ** -7 * float(w)


def test_auto_takes_the_mosaic_kernels_measured_faster_on_hopper():
    """``model.mamba.kernel_backend=auto`` on a Hopper GPU at mamba2-1p3b's shapes: the gated
    norm's Mosaic kernels (measured faster, docs/PERFORMANCE.md) and Triton's convolution
    (mamba._conv_kernels says why); ``mosaic`` takes the convolution's too, ``triton`` none."""
    from maxfp4.config import load_config
    from maxfp4.kernels import gated_norm as triton_norm
    from maxfp4.kernels import gated_norm_mosaic as mosaic_norm
    from maxfp4.model import mamba
    if not ssd_mosaic.available():
        pytest.fail("this GPU is not Hopper: the Mosaic kernels do not run here")
    wanted = {"auto": ("triton", mosaic_norm, mosaic_norm), "mosaic": ("mosaic", mosaic_norm, mosaic_norm),
              "triton": ("triton", triton_norm, triton_norm)}
    for backend, want in wanted.items():
        cfg = load_config("configs/mamba2-1p3b.yaml", [f"model.mamba.kernel_backend={backend}"]).model
        d = mamba.dims(cfg)
        x = jnp.zeros((8, 2048, d["conv"]), jnp.bfloat16)
        u, zx = jnp.zeros((8, 2048, d["E"]), jnp.bfloat16), jnp.zeros((8, 2048, d["in"]), jnp.bfloat16)
        w, bias, scale = jnp.zeros((4, d["conv"])), jnp.zeros((d["conv"],)), jnp.zeros((d["E"],))
        got = (mamba._conv_kernels(cfg, x, w, bias), mamba._norm_kernels(cfg, u, zx, scale, "forward"),
               mamba._norm_kernels(cfg, u, zx, scale, "backward"))
        assert got == want, backend
