"""Context parallelism (mesh.context): a sequence split over 4 devices trains as on one device,
for a dense model and a Mamba-2 hybrid, with packed documents crossing the split; the causal
work is the same on every rank; bad input fails in one line."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from maxfp4.config import ConfigError, load_config
from maxfp4.optim import make_optimizer
from maxfp4.model.attention import attend
from maxfp4.model.ssd import chunk_exit, entry_output, pass_states, ssd_chunked, ssd_reference
from maxfp4.parallel.context import context_attention, rank_attention_mask, rank_token_index, zigzag_order
from maxfp4.parallel.mesh import batch_reader, batch_sharding, make_mesh, traced_in_mesh
from maxfp4.plan.command import plan
from maxfp4.model_spec import model_spec
from maxfp4.plan.context import causal_work_per_rank, imbalance
from maxfp4.precision import resolve_policy
from maxfp4.step import make_loss_fn
from maxfp4.train import init_state
from tests.conftest import TINY

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T, C, STEPS, LR = 512, 4, 8, 1.0
DENSE = TINY + ["model.n_layers=2", f"data.seq_len={T}", "data.global_batch=2"]
# Chunks of S = T / 2C = 64 tokens hold 2 SSD chunks of 32.
HYBRID = DENSE + ["model.kind=hybrid", "model.pattern=M*", "model.mlp=relu2", "model.rope=false",
                  "model.mamba.d_state=16", "model.mamba.head_dim=8", "model.mamba.n_groups=2",
                  "model.mamba.chunk_size=32", "model.mamba.kernels=xla", "optim.lr=3e-3"]


def packed_batches(cfg, steps, seed=0):
    """Rows of documents of random lengths (boundaries anywhere, most crossing the chunks of the
    split), positions restarting in each, and a padding tail in some rows (segment 0, no loss)."""
    rng = np.random.default_rng(seed)
    b, v = cfg.data.global_batch, cfg.model.vocab_size
    for _ in range(steps):
        seg, pos = np.zeros((b, T), np.int32), np.zeros((b, T), np.int32)
        for row in range(b):
            used, doc = 0, 1
            end = T - int(rng.integers(0, 40)) * (row % 2)
            while used < end:
                n = min(int(rng.integers(20, 200)), end - used)
                seg[row, used:used + n], pos[row, used:used + n] = doc, np.arange(n)
                used, doc = used + n, doc + 1
        # Each row counts up from a random token: learnable within a few steps.
        toks = ((rng.integers(0, v - 4, size=(b, 1)) + np.arange(T + 1)) % (v - 4) + 4).astype(np.int32)
        yield {"inputs": toks[:, :-1], "targets": toks[:, 1:], "segment_ids": seg, "positions": pos,
               "loss_mask": (seg > 0).astype(np.float32)}


def sgd_losses_and_first_grads(overrides, mesh_overrides, devices):
    """Losses of STEPS plain SGD steps through the real loss (one compiled value-and-gradient,
    the program whose result the context split must not change) and the first step's gradient."""
    cfg = load_config(None, overrides + mesh_overrides)
    mesh = make_mesh(cfg.mesh, devices)
    params = init_state(cfg, mesh, make_optimizer(cfg))[0].params
    b_sh = batch_sharding(mesh)
    loss_fn = make_loss_fn(cfg, resolve_policy(cfg.precision, cfg.model.n_layers), mesh)

    @jax.jit
    def sgd_step(params, batch):
        denom = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
        loss, grads = jax.value_and_grad(lambda p: loss_fn(p, {}, batch, jax.random.key(0), denom))(params)
        return loss, grads, jax.tree.map(lambda p, g: p - LR * g, params, grads)

    losses, first_grads = [], None
    for batch in packed_batches(cfg, STEPS):
        loss, grads, params = sgd_step(params, {k: jax.device_put(v, b_sh) for k, v in batch.items()})
        losses.append(float(loss))
        first_grads = jax.device_get(grads) if first_grads is None else first_grads
    return losses, first_grads


