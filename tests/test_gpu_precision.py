"""On GPU: the FP8 recipes compile all three GEMMs of a linear layer to cuBLASLt FP8 GEMMs with
the fast operand layout (both operands contracting on their minor dimension, "TN"), and the
scale arithmetic (div_rn, the NVFP4 quantizer) gives the CPU's bits."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.compiler import compiler_options
from maxfp4.precision.recipes.fp8 import fp8_current_dot, fp8_delayed_dot
from tests.sharded_layer import all_gathers, forward_and_grads, layer_operands

pytestmark = pytest.mark.gpu


def _f8_gemms(hlo: str) -> list[tuple[str, dict]]:
    """(output dtype, dot dimension numbers) of each cuBLASLt FP8 GEMM of an optimized HLO."""
    gemms = []
    for line in hlo.splitlines():
        if "__cublas$lt$matmul$f8" in line and "custom-call(" in line:
            m = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', line)
            out = re.search(r"=\s*\(?(\w+)\[", line)
            gemms.append((out.group(1) if out else "?", json.loads(m.group(1)) if m else {}))
    return gemms


@pytest.mark.parametrize("recipe, power_2", [("fp8_delayed", False), ("fp8_current", False),
                                             ("fp8_delayed", True), ("fp8_current", True)])
def test_all_three_gemms_are_cublaslt_fp8_tn(recipe, power_2):
    fn = fp8_delayed_dot if recipe == "fp8_delayed" else fp8_current_dot
    options = (("power_2_scale", power_2),)
    x = jax.random.normal(jax.random.key(0), (4, 512, 1024), jnp.bfloat16)
    w = 0.02 * jax.random.normal(jax.random.key(1), (1024, 2048), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (4, 512, 2048), jnp.bfloat16)
    scales = jnp.asarray([50.0, 5000.0, 1000.0], jnp.float32)

    def layer(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, options, scales, None), x, w)
        return (y,) + vjp(dy)[:2]

    # Compiled with the trainer's options (maxfp4.compiler): Triton GEMM fusions would take one GEMM.
    jitted = jax.jit(layer, compiler_options=compiler_options("gpu"))
    hlo = jitted.lower(x, w, dy).compile().as_text()
    gemms = _f8_gemms(hlo)
    assert len(gemms) == 3, f"expected 3 FP8 GEMMs, found {len(gemms)}"
    for _, c in gemms:
        assert c.get("lhs_contracting_dimensions") == ["1"], c
        assert c.get("rhs_contracting_dimensions") == ["1"], c
    # fprop and dgrad write BF16 straight from the GEMM, whatever the scales; wgrad FP32.
    assert sorted(d for d, _ in gemms) == ["bf16", "bf16", "f32"], gemms
    # And the numbers are right: compare with the same recipe's GEMMs run on the CPU.
    gpu = [np.asarray(a, np.float32) for a in jitted(x, w, dy)]
    cpu_dev = jax.devices("cpu")[0]
    cpu = [np.asarray(a, np.float32) for a in jax.jit(layer)(*(jax.device_put(a, cpu_dev) for a in (x, w, dy)))]
    for g, c in zip(gpu, cpu):
        assert np.linalg.norm(g - c) <= 1e-2 * np.linalg.norm(c)


@pytest.mark.parametrize("scales_are_arguments", [True, False])
def test_bf16_gemm_outputs_apply_the_fp32_scales_exactly(scales_are_arguments):
    """The dequantize-then-dot form hands XLA ``bf16(1/s)`` for scales that are not powers of
    two; on GPU the FP32 ``1/s`` must still reach cuBLASLt. Its BF16 outputs must equal, bit for
    bit, the FP32-result form's (FP32 GEMM output times ``1/(sa*sb)``, one rounding to BF16),
    whether the scales are program inputs (the trainer's state) or constants."""
    from maxfp4.precision import formats as F
    from maxfp4.precision.recipes import COMPUTE_DTYPE
    from maxfp4.precision.recipes.fp8 import fp8_gemm_tn

    a = jax.random.normal(jax.random.key(0), (2048, 1024), jnp.bfloat16)
    b = 0.02 * jax.random.normal(jax.random.key(1), (512, 1024), jnp.float32)
    scales = (jnp.float32(50.0), jnp.float32(5000.0))  # 1/50 and 1/5000 are not exact in BF16

    def both(a, b, sa, sb):
        qa, qb = F.quantize_fp8(a, sa, F.FP8_E4M3), F.quantize_fp8(b, sb, F.FP8_E4M3)
        fast = fp8_gemm_tn(qa, sa, qb, sb, COMPUTE_DTYPE)
        # The recipe's FP32-result form (FP32 outputs take it), rounded once to BF16 here.
        exact = fp8_gemm_tn(qa, sa, qb, sb, jnp.float32).astype(COMPUTE_DTYPE)
        return fast, exact

    if scales_are_arguments:
        fn = jax.jit(both, compiler_options=compiler_options("gpu"))
        args = (a, b) + scales
    else:
        fn = jax.jit(lambda a, b: both(a, b, *scales), compiler_options=compiler_options("gpu"))
        args = (a, b)
    fast, exact = (np.asarray(v.astype(jnp.float32)) for v in fn(*args))
    assert np.array_equal(fast, exact), f"{np.mean(fast != exact):.4%} of the outputs differ"
    gemms = _f8_gemms(fn.lower(*args).compile().as_text())
    assert sorted(d for d, _ in gemms) == ["bf16", "f32"], gemms


def test_div_rn_and_nvfp4_on_gpu_match_ieee_and_the_cpu_bitwise():
    """The scale arithmetic is backend-independent: div_rn on the GPU is NumPy's IEEE float32
    division bit for bit (where XLA's own GPU division is up to 2 ulp off), and quantize_nvfp4
    (scales, elements, stochastic rounding with the same key) gives the CPU's bits."""
    from maxfp4.precision import formats as F

    rng = np.random.default_rng(5)
    n = 1_000_000
    a = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    b = (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 60, n)).astype(np.float32)
    a[: n // 4] = 1.0
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    got = np.asarray(jax.jit(F.div_rn)(jax.device_put(a, gpu), jax.device_put(b, gpu)))
    np.testing.assert_array_equal(got.view(np.uint32), (a / b).view(np.uint32))

    x = (rng.standard_normal((256, 512)) * np.exp(rng.standard_normal((256, 1)))).astype(np.float32)
    key = jax.random.key(3)

    def bits(q):
        return (np.asarray(q.elements.astype(jnp.float32)), np.asarray(q.block_scales.astype(jnp.float32)),
                np.asarray(q.global_decode_scale))

    for two_d, k in ((False, None), (True, None), (False, key)):
        quantize = jax.jit(lambda x, k: F.quantize_nvfp4(x, two_d=two_d, key=k))
        on_gpu = bits(quantize(*jax.device_put((x, k), gpu)))
        on_cpu = bits(quantize(*jax.device_put((x, k), cpu)))
        for g, c in zip(on_gpu, on_cpu):
            np.testing.assert_array_equal(g, c)


@pytest.mark.parametrize("stochastic", [False, True])
def test_rht_kernels_on_gpu_equal_the_xla_path_and_the_cpu_bitwise(stochastic):
    """The Triton-compiled Hadamard + NVFP4 column kernels give the bits of the XLA path
    (hadamard16, then block_dequantize_nvfp4_columns) on the GPU, and those of the CPU."""
    from maxfp4.precision import formats as F
    from maxfp4.kernels.rht import hadamard_block_dequantize_nvfp4_columns

    rng = np.random.default_rng(6)
    x = jnp.asarray((rng.standard_normal((2048, 1536)) * np.exp(2 * rng.standard_normal((2048, 1)))
                     ).astype(np.float32), jnp.bfloat16)
    key = jax.random.key(9) if stochastic else None
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]
    kernel = jax.jit(hadamard_block_dequantize_nvfp4_columns)
    xla = jax.jit(lambda x, k: F.block_dequantize_nvfp4_columns(F.hadamard16(x, axis=0), k))
    v, s = kernel(*jax.device_put((x, key), gpu))
    for v_ref, s_ref in (xla(*jax.device_put((x, key), gpu)), xla(*jax.device_put((x, key), cpu))):
        np.testing.assert_array_equal(np.asarray(v, np.float32).view(np.uint32),
                                      np.asarray(v_ref, np.float32).view(np.uint32))
        assert np.asarray(s).view(np.uint32) == np.asarray(s_ref).view(np.uint32)


