"""The models as Flax NNX modules: the parameter pytree keeps its names, shapes, dtypes, init
values and logical axes; the module, the pure pytree merged into it, and a float64 NumPy model
compute the same function."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxfp4.model import get_model, lm
from maxfp4.model.decoder import DenseLM
from maxfp4.model.hybrid import HybridLM
from maxfp4.model.layers import Linear, RMSNorm, normal_init
from maxfp4.model.mamba_layout import grouped, in_proj_parts
from maxfp4.precision import LayerPrecision, resolve_policy

HYBRID = ["model.kind=hybrid", "model.pattern=M*-M", "model.mlp=relu2", "model.mamba.d_state=16",
          "model.mamba.head_dim=16"]


# The parameter pytree as it was built before the models were modules (commit 588b738): the
# modules must reproduce it bit for bit, so checkpoints and runs resume unchanged.

def _legacy_dense_init(cfg, key):
    d, L, f, v = cfg.d_model, cfg.n_layers, cfg.d_ff, cfg.vocab_size
    h, n, k = cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * L)
    keys = jax.random.split(key, 6)
    return {
        "embed": normal_init(keys[0], (v, d), std),
        "blocks": {
            "attn_norm": jnp.ones((L, d), jnp.float32),
            "w_qkv": normal_init(keys[1], (L, d, k, n // k + 2, h), std),
            "w_o": normal_init(keys[2], (L, n * h, d), out_std),
            "mlp_norm": jnp.ones((L, d), jnp.float32),
            "w_up": normal_init(keys[3], (L, d, f, 2), std),
            "w_down": normal_init(keys[4], (L, f, d), out_std),
        },
        "final_norm": jnp.ones((d,), jnp.float32),
        "lm_head": normal_init(keys[5], (d, v), std),
    }


def _legacy_mamba_init(cfg, key, n):
    mb = cfg.mamba
    e = mb.expand * cfg.d_model
    h, conv = e // mb.head_dim, e + 2 * mb.n_groups * mb.d_state
    k = jax.random.split(key, 5)
    dt = jnp.exp(jax.random.uniform(k[2], (n, h), minval=math.log(1e-3), maxval=math.log(1e-1)))
    return {
        # Stored group by group, [D, G, I/G] (maxfp4.model.mamba_layout): the same draws.
        "in_proj": grouped(normal_init(k[0], (n, cfg.d_model, conv + e + h), cfg.init_std), in_proj_parts(cfg),
                           mb.n_groups),
        "conv_w": normal_init(k[1], (n, mb.conv_kernel, conv), 1.0 / math.sqrt(mb.conv_kernel)),
        "conv_b": jnp.zeros((n, conv), jnp.float32),
        "A_log": jnp.log(jax.random.uniform(k[3], (n, h), minval=1.0, maxval=16.0)),
        "D_skip": jnp.ones((n, h), jnp.float32),
        "dt_bias": dt + jnp.log(-jnp.expm1(-dt)),
        "norm": jnp.ones((n, e), jnp.float32),
        "out_proj": normal_init(k[4], (n, e, cfg.d_model), cfg.init_std / math.sqrt(2 * cfg.n_layers)),
    }


def _legacy_hybrid_init(cfg, key):
    counts = {t: sum(c == ch for c in cfg.pattern) for t, ch in (("mamba", "M"), ("attention", "*"), ("mlp", "-"))}
    d, v, std = cfg.d_model, cfg.vocab_size, cfg.init_std
    out_std = std / math.sqrt(2 * cfg.n_layers)
    h, n, k = cfg.resolved_head_dim, cfg.n_heads, cfg.n_kv_heads
    keys = jax.random.split(key, 8)
    m, a, c = counts["mamba"], counts["attention"], counts["mlp"]
    f, gates = cfg.d_ff, (2 if cfg.mlp == "swiglu" else 1)
    return {
        "embed": normal_init(keys[0], (v, d), std),
        "final_norm": jnp.ones((d,), jnp.float32),
        "lm_head": normal_init(keys[1], (d, v), std),
        "mamba": _legacy_mamba_init(cfg, keys[2], m) | {"pre_norm": jnp.ones((m, d), jnp.float32)},
        "attention": {"pre_norm": jnp.ones((a, d), jnp.float32),
                      "w_qkv": normal_init(keys[3], (a, d, k, n // k + 2, h), std),
                      "w_o": normal_init(keys[4], (a, n * h, d), out_std)},
        "mlp": {"pre_norm": jnp.ones((c, d), jnp.float32),
                "w_up": normal_init(keys[5], (c, d, f, gates), std),
                "w_down": normal_init(keys[6], (c, f, d), out_std)},
    }


_LEGACY_AXES = {
    "embed": ("vocab", "embed"), "final_norm": ("norm",), "lm_head": ("embed", "vocab"),
    "blocks": {"attn_norm": ("layers", "norm"), "w_qkv": ("layers", "embed", "kv_heads", None, "head_dim"),
               "w_o": ("layers", "heads", "embed"), "mlp_norm": ("layers", "norm"),
               "w_up": ("layers", "embed", "mlp", None), "w_down": ("layers", "mlp", "embed")},
    "mamba": {"in_proj": ("layers", "embed", "ssm_groups", None), "conv_w": ("layers", None, None), "conv_b": ("layers", None),
              "A_log": ("layers", None), "D_skip": ("layers", None), "dt_bias": ("layers", None),
              "norm": ("layers", "norm"), "out_proj": ("layers", "inner", "embed"), "pre_norm": ("layers", "norm")},
    "attention": {"pre_norm": ("layers", "norm"), "w_qkv": ("layers", "embed", "kv_heads", None, "head_dim"),
                  "w_o": ("layers", "heads", "embed")},
    "mlp": {"pre_norm": ("layers", "norm"), "w_up": ("layers", "embed", "mlp", None),
            "w_down": ("layers", "mlp", "embed")},
}


def _paths(tree, is_leaf=None):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]}


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_module_state_is_the_legacy_pytree_bit_for_bit(family, tiny_cfg):
    cfg = tiny_cfg(*(HYBRID if family == "hybrid" else [])).model
    legacy = (_legacy_hybrid_init if family == "hybrid" else _legacy_dense_init)(cfg, jax.random.key(3))
    model = (HybridLM if family == "hybrid" else DenseLM)(cfg, jax.random.key(3))
    state = nnx.to_pure_dict(nnx.state(model))
    assert type(state) is dict and all(type(v) is dict for v in state.values() if not hasattr(v, "shape"))
    old, new = _paths(legacy), _paths(state)
    assert sorted(new) == sorted(old)
    for path, a in old.items():
        b = new[path]
        assert (b.shape, b.dtype) == (a.shape, a.dtype), path
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=path)
    # The trainer's functional face returns the same pytree.
    same = get_model(cfg).init_params(cfg, jax.random.key(3))
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), same, state))


@pytest.mark.parametrize("family", ["dense", "hybrid"])
def test_logical_axes_come_from_the_param_metadata(family, tiny_cfg):
    cfg = tiny_cfg(*(HYBRID if family == "hybrid" else [])).model
    axes = get_model(cfg).param_axes(cfg)
    expected = {k: v for k, v in _LEGACY_AXES.items() if k in axes}
    assert axes == expected
    shapes = jax.eval_shape(lambda k: get_model(cfg).init_params(cfg, k), jax.random.key(0))
    is_axes = lambda a: isinstance(a, tuple)  # noqa: E731
    for path, ax in _paths(axes, is_axes).items():
        assert len(ax) == len(_paths(shapes)[path].shape), path
    # Each linear layer's weight knows its precision class.
    model = nnx.eval_shape(lambda: get_model(cfg).module(cfg, jax.random.key(0)))
    classes = {jax.tree_util.keystr(p): v.layer_class for p, v in nnx.to_flat_state(nnx.state(model, Linear))}
    assert set(classes.values()) == set(get_model(cfg).block_layer_classes) | {"lm_head"}
    norms = {path[-1] for path, _ in nnx.to_flat_state(nnx.state(model, RMSNorm))}
    assert norms == ({"pre_norm", "final_norm"} if family == "hybrid" else {"attn_norm", "mlp_norm", "final_norm"})


def test_linear_runs_its_class_recipe(tiny_cfg):
    """Calling a Linear is the policy's recipe for its class: fp8_current on mlp_up quantizes."""
    cfg = tiny_cfg("precision.rules=[{classes: [mlp_up], recipe: fp8_current}]")
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    model = DenseLM(cfg.model, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 8, cfg.model.d_model), jnp.float32).astype(jnp.bfloat16)
    lp = LayerPrecision(policy, 0)
    w_DF2 = model.blocks.w_up[...][0]  # block 0's weight, [D, F, 2]
    got = Linear(w_DF2, layer_class="mlp_up")(x, lp)
    assert jnp.array_equal(got, lp.dot(x, w_DF2.reshape(w_DF2.shape[0], -1), "mlp_up"))
    as_bf16 = Linear(w_DF2, layer_class="mlp_down")  # the same weight under a BF16 class
    assert not jnp.array_equal(got, as_bf16(x, lp))


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rope(x_BTNH, pos_BT, theta):
    h = x_BTNH.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, h // 2) * 2.0 / h)
    ang = pos_BT[..., None, None] * inv
    x1, x2 = x_BTNH[..., : h // 2], x_BTNH[..., h // 2:]
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def _reference_dense(p, tokens_BT, pos_BT, seg_BT, cfg):
    """One-block dense model in float64 NumPy, written from the architecture's description."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    b, t = tokens_BT.shape
    blk = {k: v[0] for k, v in p["blocks"].items()}
    d, kv, g2, hd = blk["w_qkv"].shape
    g = g2 - 2
    x = p["embed"][tokens_BT]
    h = _rms(x, blk["attn_norm"], cfg.norm_eps)
    qkv = (h @ blk["w_qkv"].reshape(d, -1)).reshape(b, t, kv, g2, hd)
    q = _rope(qkv[:, :, :, :g].reshape(b, t, kv * g, hd), pos_BT, cfg.rope_theta)
    k = _rope(qkv[:, :, :, g], pos_BT, cfg.rope_theta)
    v = qkv[:, :, :, g + 1]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head n reads kv head n // G
    s = np.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(hd)
    allowed = (seg_BT[:, :, None] == seg_BT[:, None, :]) & np.tril(np.ones((t, t), bool))
    s = np.where(allowed[:, None], s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    out = np.einsum("bnqk,bknh->bqnh", a, v).reshape(b, t, -1)
    x = x + out @ blk["w_o"]
    h = _rms(x, blk["mlp_norm"], cfg.norm_eps)
    y = (h @ blk["w_up"].reshape(d, -1)).reshape(b, t, -1, 2)
    gate, up = y[..., 0], y[..., 1]
    x = x + (gate / (1 + np.exp(-gate)) * up) @ blk["w_down"]
    return _rms(x, p["final_norm"], cfg.norm_eps) @ p["lm_head"]


def test_one_block_dense_matches_float64_reference(tiny_cfg):
    """The module and the pytree merged into it give the same BF16 logits, within BF16 rounding
    of a float64 model: operands and activations are rounded to BF16 (relative 2^-9) at each of
    about ten steps, so the error stays under 3% of the largest logit."""
    cfg = tiny_cfg("model.n_layers=1", "model.init_std=0.2")
    policy = resolve_policy(cfg.precision, 1)
    model = DenseLM(cfg.model, jax.random.key(0))
    # Norm scales away from one, so the reference checks that they are applied.
    for norm in (model.blocks.attn_norm, model.blocks.mlp_norm, model.final_norm):
        norm[...] = 1.0 + 0.2 * jax.random.normal(jax.random.key(7), norm.shape)
    b, t = 2, 16
    tokens = jax.random.randint(jax.random.key(1), (b, t), 0, cfg.model.vocab_size)
    seg = jnp.asarray([[1] * 10 + [2] * 6, [1] * 16], jnp.int32)  # two documents packed in row 0
    pos = jnp.asarray([list(range(10)) + list(range(6)), list(range(16))], jnp.int32)

    from_module = model(tokens, pos, seg, policy=policy)
    params = nnx.to_pure_dict(nnx.state(model))
    from_pytree = jax.jit(lambda p: get_model(cfg.model).forward(p, tokens, pos, seg, cfg=cfg.model,
                                                                 policy=policy))(params)
    assert from_module.dtype == jnp.bfloat16 and from_module.shape == (b, t, cfg.model.vocab_size)
    ref = _reference_dense(params, np.asarray(tokens), np.asarray(pos), np.asarray(seg), cfg.model)
    scale = np.abs(ref).max()
    for got in (from_module, from_pytree):
        err = np.abs(np.asarray(got.astype(jnp.float32), np.float64) - ref).max()
        assert err <= 0.03 * scale, (err, scale)
    np.testing.assert_allclose(np.asarray(from_pytree.astype(jnp.float32)),
                               np.asarray(from_module.astype(jnp.float32)), rtol=0, atol=0.02 * scale)


def test_apply_merges_the_pure_pytree_into_the_module(tiny_cfg):
    cfg = tiny_cfg(*HYBRID).model
    params = get_model(cfg).init_params(cfg, jax.random.key(0))
    model = lm.apply(HybridLM, params, cfg)
    assert isinstance(model, HybridLM) and model.mamba.in_proj.layer_class == "mamba_in"
    assert model.attention.w_qkv[...] is params["attention"]["w_qkv"]  # no copy
    assert lm.graphdef(HybridLM, cfg) is lm.graphdef(HybridLM, cfg)  # built once per config


def test_one_layer_modules_have_the_per_layer_shapes_and_axes(tiny_cfg):
    """``n=None`` builds one layer (what a sampler slices out of a stack): no ``layers`` axis."""
    from maxfp4.model.attention import Attention
    from maxfp4.model.mamba import Mamba2Mixer
    from maxfp4.model.mlp import MLP

    cfg = tiny_cfg(*HYBRID).model
    k = jax.random.key(0)
    stack = nnx.eval_shape(lambda: HybridLM(cfg, k))
    for one, stacked in ((Attention(cfg, k, k, None, std=0.02, out_std=0.01), stack.attention),
                         (MLP(cfg, k, k, None, std=0.02, out_std=0.01), stack.mlp),
                         (Mamba2Mixer(cfg, k, None), stack.mamba)):
        for path, v in nnx.to_flat_state(nnx.state(one)):
            s = getattr(stacked, path[-1])
            assert v.shape == s.shape[1:] and v.logical_axes == s.logical_axes[1:], path
            assert s.logical_axes[0] == "layers"
