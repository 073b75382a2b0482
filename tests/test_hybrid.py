"""Hybrid Mamba-2 / attention / MLP stacks: causality, document isolation, scan grouping,
FLOP counts against the real parameters, and training in BF16, FP8 and NVFP4."""

import io
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxfp4.config import ConfigError, load_config
from maxfp4.model_spec import model_spec
from maxfp4.model import get_model
from maxfp4.model.hybrid import scan_groups
from maxfp4.model.layers import ACT_DTYPE
from maxfp4.precision import resolve_policy
from maxfp4.train import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "hybrid-tiny.yaml")


def _setup(*overrides):
    cfg = load_config(TINY, list(overrides))
    model = get_model(cfg.model)
    params = model.init_params(cfg.model, jax.random.key(0))
    return cfg, model, params, resolve_policy(cfg.precision, cfg.model.n_layers)


def test_hybrid_stack_is_causal():
    cfg, model, params, policy = _setup()
    T = 32
    x = 0.5 * jax.random.normal(jax.random.key(1), (1, T, cfg.model.d_model), jnp.float32)
    pos, seg = jnp.arange(T, dtype=jnp.int32)[None], jnp.ones((1, T), jnp.int32)
    # One compiled gradient, the probed position passed as data.
    grad_at = jax.jit(jax.grad(lambda x, t: jnp.take(model.forward_embedded(
        params, x.astype(ACT_DTYPE), pos, seg, cfg=cfg.model, policy=policy)[0], t, axis=0)
        .astype(jnp.float32).sum()))
    for t in (0, 13, T - 2):
        g = grad_at(x, t)
        per_pos = np.abs(np.asarray(g[0])).sum(-1)
        assert np.all(per_pos[t + 1:] == 0.0), f"position {t} sees the future"
        assert np.all(per_pos[: t + 1] > 0.0), f"position {t} ignores its past"


def test_packed_documents_stay_apart_through_mamba_conv_and_attention():
    cfg, model, params, policy = _setup()
    rng = np.random.default_rng(0)
    seg = np.array([[1] * 21 + [2] * 27 + [3] * 16], np.int32)  # boundaries inside SSD chunks of 16
    pos = np.concatenate([np.arange(21), np.arange(27), np.arange(16)])[None].astype(np.int32)
    tok = rng.integers(4, cfg.model.vocab_size, size=(1, 64)).astype(np.int32)
    changed = tok.copy()
    changed[0, 21:48] = rng.integers(4, cfg.model.vocab_size, size=27)  # rewrite the middle document

    def logits(t):
        return np.asarray(model.forward(params, t, pos, seg, cfg=cfg.model, policy=policy).astype(jnp.float32))

    a, b = logits(tok), logits(changed)
    np.testing.assert_array_equal(a[0, :21], b[0, :21])
    np.testing.assert_array_equal(a[0, 48:], b[0, 48:])
    assert np.abs(a[0, 21:48] - b[0, 21:48]).max() > 1e-3


def test_scan_groups_cover_the_pattern_with_few_scans():
    pattern = ("M-" * 5 + "M*-") * 4  # the Nemotron-H-8B layout: 52 blocks
    rows = tuple(("bf16",) * 6 for _ in pattern)
    groups = scan_groups(pattern, rows)
    assert "".join(unit * reps for _, unit, reps in groups) == pattern
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)
    assert len(groups) <= 8, groups
    # A recipe change splits a run: the last eight blocks in another recipe.
    rows2 = tuple(("bf16",) * 6 if i < 44 else ("nvfp4",) * 6 for i in range(52))
    groups2 = scan_groups(pattern, rows2)
    assert "".join(u * r for _, u, r in groups2) == pattern
    for start, unit, reps in groups2:
        block_rows = rows2[start:start + len(unit) * reps]
        for i in range(len(unit), len(block_rows)):
            assert block_rows[i] == block_rows[i - len(unit)]
    assert all(len({rows[i] for i in range(s, s + len(u) * r)}) >= 1 for s, u, r in groups2)