@pytest.mark.parametrize("stochastic", [False, True])
def test_rht_kernels_split_over_the_gpus_equal_the_xla_path_bitwise(stochastic):
    """Every visible GPU runs the kernels on its own rows (a mesh axis over all of them, one
    GPU included): the bits of the XLA path over the whole tensor, and v split by rows."""
    from jax.sharding import NamedSharding, PartitionSpec

    from maxfp4.precision import formats as F
    from maxfp4.kernels.rht import hadamard_block_dequantize_nvfp4_columns

    gpus = jax.devices("gpu")
    mesh = jax.make_mesh((len(gpus),), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpus)
    rows = NamedSharding(mesh, PartitionSpec("data", None))
    rng = np.random.default_rng(8)
    x = jax.device_put(jnp.asarray((rng.standard_normal((4096, 1536)) * np.exp(2 * rng.standard_normal((4096, 1)))
                                    ).astype(np.float32), jnp.bfloat16), rows)
    key = jax.random.key(10) if stochastic else None
    v, s = jax.jit(lambda x, k: hadamard_block_dequantize_nvfp4_columns(x, k, mesh=mesh, row_axes=("data",)))(x, key)
    v_ref, s_ref = jax.jit(lambda x, k: F.block_dequantize_nvfp4_columns(F.hadamard16(x, axis=0), k))(x, key)
    np.testing.assert_array_equal(np.asarray(v, np.float32).view(np.uint32),
                                  np.asarray(v_ref, np.float32).view(np.uint32))
    assert np.asarray(s).view(np.uint32) == np.asarray(s_ref).view(np.uint32)
    assert v.sharding.is_equivalent_to(rows, 2)


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current"])
def test_fsdp_gathers_the_fp8_weight_and_keeps_fp8_gemms(recipe):
    """With the weight split over the GPUs (FSDP: mesh fsdp = all GPUs), the layer still makes
    its three GEMMs in FP8, and every all-gather moves FP8 bytes: the quantized weight is what
    the devices exchange, not a BF16 or FP32 copy of it."""
    fn = fp8_delayed_dot if recipe == "fp8_delayed" else fp8_current_dot
    gpus = jax.devices("gpu")
    mesh = jax.make_mesh((1, len(gpus), 1), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=gpus)
    x, w, dy = layer_operands(mesh, "mlp_up", 1024, 2048, tokens=512)  # weight split over fsdp along K
    jitted = jax.jit(forward_and_grads(fn, (), mesh), compiler_options=compiler_options("gpu"))
    hlo = jitted.lower(x, w, dy).compile().as_text()
    assert len(_f8_gemms(hlo)) == 3, hlo
    gathers = [t for t, _ in all_gathers(hlo)]
    if len(gpus) > 1:
        assert gathers and set(gathers) <= {"f8e4m3fn"}, gathers
    # The numbers equal the same layer on one device, up to summation order.
    one = [np.asarray(a, np.float32)
           for a in jax.jit(forward_and_grads(fn, ()))(*(jax.device_put(a, gpus[0]) for a in (x, w, dy)))]
    for g, c in zip((np.asarray(a, np.float32) for a in jitted(x, w, dy)), one):
        assert np.linalg.norm(g - c) <= 1e-2 * np.linalg.norm(c)


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current"])
@pytest.mark.parametrize("layer_class", ["mlp_up", "mlp_down"])
def test_tensor_parallel_fp8_layer_keeps_fp8_gemms_and_gathers_fp8(recipe, layer_class):
    """A column-parallel (mlp_up) and a row-parallel (mlp_down) FP8 layer on a tensor=2 mesh
    (x fsdp = the other GPUs), with its layer class in the options as LayerPrecision passes it:
    the three GEMMs stay cuBLASLt FP8 GEMMs, and any all-gather moves FP8 bytes (the quantized
    weight with its tensor split kept). Needs 2 GPUs (fsdp > 1, where the gather is, 4)."""
    from maxfp4.precision.catalog import LAYER_CLASS_OPTION

    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("tensor parallelism needs 2 GPUs")
    gpus = gpus[: len(gpus) // 2 * 2]
    fn = fp8_delayed_dot if recipe == "fp8_delayed" else fp8_current_dot
    mesh = jax.make_mesh((1, len(gpus) // 2, 2), ("data", "fsdp", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=gpus)
    k, n = (1024, 2048) if layer_class == "mlp_up" else (2048, 1024)
    x, w, dy = layer_operands(mesh, layer_class, k, n, tokens=512)
    layer = forward_and_grads(fn, ((LAYER_CLASS_OPTION, layer_class),), mesh)
    hlo = jax.jit(layer, compiler_options=compiler_options("gpu")).lower(x, w, dy).compile().as_text()
    assert len(_f8_gemms(hlo)) == 3, hlo
    gathers = [t for t, _ in all_gathers(hlo)]
    assert set(gathers) <= {"f8e4m3fn"}, gathers


@pytest.mark.parametrize("recipe", ["fp8_delayed", "fp8_current"])
@pytest.mark.parametrize("forward, backward", [(True, False), (True, True), (False, False)])
def test_fp8_gemms_accumulate_as_the_fast_accumulation_option_says(recipe, forward, backward):
    """The compiled cuBLASLt FP8 GEMMs of one layer: fprop (BF16 [M, N]) with Hopper's fast
    accumulation as ``forward`` says, dgrad (BF16 [M, K]) and wgrad (FP32 [K, N]) as ``backward``
    says; the default ({forward: true, backward: false}) is Transformer Engine's. What decides it
    is the GEMM's precision_config (maxfp4.compiler.fast_accumulation, XLA's rule); a GEMM line
    without one fails with the line."""
    from maxfp4.compiler import fp8_gemms
    from maxfp4.config import load_config
    from maxfp4.precision import resolve_policy

    overrides = [f"precision.default={recipe}"]
    if (forward, backward) != (True, False):  # the default is checked as the default
        overrides.append(f"precision.recipes.{recipe}.fast_accumulation="
                         f"{{forward: {str(forward).lower()}, backward: {str(backward).lower()}}}")
    cfg = load_config(None, overrides)
    options = resolve_policy(cfg.precision, cfg.model.n_layers).options_tuple(recipe)
    fn = fp8_delayed_dot if recipe == "fp8_delayed" else fp8_current_dot
    m, k, n = 2048, 1024, 1536
    x = jax.random.normal(jax.random.key(0), (2, m // 2, k), jnp.bfloat16)
    w = 0.02 * jax.random.normal(jax.random.key(1), (k, n), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (2, m // 2, n), jnp.bfloat16)
    scales = jnp.asarray([50.0, 5000.0, 1000.0], jnp.float32)

    def layer(x, w, dy):
        y, vjp = jax.vjp(lambda x, w: fn(x, w, options, scales, None), x, w)
        return (y,) + vjp(dy)[:2]

    hlo = jax.jit(layer, compiler_options=compiler_options("gpu")).lower(x, w, dy).compile().as_text()
    gemms = {(g["dtype"], g["shape"]): g for g in fp8_gemms(hlo)}
    excerpt = "\n".join(line[:600] for line in hlo.splitlines() if "__cublas$lt$matmul" in line)
    want = {("bf16", (m, n)): forward, ("bf16", (m, k)): backward, ("f32", (k, n)): backward}
    assert set(gemms) == set(want), f"expected fprop, dgrad and wgrad as cuBLASLt FP8 GEMMs:\n{excerpt}"
    for key, fast in want.items():
        assert gemms[key]["fast_accumulation"] is fast, (key, gemms[key]["precision_config"], excerpt)


def test_fp8_train_step_accumulates_fprop_fast_and_both_gradients_precisely():
    """A whole FP8 (delayed scaling) model's loss gradient, compiled on the GPU: the fused paths
    (MLP kernel, q/k/v assembly) take the same option as the plain recipe: per FP8 layer of a
    block (q/k/v, out, MLP up and down) one fast GEMM and two precise ones."""
    from maxfp4.compiler import fp8_gemms
    from maxfp4.config import load_config
    from maxfp4.model import get_model
    from maxfp4.precision import resolve_policy
    from maxfp4.precision.state import init_precision_state, scales_of
    from maxfp4.step import make_loss_fn

    cfg = load_config(None, ["model.d_model=512", "model.n_layers=2", "model.n_heads=8", "model.n_kv_heads=4",
                             "model.d_ff=1536", "model.vocab_size=4096", "data.seq_len=1024", "data.global_batch=4",
                             "precision.default=fp8_delayed", "precision.rules=[{classes: [lm_head], recipe: bf16}]"])
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    model = get_model(cfg.model)
    params = model.init_params(cfg.model, jax.random.key(0))
    scales = scales_of(init_precision_state(policy, model.block_layer_classes))
    b, t = cfg.data.global_batch, cfg.data.seq_len
    tokens = jax.random.randint(jax.random.key(1), (b, t), 4, cfg.model.vocab_size)
    batch = {"inputs": tokens, "targets": tokens, "positions": jnp.broadcast_to(jnp.arange(t), (b, t)),
             "segment_ids": jnp.ones((b, t), jnp.int32), "loss_mask": jnp.ones((b, t), jnp.int32)}
    grad = jax.grad(make_loss_fn(cfg, policy, runs_per_row=1), argnums=(0, 1))
    hlo = jax.jit(grad, compiler_options=compiler_options("gpu")).lower(
        params, scales, batch, jax.random.key(2), jnp.float32(1.0)).compile().as_text()
    gemms = fp8_gemms(hlo)
    fast = [g for g in gemms if g["fast_accumulation"]]
    precise = [g for g in gemms if not g["fast_accumulation"]]
    summary = [(g["dtype"], g["shape"], g["fast_accumulation"]) for g in gemms]
    # Four FP8 layers per block; XLA may unroll the two-block scan, so per body or per block.
    assert fast and len(fast) % 4 == 0 and len(precise) == 2 * len(fast), summary
    assert all(g["dtype"] == "bf16" for g in fast), summary  # fprop outputs BF16