@pytest.mark.parametrize("overrides", [DENSE, HYBRID], ids=["dense", "hybrid"])
def test_context_split_trains_as_one_device(overrides):
    ref_losses, ref_grads = sgd_losses_and_first_grads(overrides, ["mesh.data=1"], jax.devices()[:1])
    losses, grads = sgd_losses_and_first_grads(overrides, ["mesh.data=1", f"mesh.context={C}"], jax.devices()[:C])
    # BF16 GEMMs, attention and SSD sums in another order on each rank: 2e-3 relative, 8 steps.
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-3)
    assert losses[-1] < 0.9 * losses[0]  # it learns the documents' counting pattern
    # Every leaf's gradient to BF16 rounding: 2e-2 in relative L2 norm (tests/test_step.py's bound).
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.linalg.norm(a64 - b64) / max(np.linalg.norm(a64), 1e-30)
        assert err <= 2e-2, (jax.tree_util.keystr(path), err)


def test_context_attention_in_query_blocks_matches_the_whole_row():
    """Forward and gradients of the split attention, its queries in 4 blocks a rank, against
    the one-device XLA attention of the unsplit row (FP32: 1e-5)."""
    t, b = 64, 2
    mesh = make_mesh(load_config(None, DENSE + ["mesh.data=1", f"mesh.context={C}"]).mesh, jax.devices()[:C])
    rng = np.random.default_rng(1)
    q, w = (rng.standard_normal((b, t, 4, 8)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((b, t, 2, 8)).astype(np.float32) for _ in range(2))
    seg = np.repeat(np.array([[1, 2, 2, 3], [1, 1, 1, 0]]), t // 4, axis=1)[:, np.r_[5:t, 0:5]]  # runs cross chunks
    order = zigzag_order(t, C)
    qb_rows = b * 4 * t * (t // C // 4)  # scores of a block of t/C/4 queries

    def split(q, k, v):
        out = context_attention(q[:, order], k[:, order], v[:, order], seg[:, order], "xla", max_scores=qb_rows)
        return jnp.sum(out * w[:, order])

    def whole(q, k, v):
        return jnp.sum(attend(q, k, v, jnp.asarray(seg), "xla") * w)

    on_mesh = [jax.device_put(x, NamedSharding(mesh, PartitionSpec())) for x in (q, k, v)]
    got = jax.jit(traced_in_mesh(jax.value_and_grad(split, argnums=(0, 1, 2)), mesh))(*on_mesh)
    want = jax.jit(jax.value_and_grad(whole, argnums=(0, 1, 2)))(q, k, v)
    for a, e in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-5)


def test_every_context_rank_loads_the_same_rows():
    # The loader never sees the split: the rows a process loads depend on data x fsdp alone, so
    # the data position does not depend on mesh.context.
    for mesh_overrides, reader in ((["mesh.data=1", f"mesh.context={C}"], (0, 1)),
                                   (["mesh.data=2", "mesh.context=2"], (0, 1))):
        mesh = make_mesh(load_config(None, DENSE + mesh_overrides).mesh, jax.devices()[:C])
        assert batch_reader(mesh, 4) == reader
        # the batch's sequences whole on every context rank, its rows split over the batch axes only
        assert batch_sharding(mesh).spec == PartitionSpec(("data", "fsdp", "expert"), None)


def test_each_rank_does_the_same_causal_work():
    t, c = 64, 4
    order = zigzag_order(t, c)
    assert sorted(order.tolist()) == list(range(t))
    seg = np.ones((1, t), np.int32)
    unmasked = []
    for r in range(c):
        q_index = rank_token_index(r, t // c, c)
        np.testing.assert_array_equal(q_index, order[r * t // c:(r + 1) * t // c])
        mask = rank_attention_mask(q_index, order, seg[:, order[r * t // c:(r + 1) * t // c]], seg[:, order])
        unmasked.append(int(np.asarray(mask).sum()))
    # Causal entries of the whole row, t(t+1)/2, split evenly: S = t/2C, rank r's two chunks
    # see (r + 2C-1-r) S^2 + S(S+1) keys.
    s = t // (2 * c)
    assert unmasked == [(2 * c - 1) * s * s + s * (s + 1)] * c
    assert sum(unmasked) == t * (t + 1) // 2


@pytest.mark.parametrize("overrides, key, working", [
    ([f"data.seq_len=500", f"mesh.context={C}"], "data.seq_len", "e.g. 496"),
    (HYBRID[len(DENSE):] + ["data.seq_len=448", f"mesh.context={C}"], "data.seq_len", "e.g. 256"),
])
def test_bad_context_input_is_one_line(overrides, key, working):
    with pytest.raises(ConfigError) as e:
        load_config(None, DENSE + overrides)
    message = str(e.value)
    assert "\n" not in message and message.startswith(key) and working in message, message


def test_planner_picks_context_when_a_sequence_does_not_fit():
    # Nemotron-H-8B's shapes at 262,144 tokens, one KV head and one group: no tensor split, and
    # one GPU cannot hold a sequence.
    cfg = load_config(os.path.join(REPO, "configs", "nemotron-h-8b.yaml"),
                      ["data.seq_len=262144", "data.global_batch=1", "model.n_kv_heads=1", "model.mamba.n_groups=1"])
    rows = plan(cfg, 4, "h200", 1e9)
    assert rows[0]["notes"][0].startswith("context: a 262,144-token sequence does not fit one GPU; mesh.context=4")
    assert all(r["fits"] and r["gpus"] == 4 and r["context"] == 4 and r["tokens_per_step"] == 262144
               for r in rows)
    # zigzag: every rank 1/C of the causal work; contiguous chunks: the last rank (2C-1)/C of the mean
    assert causal_work_per_rank(4) == [0.25] * 4
    assert imbalance(4, zigzag=False) == 7 / 4


def test_ssd_chunks_with_passed_states_equal_the_sequential_scan(x64):
    """The SSD of 2C chunks each from a zero state, plus the entry state carried over the earlier
    chunks (chunk_exit, pass_states, entry_output), against the O(T) recurrence of the whole row
    in float64 (1e-10): documents start inside chunks and exactly at a chunk's first token."""
    b, t, h, p, g, n, chunks = 2, 96, 4, 3, 2, 5, 8
    s = t // chunks
    rng = np.random.default_rng(2)
    x = rng.standard_normal((b, t, h, p))
    dt = rng.uniform(0.01, 0.5, (b, t, h))
    a = -rng.uniform(0.5, 2.0, h)
    bm, cm = rng.standard_normal((b, t, g, n)), rng.standard_normal((b, t, g, n))
    seg = np.ones((b, t), np.int32)
    seg[0, 2 * s:] = 2  # a document starting at a chunk's first token
    seg[0, 5 * s + 3:] = 3
    seg[1, s // 2 + 7 * s:] = 4  # one long document crossing six chunks, then another
    want = jax.jit(ssd_reference)(x, dt, a, bm, cm, seg)

    def rows(v):  # [B, T, ...] -> [2C * B, S, ...], chunk-major
        return jnp.moveaxis(v.reshape(b, chunks, s, *v.shape[2:]), 1, 0).reshape(chunks * b, s, *v.shape[2:])

    @jax.jit
    def split(x, dt, a, bm, cm, seg):
        y = ssd_chunked(rows(x), rows(dt), a, rows(bm), rows(cm), rows(seg), chunk_size=4)
        previous = jnp.concatenate([jnp.full((b, 1), -1), seg[:, :-1]], axis=1)
        start = rows(seg != previous)
        state, decay = chunk_exit(rows(x), rows(dt), a, rows(bm), start)
        entry = pass_states(state.reshape(chunks, b, *state.shape[1:]), decay.reshape(chunks, b, *decay.shape[1:]))
        y = y + entry_output(rows(cm), rows(dt), a, start, entry.reshape(chunks * b, *entry.shape[2:]))
        return jnp.moveaxis(y.reshape(chunks, b, s, h, p), 0, 1).reshape(b, t, h, p)

    got = split(x, dt, a, bm, cm, seg)
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-10, atol=1e-10)


def test_ssd_chunks_with_bf16_state_matmuls_stay_within_bf16_rounding():
    """The same split with model.mamba.ssd_matmul's BF16 operands (FP32 accumulation) in the
    chunks' state matmuls, as the one-device SSD takes them: within ssd_chunked's own BF16 bound
    of the FP32 scan (2e-2 of max |y|, tests/test_ssd.py), and not bit-equal to the FP32 split."""
    b, t, h, p, g, n, chunks = 2, 96, 4, 8, 2, 16, 4
    s = t // chunks
    rng = np.random.default_rng(3)
    x = rng.standard_normal((b, t, h, p)).astype(np.float32)
    dt = rng.uniform(0.01, 0.5, (b, t, h)).astype(np.float32)
    a = -rng.uniform(0.5, 2.0, h).astype(np.float32)
    bm, cm = (rng.standard_normal((b, t, g, n)).astype(np.float32) for _ in range(2))
    seg = np.ones((b, t), np.int32)
    seg[1, s + 5:] = 2
    want = np.asarray(jax.jit(ssd_reference)(x, dt, a, bm, cm, seg))

    def rows(v):
        return jnp.moveaxis(v.reshape(b, chunks, s, *v.shape[2:]), 1, 0).reshape(chunks * b, s, *v.shape[2:])

    @functools.partial(jax.jit, static_argnums=0)
    def split(matmul_dtype, x, dt, a, bm, cm, seg):
        y = ssd_chunked(rows(x), rows(dt), a, rows(bm), rows(cm), rows(seg), chunk_size=8, matmul_dtype=matmul_dtype)
        previous = jnp.concatenate([jnp.full((b, 1), -1), seg[:, :-1]], axis=1)
        start = rows(seg != previous)
        state, decay = chunk_exit(rows(x), rows(dt), a, rows(bm), start, matmul_dtype)
        entry = pass_states(state.reshape(chunks, b, *state.shape[1:]), decay.reshape(chunks, b, *decay.shape[1:]))
        y = y + entry_output(rows(cm), rows(dt), a, start, entry.reshape(chunks * b, *entry.shape[2:]), matmul_dtype)
        return jnp.moveaxis(y.reshape(chunks, b, s, h, p), 0, 1).reshape(b, t, h, p)

    low, full = (np.asarray(split(m, x, dt, a, bm, cm, seg)) for m in (jnp.bfloat16, None))
    scale = np.max(np.abs(want))
    assert np.max(np.abs(full - want)) / scale < 1e-5
    assert 0 < np.max(np.abs(low - want)) / scale < 2e-2


@pytest.mark.parametrize("tokens, block", [(96, 8), (96, 32), (100, 8), (8, 8)])
def test_token_sums_in_blocks_are_the_cumulative_sums(x64, tokens, block):
    """The context SSD's sums over a chunk's tokens (blocks of ``block`` where the chunk holds
    several whole ones, one triangle otherwise) against NumPy's cumulative sum in float64 (sums
    of <= 100 numbers of O(1): 1e-12), both directions; and at 8,192 tokens no matmul operand is
    wider than the block (a [S, S] triangle was ~1 ms of FP32 GEMM a call on an H200)."""
    from maxfp4.model.ssd import TOKEN_SUM_BLOCK, _sum_over_tokens
    x = np.random.default_rng(4).standard_normal((3, tokens, 2, 5))
    before = np.cumsum(x, axis=1)
    after = np.sum(x, axis=1, keepdims=True) - before
    np.testing.assert_allclose(_sum_over_tokens(jnp.asarray(x), True, block), before, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_sum_over_tokens(jnp.asarray(x), False, block), after, rtol=1e-12, atol=1e-12)
    jaxpr = jax.make_jaxpr(lambda v: _sum_over_tokens(v, True))(jnp.zeros((2, 8192, 4), jnp.float32))
    widths = [max(var.aval.shape) for eqn in jaxpr.eqns if eqn.primitive.name == "dot_general"
              for var in eqn.invars if var.aval.shape[0] != 2]
    assert widths and max(widths) <= TOKEN_SUM_BLOCK


@pytest.mark.parametrize("recipe", ["bf16", "fp8_delayed"])
def test_each_rank_computes_only_its_own_tokens(recipe):
    """context=2 with two rows a device: every GEMM and norm works on the rank's [B, T/C]
    tokens. Flattened as [B, T], a rank's rows were B runs apart, and XLA's partitioner gathered
    the whole sequence on every rank and computed every token's GEMMs there (C times the work,
    seen as a measured 16k-token step 27% over the model); the RMSNorm's scale gradient did the
    same. What is still gathered over the sequence is attention's keys and values."""
    import re
    from maxfp4.optim import make_schedule
    from maxfp4.train import jit_train_step
    cfg = load_config(None, TINY + ["data.seq_len=96", "data.global_batch=2", "mesh.data=1", "mesh.context=2",
                                    f"precision.default={recipe}", "precision.rules=[]"])
    mesh = make_mesh(cfg.mesh, jax.devices()[:2])
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    optimizer = make_optimizer(cfg)
    state, state_sh = init_state(cfg, mesh, optimizer, policy)
    step = jit_train_step(cfg, policy, optimizer, make_schedule(cfg), mesh, state_sh, {})
    b, t, d = cfg.data.global_batch, cfg.data.seq_len, cfg.model.d_model
    batch = {k: np.zeros((b, t), np.float32 if k == "loss_mask" else np.int32)
             for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
    hlo = step.lower(state, batch).compile().as_text()
    gathered = set(re.findall(r"= \w+\[([\d,]+)\]\S* all-gather", hlo))
    assert not {s for s in gathered if s.startswith(f"{b},{t},") and not s.endswith(",16")}, gathered  # K, V: [B, T, K, 16]
    # the GEMMs' [M, N] outputs: the rank's tokens, never all
    rows = {int(m) for m in re.findall(r"= \w+\[(\d+),\d+\]\S* (?:dot|fusion)\(.*op_name=\"[^\"]*dot_general\"", hlo)}
    assert b * t // 2 in rows and b * t not in rows, sorted(rows)


MOE = DENSE + ["model.kind=hybrid", "model.pattern=*E", "model.mlp=relu2", "model.moe.experts=4",
               "model.moe.d_ff=64", "model.moe.shared_experts=1"]


def _shard_map_token_rows(jaxpr, d: int) -> set[int]:
    """A device's rows of every [rows, d] input of every shard_map in ``jaxpr`` (nested ones too)
    but autodiff's residuals (laid out over every mesh axis): the experts' tokens and their
    cotangents (the attention's shard_maps take [B, T, heads, H])."""
    rows = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            every_axis = len(eqn.params["mesh"].axis_names)
            for var, spec in zip(eqn.params["jaxpr"].invars, eqn.params["in_specs"]):
                residual = spec and isinstance(spec[0], tuple) and len(spec[0]) == every_axis
                if var.aval.ndim == 2 and var.aval.shape[1] == d and not residual:
                    rows.add(var.aval.shape[0])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            rows |= _shard_map_token_rows(sub, d)
    return rows


def shard_map_input_shapes(jaxpr, ndim: int) -> set[tuple[int, ...]]:
    """The per-device shapes of every input of at least ``ndim`` dims of every shard_map in
    ``jaxpr`` (nested ones too): what a kernel or the experts' exchange runs on."""
    shapes = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            shapes.update(v.aval.shape for v in eqn.params["jaxpr"].invars if v.aval.ndim >= ndim)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            shapes |= shard_map_input_shapes(sub, ndim)
    return shapes


def split_against_one_device(overrides: list[str], mesh_overrides: list[str], devices: int,
                             gradient_bound: float = 2e-2):
    """The model of ``overrides`` on ``devices`` devices split by ``mesh_overrides`` against one
    device, on packed documents: the loss and every gradient equal (BF16 GEMMs and attention
    sums in another order: the dense and hybrid test's bounds; ``gradient_bound`` each
    gradient's relative L2 error). Returns the split step's jaxpr."""
    def loss_grads_program(mesh_part, used):
        cfg = load_config(None, overrides + ["mesh.data=1"] + mesh_part)
        mesh = make_mesh(cfg.mesh, used)
        params = init_state(cfg, mesh, make_optimizer(cfg))[0].params
        loss_fn = make_loss_fn(cfg, resolve_policy(cfg.precision, cfg.model.n_layers), mesh)
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in next(packed_batches(cfg, 1)).items()}
        fn = lambda p, b: jax.value_and_grad(lambda q: loss_fn(q, {}, b, jax.random.key(0), 1000.0))(p)  # noqa: E731
        return jax.jit(fn)(params, batch), jax.make_jaxpr(fn)(params, batch)

    (ref_loss, ref_grads), _ = loss_grads_program([], jax.devices()[:1])
    (loss, grads), jaxpr = loss_grads_program(mesh_overrides, jax.devices()[:devices])
    assert abs(float(loss) - float(ref_loss)) <= 2e-3 * abs(float(ref_loss))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.linalg.norm(a64 - b64) / max(np.linalg.norm(a64), 1e-30)
        assert err <= gradient_bound, (jax.tree_util.keystr(path), err)
    return jaxpr


def moe_split_against_one_device(mesh_overrides: list[str]) -> int:
    """:func:`split_against_one_device` for the attention + MoE stack (``MOE``) on two devices;
    returns a device's rows of the tokens the experts' shard_map takes, read from the program.
    Gradients to 3e-2: a token whose router scores for two experts are within rounding of each
    other may pick another expert when the sums before run in another order, which moves both
    experts' gradients (an expert's w_down came to 2.6e-2 under jax 0.11's CPU compiler)."""
    jaxpr = split_against_one_device(MOE, mesh_overrides, 2, gradient_bound=3e-2)
    rows = _shard_map_token_rows(jaxpr.jaxpr, load_config(None, MOE).model.d_model)
    assert len(rows) == 1, rows
    return rows.pop()


def test_a_context_split_mamba_mixer_is_split_over_tensor_too():
    """The hybrid at context=2 x tensor=2 against one device: each device runs the Mamba-2 core
    on its context rank's tokens and its tensor rank's heads (the core's input a quarter of the
    in_proj output, read from the program), where each tensor rank had run it whole."""
    jaxpr = split_against_one_device(HYBRID, ["mesh.context=2", "mesh.tensor=2"], 4)
    cfg = load_config(None, HYBRID)
    b, inner = cfg.data.global_batch, model_spec(cfg.model).blocks[0].linears[0].n
    shapes = {s for s in shard_map_input_shapes(jaxpr.jaxpr, 3) if len(s) == 3}
    assert (b, T // 2, inner // 2) in shapes and (b, T // 2, inner) not in shapes, sorted(shapes)


def test_a_context_rank_routes_and_runs_only_its_own_tokens_through_the_experts():
    """An attention + MoE stack at context=2 against one device, on packed documents crossing
    the split; each rank's expert computation takes its T/C tokens of a row, not the sequence's T."""
    assert moe_split_against_one_device(["mesh.context=2"]) == load_config(None, MOE).data.global_batch * T // 2


def test_capacity_serves_the_batchs_token_order_whatever_the_rows_order():
    """Rows in a context split's rank-major order with ``token_order`` given: the same
    assignments are dropped as with the rows in the batch's order (capacity 1.0 of 4 experts
    with a router that favours two). Exact: the drop is a count, not a rounding."""
    from maxfp4.model.moe import choose_experts
    b, t, c, x, k = 2, 16, 2, 4, 2
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(b, t, x)) + np.array([2.0, 1.5, 0.0, 0.0])
    to_rows = lambda a: a.reshape(b, c, t // c, -1).swapaxes(0, 1).reshape(b * t, -1)  # noqa: E731
    to_tokens = lambda a: a.reshape(c, b, t // c, -1).swapaxes(0, 1).reshape(b * t, -1)  # noqa: E731
    batch_order = choose_experts(jnp.asarray(logits.reshape(b * t, x)), None, k, "sigmoid", 1.0)
    rank_major = choose_experts(jnp.asarray(to_rows(logits)), None, k, "sigmoid", 1.0, token_order=(to_tokens, to_rows))
    assert int(batch_order.stats_S[x]) > 0  # some assignments dropped
    np.testing.assert_array_equal(np.asarray(rank_major.experts_Nk), to_rows(np.asarray(batch_order.experts_Nk)))
    np.testing.assert_array_equal(np.asarray(rank_major.stats_S), np.asarray(batch_order.stats_S))
    unordered = choose_experts(jnp.asarray(to_rows(logits)), None, k, "sigmoid", 1.0)
    assert not np.array_equal(np.asarray(unordered.experts_Nk), np.asarray(rank_major.experts_Nk))  # the order bites