def test_matmul_param_count_matches_the_real_model():
    for cfg_file in ("hybrid-tiny.yaml", "nemotron-h-8b.yaml", "mamba2-1p3b.yaml"):
        cfg = load_config(os.path.join(REPO, "configs", cfg_file))
        model = get_model(cfg.model)
        shapes = jax.eval_shape(lambda k: model.init_params(cfg.model, k), jax.random.key(0))
        flat = jax.tree_util.tree_leaves_with_path(shapes)
        linear = sum(int(np.prod(x.shape)) for path, x in flat
                     if jax.tree_util.keystr(path).split("'")[-2] in ("in_proj", "out_proj", "w_qkv", "w_o",
                                                                     "w_up", "w_down", "lm_head"))
        assert model_spec(cfg.model).matmul_params == linear, cfg_file
    nem = load_config(os.path.join(REPO, "configs", "nemotron-h-8b.yaml"))
    assert nem.model.n_layers == 52 and 7.5e9 < model_spec(nem.model).matmul_params < 9.5e9


@pytest.mark.parametrize("override, fragment", [
    ("model.pattern=MX-", "model.pattern='MX-': expected a non-empty string of M"),
    ("model.mamba.head_dim=24", "model.mamba.head_dim=24: expected a divisor"),
    ("model.mlp=gelu", "model.mlp='gelu': expected one of swiglu, relu2"),
])
def test_bad_hybrid_configs(override, fragment):
    with pytest.raises(ConfigError) as err:
        load_config(TINY, [override])
    assert fragment in str(err.value)
    with pytest.raises(ConfigError, match="empty for model.kind=dense"):
        load_config(None, ["model.pattern=M-"])


@pytest.mark.parametrize("recipe", ["bf16", "fp8_delayed", "nvfp4"])
def test_tiny_hybrid_trains(recipe, tmp_path):
    # One block of each kind (Mamba-2, attention, MLP) instead of the config's six: compiling
    # dominates, and it grows with the blocks. Rows of 32 tokens (two SSD chunks of 16) and 20
    # steps at lr 5e-3 after a warm-up of 3, where the emulated NVFP4 step's run time is most
    # of the rest. Measured drops 1.53 (BF16), 1.53 (FP8), 1.52 (NVFP4) from 6.26, at least 0.51
    # above the bound (rows of 64 tokens, 30 steps at the config's lr 3e-3 and warm-up of 8:
    # 1.41-1.44; the six blocks after 30 steps: 1.43-1.45).
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", f"precision.default={recipe}", "model.pattern=M*-",
                             "data.seq_len=32", "train.steps=20", "optim.lr=5e-3", "optim.warmup_steps=3",
                             "precision.recipes={fp8_delayed: {amax_history: 16}}"])
    recs = train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    assert recs[0]["loss"] - recs[-1]["loss"] > 1.0, (recipe, recs[0]["loss"], recs[-1]["loss"])


def test_block_scaled_recipe_on_untileable_layer_fails_before_compiling(tmp_path):
    # in_proj of this mixer is 64 -> 2*128 + 2*2*16 + 8 = 328 features: not a multiple of 16.
    cfg = load_config(TINY, [f"run.output_dir={tmp_path}", "precision.default=nvfp4", "model.mamba.head_dim=16"])
    with pytest.raises(ConfigError, match="recipe nvfp4 on mamba_in needs its features"):
        train(cfg, devices=jax.devices()[:1], stream=io.StringIO())
    assert not os.path.exists(tmp_path / "hybrid-tiny")  # nothing written


def test_unrolled_blocks_recompute_what_the_remat_policy_does_not_save():
    """With unrolled blocks, save_gemm must really recompute the element-wise forward (the SSD's
    decays, SiLU, softmax) in the backward pass instead of XLA merging the recomputation into
    the forward values, which keeps every residual alive. Counted on the compiled gradient by its
    exponentials: save_gemm recomputes (nearly) all that full remat does (every exponential is
    element-wise work, which save_gemm does not keep). Only the exponentials of the
    recomputation count (their op names say rematted_computation): XLA copies an exponential
    into several fusions or shares one, differently with each policy, so totals drift by a few
    (merged away, save_gemm here keeps 10 of full remat's 18; recomputed, 16)."""
    import re

    cfg, model, params, policy = _setup()
    T = 64
    tok = jnp.zeros((2, T), jnp.int32)
    pos, seg = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (2, T)), jnp.ones((2, T), jnp.int32)
    exps = {}
    for remat in ("none", "save_gemm", "full"):
        def loss(p, remat=remat):
            logits = model.forward(p, tok, pos, seg, cfg=cfg.model, policy=policy, remat=remat, scan_layers=False)
            return jnp.sum(logits.astype(jnp.float32))
        hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
        exps[remat] = len(re.findall(r" exponential\(.*rematted_computation", hlo))
    assert exps["none"] == 0 and exps["full"] > 0, exps
    assert exps["save_gemm"] >= 0.8 * exps["full"], exps


