"""Recipes against float64 references of the same quantized operands; delayed-scaling state;
policy resolution; a tiny model trains with every recipe."""

import io

import jax
import jax.extend.core
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maxfp4.config import ConfigError, load_config
from maxfp4.precision import formats as F
from maxfp4.precision import resolve_policy
from maxfp4.precision.recipes.bf16 import bf16_dot
from maxfp4.precision.recipes.fp8 import fp8_current_dot, fp8_delayed_dot, fp8_delayed_with_reciprocals
from maxfp4.precision.recipes.nvfp4 import _hadamard_tokens, nvfp4_dot, nvfp4_gemm_tn, nvfp4_wgrad
from maxfp4.precision.state import init_precision_state, scales_of, update_precision_state
from maxfp4.kernels.rht import rht_columns_supported

M, K, N = 64, 48, 32  # M and K multiples of 16 for NVFP4 blocks


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, M // 2, K)).astype(np.float32)
    x[0, 3, 5] = 40.0  # an outlier
    w = (0.1 * rng.normal(size=(K, N))).astype(np.float32)
    dy = (1e-3 * rng.normal(size=(2, M // 2, N))).astype(np.float32)
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), jnp.asarray(dy, jnp.bfloat16)


def _run(fn, x, w, dy, *args):
    y, vjp = jax.vjp(lambda x, w: fn(x, w, *args), x, w)
    dx, dw = vjp(dy)
    return [np.asarray(a, np.float64) for a in (y, dx, dw)]


def _assert_bf16_close(got, ref, what):
    """The recipes return BF16 (y, dx) or FP32 (dw) from an FP32-accumulated GEMM: error bound
    2^-8 of each element's magnitude (BF16 rounding) plus 1e-5 of the tensor's scale
    (FP32 accumulation order)."""
    tol = 2.0 ** -8 * np.abs(ref) + 1e-5 * np.abs(ref).max()
    bad = np.abs(got - ref) > tol
    assert not bad.any(), f"{what}: {bad.sum()} elements off, max err {np.abs(got - ref).max():.3g}"


def _f64(a):
    return np.asarray(a, np.float64)


def test_bf16_recipe_matches_float64_of_bf16_operands():
    x, w, dy = _operands()
    y, dx, dw = _run(bf16_dot, x, w, dy)
    xb, wb, dyb = _f64(x).reshape(M, K), _f64(jnp.asarray(w, jnp.bfloat16)), _f64(dy).reshape(M, N)
    _assert_bf16_close(y.reshape(M, N), xb @ wb, "fprop")
    _assert_bf16_close(dx.reshape(M, K), dyb @ wb.T, "dgrad")
    # Autodiff's wgrad product is BF16 too: the FP32 master gradient holds BF16-rounded values.
    _assert_bf16_close(dw, xb.T @ dyb, "wgrad")


def _fp8_reference(x, w, dy, sx, sw, sdy):
    qx = _f64(F.dequantize_fp8(F.quantize_fp8(x.reshape(M, K), sx, F.FP8_E4M3), sx))
    qw = _f64(F.dequantize_fp8(F.quantize_fp8(w, sw, F.FP8_E4M3), sw))
    qdy = _f64(F.dequantize_fp8(F.quantize_fp8(dy.reshape(M, N), sdy, F.FP8_E5M2), sdy))
    return qx @ qw, qdy @ qw.T, qx.T @ qdy


def test_fp8_current_matches_float64_of_quantized_operands():
    x, w, dy = _operands(1)
    y, dx, dw = _run(fp8_current_dot, x, w, dy)
    amax = lambda a: jnp.max(jnp.abs(a.astype(jnp.float32)))
    s = [F.scale_from_amax(amax(x), F.FP8_E4M3), F.scale_from_amax(amax(w), F.FP8_E4M3),
         F.scale_from_amax(amax(dy), F.FP8_E5M2)]
    ry, rdx, rdw = _fp8_reference(x, w, dy, *s)
    _assert_bf16_close(y.reshape(M, N), ry, "fprop")
    _assert_bf16_close(dx.reshape(M, K), rdx, "dgrad")
    _assert_bf16_close(dw, rdw, "wgrad")
    # The quantization is real: the result is not the unquantized product.
    exact = _f64(x).reshape(M, K) @ _f64(w)
    assert np.abs(y.reshape(M, N) - exact).max() > 1e-3


def test_fp8_delayed_uses_the_given_scales_and_reports_amaxes():
    x, w, dy = _operands(2)
    scales = jnp.asarray([3.0, 500.0, 2.0e6], jnp.float32)  # deliberately not the current ones
    (y, vjp) = jax.vjp(lambda x, w, s: fp8_delayed_dot(x, w, (), s), x, w, scales)
    dx, dw, amaxes = vjp(dy)
    ry, rdx, rdw = _fp8_reference(x, w, dy, *scales)
    _assert_bf16_close(_f64(y).reshape(M, N), ry, "fprop")
    _assert_bf16_close(_f64(dx).reshape(M, K), rdx, "dgrad")
    _assert_bf16_close(_f64(dw), rdw, "wgrad")
    expected = [np.abs(_f64(a)).max() for a in (x, w, dy)]
    np.testing.assert_allclose(np.asarray(amaxes), expected, rtol=0)


@pytest.mark.parametrize("options", [(), (("power_2_scale", True),)])
def test_fp8_delayed_scales_with_reciprocals_give_the_same_bits(options):
    """A layer given its scales with their reciprocals (one division for a class's whole [L, 3]
    array) computes what it computes from the three alone, and returns the amaxes in the six's
    shape, zero for the reciprocals."""
    x, w, dy = _operands(3)
    scales_L3 = jnp.asarray([[3.0, 500.0, 2.0e6], [0.7, 1.0e-3, 3.3e4]], jnp.float32)
    with_inv_L6 = fp8_delayed_with_reciprocals(scales_L3, options)
    assert with_inv_L6.shape == (2, 6)
    np.testing.assert_array_equal(with_inv_L6[:, :3], scales_L3)
    used = np.asarray(F.power_2_floor(scales_L3) if options else scales_L3)
    np.testing.assert_array_equal(with_inv_L6[:, 3:], F.div_rn(1.0, used))
    for i in range(2):
        (y3, vjp3) = jax.vjp(lambda x, w, s: fp8_delayed_dot(x, w, options, s), x, w, scales_L3[i])
        (y6, vjp6) = jax.vjp(lambda x, w, s: fp8_delayed_dot(x, w, options, s), x, w, with_inv_L6[i])
        np.testing.assert_array_equal(np.asarray(y6, np.float32), np.asarray(y3, np.float32))
        dx3, dw3, amax3 = vjp3(dy)
        dx6, dw6, amax6 = vjp6(dy)
        np.testing.assert_array_equal(np.asarray(dx6, np.float32), np.asarray(dx3, np.float32))
        np.testing.assert_array_equal(dw6, dw3)
        assert amax6.shape == (6,)
        np.testing.assert_array_equal(amax6, np.concatenate([amax3, np.zeros(3, np.float32)]))


def _calls_named(jaxpr, name: str) -> int:
    """Calls of the jitted function ``name`` anywhere in ``jaxpr``, its sub-jaxprs included."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.params.get("name") == name:
            count += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _calls_named(sub, name)
    return count


def _train_step_jaxpr(cfg):
    """The jaxpr of ``cfg``'s train step on one device, for a batch of zeros."""
    from maxfp4.optim import make_optimizer, make_schedule
    from maxfp4.parallel.mesh import make_mesh
    from maxfp4.step import make_train_step
    from maxfp4.train import init_state
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    optimizer = make_optimizer(cfg)
    state, _ = init_state(cfg, mesh, optimizer)
    step = make_train_step(cfg, resolve_policy(cfg.precision, cfg.model.n_layers), optimizer, make_schedule(cfg), mesh)
    b, t = cfg.data.global_batch, cfg.data.seq_len
    tokens = jnp.zeros((b, t), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens, "segment_ids": tokens + 1,
             "positions": jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
             "loss_mask": jnp.ones((b, t), jnp.float32)}
    return jax.make_jaxpr(step)(state, batch).jaxpr


def test_train_step_divides_fp8_scales_once_per_class_not_per_layer(tiny_cfg):
    """With unrolled blocks the step's exact divisions do not grow with depth: each class's
    reciprocals are one division of its [L, 3] array (maxfp4.precision.state.with_reciprocals),
    not one per layer (XLA gathered those into fusions of thousands of instructions)."""
    def divisions(n_layers, *overrides):
        cfg = tiny_cfg(f"model.n_layers={n_layers}", "train.scan_layers=false", "precision.default=fp8_delayed",
                       *overrides)
        return _calls_named(_train_step_jaxpr(cfg), "div_rn")

    two, four = divisions(2), divisions(4)
    assert two > 0
    assert four == two, (two, four)
    # mixture-of-experts blocks too: their grouped GEMMs' reciprocals come with the scales
    moe = ("model.kind=hybrid", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.d_ff=32")
    two, four = divisions(2, "model.pattern=*E", *moe), divisions(4, "model.pattern=*E*E", *moe)
    assert four == two, (two, four)


def _primitives_named(jaxpr, name: str) -> int:
    """Equations of primitive ``name`` anywhere in ``jaxpr``, its sub-jaxprs included."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _primitives_named(sub, name)
    return count


def test_layer_class_keys_are_the_fold_ins_they_replace():
    """``class_keys`` derives every block's and class's stochastic-rounding key at once: the
    keys ``fold_in(block key, class index)`` gives one at a time, bit for bit."""
    from maxfp4.precision import LayerPrecision, class_keys
    from maxfp4.precision.catalog import LAYER_CLASSES
    block_keys = jax.random.split(jax.random.key(11), 6).reshape(2, 3)
    keys = class_keys(block_keys)
    assert keys.shape == (2, 3, len(LAYER_CLASSES))
    policy = resolve_policy(load_config(None, []).precision, 1)
    for i in range(2):
        for j in range(3):
            lp = LayerPrecision(policy, 0, None, block_keys[i, j], keys[i, j])
            for c, layer_class in enumerate(LAYER_CLASSES):
                want = jax.random.key_data(jax.random.fold_in(block_keys[i, j], c))
                assert (jax.random.key_data(keys[i, j, c]) == want).all()
                assert (jax.random.key_data(lp.class_key(layer_class)) == want).all()


@pytest.mark.parametrize("pattern", [None, "M-*M-*"])
def test_train_step_derives_class_keys_once_per_group_not_per_gemm(tiny_cfg, pattern):
    """With unrolled blocks and NVFP4's stochastic rounding the step's key derivations do not
    grow with depth (one group of blocks: the preset's BF16 ends are ruled out): one vectorized
    fold_in per group of blocks (``class_keys``), not one per
    GEMM (XLA merged those scalar derivations across blocks into fusions of thousands of
    instructions)."""
    def fold_ins(n_layers):
        if pattern is None:
            cfg = tiny_cfg(f"model.n_layers={n_layers}", "train.scan_layers=false", "precision.default=nvfp4")
        else:  # (the tiny hybrid's widths block by 16, as NVFP4 needs)
            cfg = load_config(["configs/hybrid-tiny.yaml", "configs/precision/nvfp4.yaml"],
                              [f"model.pattern={pattern[:n_layers]}", f"model.n_layers={n_layers}",
                               "train.scan_layers=false", "data.seq_len=32", "precision.rules=[]"])
        return _primitives_named(_train_step_jaxpr(cfg), "random_fold_in")

    three, six = fold_ins(3), fold_ins(6)
    assert three > 0
    assert six == three, (three, six)


def _pow2_floor_reference(v):
    """2**floor(log2(v)) in float64 from the float32 value (NumPy's frexp: v = m 2^e, m in [0.5, 1))."""
    _, e = np.frexp(np.asarray(v, np.float64))
    return np.ldexp(1.0, e - 1)


def test_power_2_floor_clears_the_significand():
    rng = np.random.default_rng(7)
    v = np.concatenate([np.exp(rng.uniform(-80, 80, 5000)), [1.0, 2.0, 3.0, 0.75,
                        np.finfo(np.float32).max, np.finfo(np.float32).tiny]]).astype(np.float32)
    got = np.asarray(F.power_2_floor(jnp.asarray(v)), np.float64)
    np.testing.assert_array_equal(got, _pow2_floor_reference(v))
    # Subnormal scales clear to the smallest normal, not to zero.
    assert float(F.power_2_floor(jnp.float32(1e-40))) == np.finfo(np.float32).tiny


def test_power_2_scale_from_amax_rounds_the_float32_quotient_down():
    rng = np.random.default_rng(8)
    amax = np.exp(rng.uniform(-20, 20, 5000)).astype(np.float32)
    for dtype, m in ((F.FP8_E4M3, 448.0), (F.FP8_E5M2, 57344.0)):
        got = np.asarray(F.scale_from_amax(jnp.asarray(amax), dtype, power_2=True), np.float64)
        # From the correctly rounded float32 quotient, as Transformer Engine's kernel does.
        np.testing.assert_array_equal(got, _pow2_floor_reference(np.float32(m) / amax))
    # A zero amax keeps the old scale; an overflowing quotient gives 2^127 (float32 max, floored).
    got = F.scale_from_amax(jnp.asarray([0.0, 2e-38], jnp.float32), F.FP8_E4M3, power_2=True)
    np.testing.assert_array_equal(np.asarray(got), [1.0, 2.0 ** 127])


@pytest.mark.parametrize("recipe", ["fp8_current", "fp8_delayed"])
def test_power_2_scale_recipes_match_float64_of_power_2_quantized_operands(recipe):
    x, w, dy = _operands(4)
    amax = lambda a: jnp.max(jnp.abs(a.astype(jnp.float32)))
    options = (("power_2_scale", True),)
    if recipe == "fp8_current":
        y, dx, dw = _run(fp8_current_dot, x, w, dy, options)
        exact = [F.scale_from_amax(amax(x), F.FP8_E4M3), F.scale_from_amax(amax(w), F.FP8_E4M3),
                 F.scale_from_amax(amax(dy), F.FP8_E5M2)]
    else:
        # Given scales that are not powers of two (a state written without the option): the
        # recipe uses them rounded down.
        exact = [jnp.float32(3.0), jnp.float32(500.0), jnp.float32(2.0e6)]
        y, dx, dw = _run(fp8_delayed_dot, x, w, dy, options, jnp.stack(exact))
    pow2 = [jnp.float32(_pow2_floor_reference(float(s))) for s in exact]
    assert [float(p) for p in pow2] != [float(s) for s in exact]
    ry, rdx, rdw = _fp8_reference(x, w, dy, *pow2)
    _assert_bf16_close(y.reshape(M, N), ry, "fprop")
    _assert_bf16_close(dx.reshape(M, K), rdx, "dgrad")
    _assert_bf16_close(dw, rdw, "wgrad")
    # The bound tells the scales apart: the unrounded scales' operands miss it.
    ey, _, _ = _fp8_reference(x, w, dy, *exact)
    with pytest.raises(AssertionError):
        _assert_bf16_close(y.reshape(M, N), ey, "fprop with unrounded scales")


def _dot_output_dtypes(fn, *args) -> list[str]:
    """Result dtypes of the dot_generals in fn's jaxpr (custom VJP rules included)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append(str(eqn.outvars[0].aval.dtype))
            for value in eqn.params.values():  # sub-jaxprs: custom VJP rules, closed calls
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(v, "jaxpr", v)
                    if hasattr(sub, "eqns"):
                        walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return sorted(found)


@pytest.mark.parametrize("power_2", [False, True])
def test_fp8_gemms_write_bf16_only_with_power_2_scales(power_2):
    # What the GPU build turns into BF16-output cuBLASLt FP8 GEMMs (tests/test_gpu_precision.py):
    # fprop and dgrad typed BF16 with power-of-two scales; otherwise FP32 results scaled after.
    x, w, dy = _operands(5)
    options = (("power_2_scale", power_2),)

    def layer(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fp8_current_dot(x, w, options), x, w)
        return (y,) + vjp(dy)

    want = ["bfloat16", "bfloat16", "float32"] if power_2 else ["float32"] * 3
    assert _dot_output_dtypes(layer, x, w, dy) == want


def test_power_2_delayed_state_keeps_powers_of_two():
    cfg = load_config(None, ["model.n_layers=2", "precision.default=fp8_delayed",
                             "precision.recipes={fp8_delayed: {amax_history: 4, power_2_scale: true}}"])
    policy = resolve_policy(cfg.precision, 2)
    state = init_precision_state(policy, ("mlp_up",))
    amaxes = jax.tree.map(lambda s: jnp.full(s.shape, 3.0, jnp.float32), scales_of(state))
    new = update_precision_state(state, amaxes, policy)
    # 448 / 3 = 149.3 -> 128; 57344 / 3 = 19114.7 -> 16384.
    np.testing.assert_array_equal(new["blocks"]["mlp_up"]["scale"][0], [128.0, 128.0, 16384.0])


def test_delayed_state_rolls_history_and_keeps_old_scale_on_zero():
    cfg = load_config(None, ["model.n_layers=3", "precision.default=fp8_delayed",
                             "precision.recipes={fp8_delayed: {amax_history: 4, margin: 1}}"])
    policy = resolve_policy(cfg.precision, 3)
    state = init_precision_state(policy, ("attn_qkv", "attn_out", "mlp_up", "mlp_down"))
    assert set(state["blocks"]) == {"attn_qkv", "attn_out", "mlp_up", "mlp_down"}
    assert state["blocks"]["mlp_up"]["amax_history"].shape == (3, 3, 4)
    assert "lm_head" in state

    def amaxes(value):
        return jax.tree.map(lambda s: jnp.full(s.shape, value, jnp.float32), scales_of(state))

    s1 = update_precision_state(state, amaxes(8.0), policy)
    slot = s1["blocks"]["mlp_up"]
    np.testing.assert_array_equal(slot["amax_history"][0, 0], [8.0, 0, 0, 0])
    # (fp8_max / amax) / 2**margin: E4M3 for x and w, E5M2 for dY.
    np.testing.assert_allclose(slot["scale"][0], [448 / 8 / 2, 448 / 8 / 2, 57344 / 8 / 2])
    s2 = update_precision_state(s1, amaxes(2.0), policy)
    np.testing.assert_array_equal(s2["blocks"]["mlp_up"]["amax_history"][0, 0], [2.0, 8.0, 0, 0])
    # algo "max": the larger, older amax still sets the scale.
    np.testing.assert_allclose(s2["blocks"]["mlp_up"]["scale"][0, 0], 448 / 8 / 2)
    # A history of zeros (a step that saw nothing) keeps the previous scale.
    zero = update_precision_state(state, amaxes(0.0), policy)
    np.testing.assert_array_equal(zero["blocks"]["mlp_up"]["scale"], state["blocks"]["mlp_up"]["scale"])
    nan = update_precision_state(state, amaxes(float("nan")), policy)
    np.testing.assert_array_equal(nan["lm_head"]["scale"], state["lm_head"]["scale"])


NVFP4_RNE = (("rht", True), ("stochastic_rounding", False), ("weight_2d", True))


def test_nvfp4_matches_float64_of_quantized_operands():
    x, w, dy = _operands(3)
    y, dx, dw = _run(nvfp4_dot, x, w, dy, NVFP4_RNE, None, None)
    x2, dy2 = jnp.asarray(x, jnp.float32).reshape(M, K), jnp.asarray(dy, jnp.float32).reshape(M, N)
    qx = _f64(F.qdq_nvfp4(x2))
    qw_t = _f64(F.qdq_nvfp4(w.T, two_d=True))  # [N, K], 16x16 tiles
    qdy = _f64(F.qdq_nvfp4(dy2))
    _assert_bf16_close(y.reshape(M, N), qx @ qw_t.T, "fprop")
    _assert_bf16_close(dx.reshape(M, K), qdy @ qw_t, "dgrad (reuses the 2D weight tiles)")
    # The transform rounded to BF16 (TE's kernel; ml_dtypes' cast, not maxfp4's), then NVFP4.
    as_bf16 = lambda a: jnp.asarray(np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32))  # noqa: E731
    qxt = _f64(F.qdq_nvfp4(as_bf16(F.hadamard16(x2, axis=0)).T))  # [K, M], blocks along tokens
    qdyt = _f64(F.qdq_nvfp4(as_bf16(F.hadamard16(dy2, axis=0)).T))  # [N, M]
    # dW leaves in FP32, not rounded to BF16: FP32 accumulation of M products, bound
    # M 2^-24 sum |x_i dy_i| per element (a BF16 rounding would be up to 2^-9 of |dW|).
    tol = M * 2.0**-24 * (np.abs(qxt) @ np.abs(qdyt).T)
    np.testing.assert_array_less(np.abs(_f64(dw) - qxt @ qdyt.T), tol + 1e-30)
    assert np.any(np.abs(_f64(dw) - _f64(jnp.asarray(dw, jnp.bfloat16))) > tol)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4", "mxfp8", "mxfp4", "fp8_block"])
def test_weight_gradient_leaves_every_recipe_in_fp32(recipe):
    """Weight-gradient accumulation is FP32 (docs/PRECISION.md): dW leaves each recipe in FP32, and has
    more than BF16's 8 significant bits (some element differs from its BF16 rounding)."""
    from maxfp4.precision.registry import RECIPES
    fn, defaults = RECIPES[recipe].dot, RECIPES[recipe].spec.defaults
    rng = np.random.default_rng(9)
    x, w, dy = (rng.normal(size=s).astype(np.float32) for s in ((128, 128), (128, 128), (128, 128)))
    x, dy = jnp.asarray(x, jnp.bfloat16), jnp.asarray(dy, jnp.bfloat16)
    key = jax.random.key(0)
    _, vjp = jax.vjp(lambda x, w: fn(x, w, tuple(sorted(defaults.items())), None, key), x, jnp.asarray(w))
    dw = jax.jit(vjp)(dy)[1]
    assert dw.dtype == jnp.float32
    assert np.any(_f64(dw) != _f64(dw.astype(jnp.bfloat16)))


@pytest.mark.parametrize("rht,sr", [(False, False), (True, False), (True, True)])
def test_nvfp4_wgrad_in_the_activations_layout_equals_the_transposed_form(rht, sr):
    """Emulated wgrad contracts over the tokens of [M, K] and [M, N] operands; the FP4 GEMM's
    form quantizes [K, M] and [N, M]. Same operand values bit for bit (random bits included),
    so the products agree to FP32 summation order: bound 1e-6 of the largest |dW| (both FP32).
    The Pallas kernels (interpret mode here) give the XLA path's result bit for bit."""
    x, _, dy = _operands(6)
    x_MK, dy_MN = x.reshape(M, K), dy.reshape(M, N)
    key = jax.random.key(3) if sr else None
    wgrad = jax.jit(nvfp4_wgrad, static_argnums=(2, 4, 5))
    got = _f64(wgrad(x_MK, dy_MN, rht, key, False, False))
    assert rht_columns_supported(M, K) and rht_columns_supported(M, N)
    np.testing.assert_array_equal(_f64(wgrad(x_MK, dy_MN, rht, key, False, True)), got)

    def transposed(x_MK, dy_MN, key):
        if rht:
            x_MK, dy_MN = _hadamard_tokens(x_MK, True), _hadamard_tokens(dy_MN, True)
        return nvfp4_gemm_tn(F.quantize_nvfp4(x_MK.T), F.quantize_nvfp4(dy_MN.T, key=key), block_scaled=False,
                             out_dtype=jnp.float32)
    ref = _f64(jax.jit(transposed)(x_MK, dy_MN, key))
    assert np.abs(ref).max() > 0
    np.testing.assert_array_less(np.abs(got - ref), 1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("sr", [False, True])
def test_nvfp4_wgrad_kernels_per_device_on_a_mesh_equal_the_xla_path(sr):
    """Traced under a mesh (as maxfp4.train traces the step), the wgrad's kernels run on each
    device's tokens (data x fsdp = 4 devices of 16 rows; the tensor axis is not split by them):
    dW equals the XLA path's bit for bit."""
    x, _, dy = _operands(7)
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None))
    x_MK, dy_MN = jax.device_put((x.reshape(M, K), dy.reshape(M, N)), rows)
    key = jax.random.key(5) if sr else None

    def wgrad(x_MK, dy_MN, key, kernels):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return nvfp4_wgrad(x_MK, dy_MN, True, key, False, kernels)
    assert "shard_map" in str(jax.make_jaxpr(wgrad, static_argnums=3)(x_MK, dy_MN, key, True))
    per_device = jax.jit(wgrad, static_argnums=3)(x_MK, dy_MN, key, True)
    whole = jax.jit(wgrad, static_argnums=3)(x_MK, dy_MN, key, False)
    assert np.abs(_f64(whole)).max() > 0
    np.testing.assert_array_equal(_f64(per_device), _f64(whole))


def test_two_d_weight_tiles_quantize_w_and_w_transpose_identically():
    w = jax.random.normal(jax.random.key(0), (48, 32))
    np.testing.assert_array_equal(np.asarray(F.qdq_nvfp4(w, two_d=True)),
                                  np.asarray(F.qdq_nvfp4(w.T, two_d=True)).T)


def test_hadamard_leaves_the_wgrad_product_unchanged():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(64, 24)).astype(np.float32)
    dy = rng.normal(size=(64, 40)).astype(np.float32)
    hx, hdy = np.asarray(F.hadamard16(x, axis=0)), np.asarray(F.hadamard16(dy, axis=0))
    # H is orthonormal: (Hx)^T (H dy) = x^T dy; FP32 arithmetic, bound 1e-5 of the scale.
    ref = x.astype(np.float64).T @ dy
    np.testing.assert_allclose(hx.T.astype(np.float64) @ hdy, ref, atol=1e-5 * np.abs(ref).max())
    assert np.abs(hx - x).max() > 0.1  # it did transform


def test_nvfp4_stochastic_rounding_is_keyed():
    x, w, dy = _operands(5)
    opts = (("rht", True), ("stochastic_rounding", True), ("weight_2d", True))
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a = _run(nvfp4_dot, x, w, dy, opts, None, k1)
    b = _run(nvfp4_dot, x, w, dy, opts, None, k1)
    c = _run(nvfp4_dot, x, w, dy, opts, None, k2)
    np.testing.assert_array_equal(a[2], b[2])
    np.testing.assert_array_equal(a[0], c[0])  # forward has no stochastic rounding
    assert np.abs(a[2] - c[2]).max() > 0  # gradients do
    with pytest.raises(ValueError, match="PRNG key"):
        nvfp4_dot(x, w, opts, None, None)


def test_policy_first_matching_rule_wins():
    cfg = load_config(None, ["model.n_layers=8", "precision.default=fp8_delayed", """precision.rules=[
        {classes: [lm_head], recipe: bf16}, {layers: '-2:', recipe: bf16},
        {layers: [0], classes: [mlp_up], recipe: fp8_current}, {classes: [mlp_up], recipe: nvfp4}]"""])
    p = resolve_policy(cfg.precision, 8)
    assert p.recipe_for("lm_head", None) == "bf16"
    assert p.recipe_for("mlp_up", 7) == "bf16" and p.recipe_for("attn_qkv", 6) == "bf16"
    assert p.recipe_for("mlp_up", 0) == "fp8_current"
    assert p.recipe_for("mlp_up", 3) == "nvfp4" and p.recipe_for("mlp_down", 3) == "fp8_delayed"
    assert p.block_groups() == [(0, 1), (1, 6), (6, 8)]  # three scans, not eight layers
    table = p.format_table()
    assert "6-7" in table and "lm_head: bf16" in table


@pytest.mark.parametrize("override, fragment", [
    ("precision.recipes={nvfp4: {rht: 1}}", "precision.recipes.nvfp4.rht=1: expected true or false"),
    ("precision.recipes={nvfp4: {hadamard: true}}", "precision.recipes.nvfp4.hadamard: unknown option"),
    ("precision.recipes={fp8_delayed: {amax_algo: mean}}", "expected one of max, most_recent"),
    ("precision.recipes={fp8_current: {power_2_scale: yes please}}",
     "precision.recipes.fp8_current.power_2_scale='yes please': expected true or false"),
    ("precision.recipes={fp9: {}}", "precision.recipes.fp9: unknown recipe"),
    ("precision.rules=[{layers: [9], recipe: bf16}]", "index 9 out of range"),
])
def test_bad_precision_options(override, fragment):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(None, [override])
    assert fragment in str(err.value)


# 50 steps of a 64-wide model (d_ff 128): the loss falls further than in 60 steps of a 96-wide
# one (d_ff 256), for less work per step. Rows of 32 tokens: running the steps is about half of
# an emulated FP8 or NVFP4 run here (compiling the rest), and it halves with the tokens.
TINY_TRAIN = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
              "model.d_ff=128", "model.vocab_size=512", "data.source=builtin", "data.seq_len=32",
              "data.global_batch=8", "train.steps=50", "train.log_every=20", "optim.lr=3e-3",
              "optim.warmup_steps=5", "precision.recipes={fp8_delayed: {amax_history: 16}}"]


@pytest.fixture(scope="module")
def bf16_final_loss(tmp_path_factory):
    from maxfp4.train import train
    out = tmp_path_factory.mktemp("bf16")
    recs = train(load_config(None, TINY_TRAIN + [f"run.output_dir={out}"]), devices=jax.devices()[:1],
                 stream=io.StringIO())
    return recs[-1]["loss"]


@pytest.mark.parametrize("recipe, extra", [
    ("fp8_delayed", []), ("fp8_current", []), ("nvfp4", []),
    ("fp8_delayed", ["precision.recipes={fp8_delayed: {amax_history: 16, power_2_scale: true}}"])])
def test_tiny_model_trains_close_to_bf16(recipe, extra, bf16_final_loss, tmp_path):
    from maxfp4.train import train
    recs = train(load_config(None, TINY_TRAIN + [f"run.output_dir={tmp_path}", f"precision.default={recipe}"] + extra),
                 devices=jax.devices()[:1], stream=io.StringIO())
    first, last = recs[0]["loss"], recs[-1]["loss"]
    # It learns: measured drops 1.58-1.59 (BF16 1.58), at least 0.32 above the bound (rows of 64
    # tokens: 1.82-1.87, bound 1.5; the 96-wide model after 60 steps: 1.73-1.82).
    assert first - last > 1.25
    # Within 0.15 nats of BF16 after 50 steps (measured gaps: FP8 0.002-0.007, NVFP4 0.005; rows
    # of 64 tokens: FP8 0.004-0.037, NVFP4 0.012).
    assert abs(last - bf16_final_loss) < 0.15, (recipe, last, bf16_final_loss)


def test_smooth_swiglu_same_function_less_fp8_error():
    from maxfp4.model.layers import swiglu_mlp
    from maxfp4.precision import LayerPrecision
    rng = np.random.default_rng(6)
    D, Fh = 32, 64
    x = jnp.asarray(rng.normal(size=(2, 16, D)), jnp.bfloat16)
    w_up = rng.normal(size=(D, Fh, 2)).astype(np.float32) * 0.2
    w_up[:, 3, :] *= 12.0  # one outlier channel in the SwiGLU product
    w_down = jnp.asarray(rng.normal(size=(Fh, D)).astype(np.float32) * 0.2)
    w_up = jnp.asarray(w_up)

    def run(default, smooth):
        cfg = load_config(None, [f"precision.default={default}"])
        lp = LayerPrecision(resolve_policy(cfg.precision, 1), 0)
        return np.asarray(swiglu_mlp(x, w_up, w_down, lp, smooth=smooth), np.float64)

    plain, smoothed = run("bf16", False), run("bf16", True)
    # Same function: only BF16 rounding of the rescaled operands differs (bound 2e-2 relative).
    assert np.linalg.norm(plain - smoothed) <= 2e-2 * np.linalg.norm(plain)
    err = lambda y: np.linalg.norm(y - plain) / np.linalg.norm(plain)
    assert err(run("fp8_current", True)) < err(run("fp8_current", False))


def test_row_block_scales_expand_2d_tiles_like_block_dequantize():
    """The scales handed to the Blackwell block-scaled GEMM describe the same values as the
    emulated path: elements x per-row block scales == block_dequantize, bit for bit."""
    from maxfp4.precision.recipes.nvfp4 import _row_block_scales
    w = jax.random.normal(jax.random.key(3), (48, 64))
    for two_d in (False, True):
        q = F.quantize_nvfp4(w, two_d=two_d)
        rows = _row_block_scales(q).astype(jnp.float32)  # [48, 4]
        assert rows.shape == (48, 4)
        manual = q.elements.astype(jnp.float32) * jnp.repeat(rows, 16, axis=-1)
        np.testing.assert_array_equal(np.asarray(manual), np.asarray(q.block_dequantize(jnp.float32)))


@pytest.mark.parametrize("spec,n_layers,want", [
    (":3%", 62, [0, 1]), ("-12%:", 62, list(range(54, 62))),
    (":3%", 52, [0, 1]), ("-12%:", 52, list(range(45, 52))),
    (":3%", 12, [0]), ("-12%:", 12, [10, 11]),
    ("85%:", 52, list(range(45, 52))),  # 44.2 rounds up to 45
    (":50%", 4, [0, 1]),  # exact shares stay exact
    ("0:3.3%", 62, [0, 1, 2]),  # 2.046 blocks: rounded up
])
def test_percent_slices_round_up_to_whole_blocks(spec, n_layers, want):
    """A percentage bound is that share of the depth rounded up, away from zero, so a share of
    either end of the stack takes at least one block."""
    from maxfp4.config import PrecisionConfig
    policy = resolve_policy(PrecisionConfig(default="nvfp4", rules=[{"layers": spec, "recipe": "bf16"}]), n_layers)
    assert [i for i, row in enumerate(policy.block_table) if row[0] == "bf16"] == want


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current"])
@pytest.mark.parametrize("layer_class", ["mlp_up", "mlp_down"])
def test_tensor_parallel_fp8_layer_gathers_its_quantized_weight_once(recipe, layer_class):
    """Under tensor=2 x fsdp=2 (4 CPU devices) a column-parallel (mlp_up) and a row-parallel
    (mlp_down) FP8 layer all-gather the quantized weight over fsdp, keeping its tensor split, in
    one collective of its narrow elements (E4M3; CPU collectives widen them to f16, exact). Left
    to XLA (no layer class in the options) the devices exchanged two FP32 copies, dequantized:
    on GPU that also hides the FP8 operand from the GEMM rewriter. The results equal the same
    layer on one device (same FP8 values; FP32 sums in another order: 1e-5 relative)."""
    from maxfp4.precision.catalog import LAYER_CLASS_OPTION
    from tests.sharded_layer import all_gathers, forward_and_grads, layer_operands

    fn = fp8_delayed_dot if recipe == "fp8_delayed" else fp8_current_dot
    mesh = jax.make_mesh((1, 2, 2), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=jax.devices()[:4])
    column = layer_class == "mlp_up"
    k, n = (256, 512) if column else (512, 256)
    x, w, dy = layer_operands(mesh, layer_class, k, n, tokens=64)

    def gathers(options):
        jitted = jax.jit(forward_and_grads(fn, options, mesh))
        return all_gathers(jitted.lower(x, w, dy).compile().as_text()), jitted(x, w, dy)

    left_to_xla, _ = gathers(())
    assert len(left_to_xla) == 2 and {t for t, _ in left_to_xla} == {"f32"}, left_to_xla
    pinned, results = gathers(((LAYER_CLASS_OPTION, layer_class),))
    kept_split = f"{k},{n // 2}" if column else f"{k // 2},{n}"
    assert pinned in ([("f8e4m3fn", kept_split)], [("f16", kept_split)]), pinned
    one = jax.jit(forward_and_grads(fn, ()))(*(jax.device_put(a, jax.devices()[0]) for a in (x, w, dy)))
    for got, ref in zip(results, one):
        got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
        assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref)