def mixer_core_outputs_and_gradients(core_name: str, overrides=()):
    """Output and every gradient of one Mamba-2 mixer core (``maxfp4.model.mamba``'s
    ``_kernel_core`` or ``_composed_core``) on the tiny hybrid's shapes with the kernels on, BF16
    in_proj output as in training, two packed documents in one row."""
    from maxfp4.model import mamba

    cfg = load_config(TINY, ["model.mamba.kernels=pallas", "model.mamba.head_dim=16", *overrides]).model
    d = mamba.dims(cfg)
    p = {k: v[0] for k, v in mamba.init_mamba(cfg, jax.random.key(2), 1).items()}
    core_params = {k: p[k] for k in ("conv_w", "conv_b", "A_log", "D_skip", "dt_bias", "norm")}
    t = 32
    zxbcdt = jax.random.normal(jax.random.key(3), (2, t, d["in"]), jnp.float32).astype(ACT_DTYPE)
    seg = jnp.asarray(np.repeat(np.array([[1, 2], [3, 3]], np.int32), [12, 20], axis=1))
    weights = jax.random.normal(jax.random.key(4), (2, t, d["E"]), jnp.float32)
    core = getattr(mamba, core_name)

    def loss(zxbcdt, params):
        return jnp.sum(core(zxbcdt, seg, params, cfg).astype(jnp.float32) * weights)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(zxbcdt, core_params)


def test_mixer_core_under_one_vjp_equals_its_pieces():
    """The kernel core assembles the in_proj output's gradient in place (the norm kernel writes
    z's columns, dt's are set, the convolution kernel writes x/B/C's); differentiated piece by
    piece, the same gradient is a sum of zero-padded pieces. Same kernels, same roundings (adding
    zeros is exact): equal bit for bit, every column of the in_proj gradient nonzero."""
    value, (dz, dparams) = mixer_core_outputs_and_gradients("_kernel_core")
    value_ref, (dz_ref, dparams_ref) = mixer_core_outputs_and_gradients("_composed_core")
    assert value == value_ref
    np.testing.assert_array_equal(np.asarray(dz, np.float32), np.asarray(dz_ref, np.float32))
    assert np.all(np.any(np.asarray(dz, np.float32) != 0, axis=(0, 1)))
    for name in dparams_ref:
        np.testing.assert_array_equal(dparams[name], dparams_ref[name], err_msg=name)


def _fp8_mixer_value_and_grads(fp8_in_kernels: bool, out_proj_recipe: str = "fp8_delayed", trace_only=False,
                               overrides=()):
    """One Mamba-2 mixer (in_proj, kernel core, out_proj) with FP8 delayed scaling on in_proj
    and ``out_proj_recipe`` on out_proj, kernels on, two packed documents in a row: whether it
    runs as the fused ``_fused_mixer``, and (unless ``trace_only``) its output and the gradients
    of the input, every parameter and the scales (the amaxes the recipes report)."""
    from maxfp4.model import mamba
    from maxfp4.precision import LayerPrecision

    cfg = load_config(TINY, ["model.mamba.kernels=pallas", "model.mamba.head_dim=16",
                             f"model.mamba.fp8_in_kernels={str(fp8_in_kernels).lower()}",
                             "precision.default=fp8_delayed",
                             f"precision.rules=[{{classes: [mamba_out], recipe: {out_proj_recipe}}}]", *overrides])
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    p = {k: v[0] for k, v in mamba.init_mamba(cfg.model, jax.random.key(2), 1).items()}
    t = 32
    x = jax.random.normal(jax.random.key(3), (2, t, cfg.model.d_model), jnp.float32).astype(ACT_DTYPE)
    seg = jnp.asarray(np.repeat(np.array([[1, 2], [3, 3]], np.int32), [12, 20], axis=1))
    weights = jax.random.normal(jax.random.key(4), (2, t, cfg.model.d_model), jnp.float32)
    # Scales that are not powers of two, and a dY scale large enough that E5M2's rounding and
    # its clip at 57344 both occur: a value that differs anywhere changes the bits below.
    scales = {"mamba_in": jnp.array([3.7, 51.3, 4.1e6], jnp.float32),
              "mamba_out": jnp.array([2.9, 47.1, 2.3e5], jnp.float32)}
    used = mamba._fp8_in_kernels(x, cfg.model, LayerPrecision(policy, 0, scales))
    if trace_only:
        return used

    def loss(x, p, scales):
        lp = LayerPrecision(policy, 0, scales)
        y = mamba.mamba_mixer(x, p, seg, cfg.model, lp)
        return jnp.sum(y.astype(jnp.float32) * weights)
    return used, jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(x, p, scales)


def test_fp8_operands_stored_by_the_kernels_equal_the_recipes_casts():
    """With FP8 delayed scaling on in_proj and out_proj, the kernels that assemble in_proj's
    output gradient store it in E5M2 themselves (and report its amax) instead of writing BF16
    for the recipe to cast, and the gated norm's forward kernel stores out_proj's input in E4M3
    the same way. Same rounding to BF16, same scale, same clip and cast: every output, gradient
    and reported amax equal bit for bit to the recipes' own path; some dY values clip (the E5M2
    scale is large), so the clip is exercised too. With out_proj in another recipe the mixer
    keeps the recipes' own casts."""
    used, (value, grads) = _fp8_mixer_value_and_grads(True)
    not_used, (value_ref, grads_ref) = _fp8_mixer_value_and_grads(False)
    assert used and not not_used
    assert not _fp8_mixer_value_and_grads(True, "bf16", trace_only=True)
    assert value == value_ref
    for (path, a), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(grads_ref)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32),
                                      err_msg=jax.tree_util.keystr(path))
    amax_dy = float(grads[2]["mamba_in"][2])
    assert amax_dy * 4.1e6 > 57344, amax_dy  # the largest |dY| clips
    assert np.all(np.asarray(grads[1]["in_proj"]) != 0)
    assert float(grads[2]["mamba_out"][0]) > 0  # out_proj's input amax, from the norm kernel


def test_fp8_operands_stored_by_the_mosaic_kernels_equal_the_recipes_casts():
    """The same with ``model.mamba.kernel_backend=mosaic`` at shapes its convolution and gated norm
    tile (E = 1,024 in one group, 1,152 convolution channels), interpreted: the Mosaic kernels'
    E5M2 and E4M3 stores equal the recipes' casts of their BF16 outputs bit for bit."""
    from maxfp4.model import mamba

    mosaic = ["model.d_model=512", "model.mamba.n_groups=1", "model.mamba.d_state=64",
              "model.mamba.kernel_backend=mosaic"]
    cfg = load_config(TINY, ["model.mamba.head_dim=16", *mosaic]).model
    d = mamba.dims(cfg)
    x = jnp.zeros((2, 32, d["conv"]), jnp.bfloat16)
    u, zx = jnp.zeros((2, 32, d["E"]), jnp.bfloat16), jnp.zeros((2, 32, d["in"]), jnp.bfloat16)
    assert mamba._conv_kernels(cfg, x, jnp.zeros((4, d["conv"])), jnp.zeros((d["conv"],))) == "mosaic"
    assert mamba._norm_kernels(cfg, u, zx, jnp.zeros((d["E"],)), "backward") is mamba.gated_norm_mosaic
    used, (value, grads) = _fp8_mixer_value_and_grads(True, overrides=mosaic)
    not_used, (value_ref, grads_ref) = _fp8_mixer_value_and_grads(False, overrides=mosaic)
    assert used and not not_used
    assert value == value_ref
    for (path, a), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(grads_ref)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(r, np.float32),
                                      err_msg=jax.tree_util.keystr(path))
    assert float(grads[2]["mamba_in"][2]) * 4.1e6 > 57344  # the largest |dY| clips
