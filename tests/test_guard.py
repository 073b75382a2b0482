"""The non-finite / spike guard: its statistic against a NumPy reference; loss and gradient-norm
traces of real runs (tests/data/guard_traces/, every file) replayed through the jitted judge:
no skip on the healthy runs, injected spikes and non-finite steps skipped; level shifts, drifts
and declines skip at most the documented bound; inside the real train step (good steps
bit-identical to the step without the guard; a NaN step leaves the state alone); re-runs of skipped
steps (every step bit-identical with them on; transient and persistent faults told apart)."""

import collections
import glob
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from maxfp4.compiler import xla_knows_cpu_fusion_emitters_flag
from maxfp4.config import ConfigError, ResilienceConfig, load_config
from maxfp4.reliability.guard import init_guard_state, judge, level_shift_bound
from maxfp4.reliability.rerun import (DIFFERED, NOT_RERUN, REPRODUCED, RerunHook, describe_devices,
                                     reruns_of)
from maxfp4.parallel.mesh import batch_sharding, make_mesh
from maxfp4.optim import make_optimizer, make_schedule
from maxfp4.precision import resolve_policy
from maxfp4.step import make_train_step
from maxfp4.train import init_state
from tests.conftest import TINY, cpu_env
from tests.test_step import _batch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULTS = ResilienceConfig()
W, MARGIN, WARMUP = DEFAULTS.spike_window, DEFAULTS.spike_margin, DEFAULTS.spike_warmup
BOUND = level_shift_bound(W)
TRACES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "data", "guard_traces", "*.json")))


def _reference(series, window, margin, warmup):
    """Plain NumPy in float64: each step against the median of the last `window` finite losses
    (skipped ones included). Returns (ok per step, each step's distance to its threshold
    relative to the threshold, inf where no spike was judged)."""
    losses, seen = collections.deque(maxlen=window), 0
    ok_all, gaps = [], []
    for loss, gnorm in series:
        finite = bool(np.isfinite(loss) and np.isfinite(gnorm))
        ok, gap = finite, np.inf
        if finite and seen >= warmup:
            threshold = np.median(np.asarray(losses, np.float64)) * (1 + margin)
            ok, gap = not loss > threshold, abs(loss - threshold) / threshold
        if finite:
            losses.append(loss)
            seen += 1
        ok_all.append(ok)
        gaps.append(gap)
    return ok_all, np.asarray(gaps)


@jax.jit
def _replay(loss_N, grad_norm_N):
    """The jitted judge over a whole trace with the default settings (one scan): ok per step."""
    def step(guard, x):
        ok, guard = judge(guard, x[0], x[1], margin=MARGIN, warmup=WARMUP)
        return guard, ok
    _, ok_N = jax.lax.scan(step, init_guard_state(W), jnp.stack([loss_N, grad_norm_N], axis=1))
    return ok_N


def _skips(loss, grad_norm=None):
    loss = np.asarray(loss, np.float32)
    grad_norm = np.ones_like(loss) if grad_norm is None else np.asarray(grad_norm, np.float32)
    return np.flatnonzero(~np.asarray(_replay(loss, grad_norm)))


def _running_median(loss_N):
    """NumPy: the median of the `W` losses before each step (NaN before the window has one)."""
    return np.array([np.median(loss_N[max(0, t - W):t]) if t else np.nan for t in range(len(loss_N))])


def test_spike_statistic_matches_numpy_reference():
    rng = np.random.default_rng(0)
    n, window, margin, warmup = 200, 9, 0.3, 12
    loss = 5.0 - np.linspace(0, 2, n) + 0.1 * rng.standard_normal(n)
    loss[[20, 21, 90, 150]] *= [1.6, 1.45, 3.0, 1.15]  # spikes, some under the margin
    loss[[50, 51]] = [np.nan, np.inf]
    gnorm = 1.0 + 0.1 * rng.standard_normal(n)
    gnorm[[3, 70]] = np.nan  # non-finite inside the warm-up too
    gnorm[120] = 1e30  # a large finite norm is the clipping's business, not the guard's
    loss[160:175] *= 1.5  # a level shift: skipped, then the new normal
    series = list(zip(loss.astype(np.float32).tolist(), gnorm.astype(np.float32).tolist()))
    expected, gaps = _reference(series, window, margin, warmup)
    # float32 median and threshold against float64: no value lies within 1e-5 of its threshold,
    # so the comparison does not hinge on rounding.
    assert gaps.min() > 1e-5

    step = jax.jit(lambda g, l, gn: judge(g, l, gn, margin=margin, warmup=warmup))
    guard = init_guard_state(window)
    got = []
    for l, gn in series:
        ok, guard = step(guard, np.float32(l), np.float32(gn))
        got.append(bool(ok))
    assert got == expected
    bad = {i for i, ok in enumerate(got) if not ok}
    assert {3, 20, 21, 50, 51, 70, 90, 160} <= bad and not {120, 150} & bad
    assert 0 < len(bad & set(range(160, 175))) <= level_shift_bound(window)
    assert int(guard["skipped"]) == len(bad)
    assert int(guard["seen"]) == sum(np.isfinite(l) and np.isfinite(g) for l, g in series)


def test_consecutive_counters_suspension_and_spikes_off():
    guard = init_guard_state(4)
    for value, consecutive, nonfinite in ((np.nan, 1, 1), (np.inf, 2, 2), (1.0, 0, 0), (np.nan, 1, 1)):
        ok, guard = judge(guard, np.float32(value), np.float32(1.0), margin=1.0, warmup=2)
        assert (int(guard["consecutive"]), int(guard["streak_nonfinite"])) == (consecutive, nonfinite)
    for _ in range(3):
        ok, guard = judge(guard, np.float32(1.0), np.float32(1.0), margin=1.0, warmup=2)
    ok, guard = judge(guard, np.float32(5.0), np.float32(1.0), margin=1.0, warmup=2)
    assert not bool(ok) and (int(guard["consecutive"]), int(guard["streak_nonfinite"])) == (1, 0)
    # Suspended (as the host sets it after a streak with nothing to roll back to): spikes pass
    # for that many steps, non-finite steps do not.
    guard = dict(guard, suspend=jnp.int32(2))
    ok, guard = judge(guard, np.float32(50.0), np.float32(1.0), margin=1.0, warmup=2)
    assert bool(ok) and int(guard["suspend"]) == 1
    ok, guard = judge(guard, np.float32(1.0), np.float32(np.nan), margin=1.0, warmup=2)
    assert not bool(ok) and int(guard["suspend"]) == 0
    ok, guard = judge(guard, np.float32(500.0), np.float32(1.0), margin=1.0, warmup=2)
    assert not bool(ok)
    for _ in range(5):  # spikes off: any finite value passes
        ok, guard = judge(guard, np.float32(1e30), np.float32(1e30), margin=0.0, warmup=2)
        assert bool(ok)


def test_guard_traces_are_there_and_well_formed():
    assert len(TRACES) >= 1
    for path in TRACES:
        trace = json.load(open(path))
        assert isinstance(trace["source"], str) and trace["source"]
        assert len(trace["loss"]) == len(trace["grad_norm"]) > 2 * WARMUP, path


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_healthy_trace_has_no_skip_and_every_injected_spike_is_skipped(path):
    trace = json.load(open(path))
    loss, grad_norm = np.asarray(trace["loss"], np.float32), np.asarray(trace["grad_norm"], np.float32)
    assert _skips(loss, grad_norm).size == 0

    level = _running_median(loss)
    positions = np.arange(WARMUP, len(loss))
    # One spike per replay, at every step after the warm-up: the loss tripled. A step whose own
    # loss is below the level is tripled from the level (an easy batch tripled can land where
    # healthy hard batches do, docs/RELIABILITY.md).
    spiked = np.tile(loss, (len(positions), 1))
    spiked[np.arange(len(positions)), positions] = 3 * np.maximum(loss[positions], level[positions])
    ok = np.array(jax.vmap(_replay, in_axes=(0, None))(spiked, grad_norm))
    assert not ok[np.arange(len(positions)), positions].any()  # every spike skipped
    ok[np.arange(len(positions)), positions] = True
    assert ok.all()  # and nothing else: the window's median is not moved by one spike

    # Non-finite gradients or loss, the warm-up included: skipped, and only those steps.
    bad_steps = [1, WARMUP - 1, WARMUP + 7, len(loss) // 2, len(loss) - 1]
    g, l = grad_norm.copy(), loss.copy()
    g[bad_steps[:3]] = [np.nan, np.inf, np.nan]
    l[bad_steps[3:]] = [np.nan, np.inf]
    assert _skips(l, g).tolist() == bad_steps


@pytest.mark.parametrize("path", TRACES, ids=os.path.basename)
def test_level_shifts_in_real_traces_skip_at_most_the_bound(path):
    """A lasting rise of the real loss by any factor: skipped steps only right after it, at most
    the bound, and the bound below max_consecutive_skips (no rollback)."""
    loss = np.asarray(json.load(open(path))["loss"], np.float32)
    assert BOUND < DEFAULTS.max_consecutive_skips
    for factor in (1.3, 1.5, 3.0, 10.0):
        for at in (WARMUP + 10, len(loss) // 2):
            shifted = loss.copy()
            shifted[at:] *= factor
            skips = _skips(shifted)
            assert skips.size <= BOUND and all(at <= s < at + BOUND for s in skips), (factor, at, skips)


NOISE = st.floats(0.0, 0.1)  # log-normal per-step noise (the healthy traces: about 0.05 to 0.2)


def _noisy(level_N, sigma, seed):
    return level_N * np.exp(sigma * np.random.default_rng(seed).standard_normal(len(level_N)))


@settings(max_examples=25, deadline=None)
@given(start=st.floats(0.05, 20.0), sigma=NOISE, seed=st.integers(0, 2**31 - 1))
def test_drift_up_fifty_percent_over_500_steps_skips_at_most_the_bound(start, sigma, seed):
    level = start * np.concatenate([np.ones(WARMUP), np.linspace(1.0, 1.5, 500)])
    assert _skips(_noisy(level, sigma, seed)).size <= BOUND


@settings(max_examples=25, deadline=None)
@given(start=st.floats(0.05, 20.0), factor=st.sampled_from([1.3]) | st.floats(1.3, 50.0), sigma=NOISE,
       at=st.integers(WARMUP, 300), seed=st.integers(0, 2**31 - 1))
def test_step_change_that_stays_skips_at_most_the_bound(start, factor, sigma, at, seed):
    level = np.full(400, start)
    level[at:] *= factor
    skips = _skips(_noisy(level, sigma, seed))
    assert skips.size <= BOUND and all(s >= at for s in skips)


@settings(max_examples=25, deadline=None)
@given(start=st.floats(0.05, 20.0), end=st.floats(0.05, 1.0), sigma=NOISE, seed=st.integers(0, 2**31 - 1))
def test_slow_decline_skips_at_most_the_bound(start, end, sigma, seed):
    level = start * np.geomspace(1.0, end, 550)
    assert _skips(_noisy(level, sigma, seed)).size <= BOUND


def test_window_that_could_reach_a_rollback_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"^resilience.spike_window=20: expected at most 17 with max_consecutive"):
        load_config(None, [f"run.output_dir={tmp_path}", "resilience.spike_window=20"])
    load_config(None, [f"run.output_dir={tmp_path}", "resilience.spike_window=20", "resilience.spike_margin=0"])
    with pytest.raises(ConfigError, match=r"^resilience.fault.loss_scale=-1.0: expected a finite factor > 0$"):
        load_config(None, [f"run.output_dir={tmp_path}", "resilience.fault.loss_scale=-1.0"])


def _step_fn(cfg):
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    optimizer = make_optimizer(cfg)
    state, state_sh = init_state(cfg, mesh, optimizer)
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    step = make_train_step(cfg, policy, optimizer, make_schedule(cfg), mesh)
    b_sh = batch_sharding(mesh)
    return state, jax.jit(step, in_shardings=(state_sh, b_sh), out_shardings=(state_sh, None)), b_sh


def _host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


@pytest.mark.parametrize("recipe", ["bf16", "fp8_delayed"])
def test_guard_keeps_good_steps_bit_identical_and_skips_a_nan_step(tiny_cfg, recipe):
    """Parameters, optimizer state and (FP8) the delayed-scaling state: a good step's equal the
    unguarded step's bit for bit, a skipped step keeps them."""
    plain_state, plain_step, b_sh = _step_fn(tiny_cfg("mesh.data=1", "resilience.guard=false",
                                                      f"precision.default={recipe}"))
    state, step, _ = _step_fn(tiny_cfg("mesh.data=1", "resilience.fault.nonfinite_at_steps=[2]",
                                       "resilience.spike_warmup=2", f"precision.default={recipe}"))
    initial_precision = _host(state.precision)
    batches = [{k: jax.device_put(v, b_sh) for k, v in _batch(tiny_cfg(), seed=i).items()} for i in range(3)]

    plain_state, plain_m = plain_step(plain_state, batches[0])
    s1, m1 = step(state, batches[0])
    assert float(m1["loss"]) == float(plain_m["loss"]) and int(m1["skipped"]) == 0
    for a, b in zip(_host(s1.params) + _host(s1.opt_state) + _host(s1.precision),
                    _host(plain_state.params) + _host(plain_state.opt_state) + _host(plain_state.precision)):
        assert np.array_equal(a, b)  # bit for bit: the guard does not touch a good step's math
    if recipe == "fp8_delayed":  # the scaling state did move on the good step
        assert any(not np.array_equal(a, b) for a, b in zip(_host(s1.precision), initial_precision))

    after1 = _host(s1.params) + _host(s1.opt_state) + _host(s1.precision)
    s2, m2 = step(s1, batches[1])
    assert not np.isfinite(float(m2["grad_norm"])) and int(m2["skipped"]) == 1 and int(m2["skipped_steps"]) == 1
    assert int(m2["streak_nonfinite"]) == 1
    assert int(s2.step) == 2  # the step counter (and so the data) moved on
    for a, b in zip(_host(s2.params) + _host(s2.opt_state) + _host(s2.precision), after1):
        assert np.array_equal(a, b)

    s3, m3 = step(s2, batches[2])
    assert int(m3["skipped"]) == 0 and int(m3["consecutive_skips"]) == 0 and np.isfinite(float(m3["loss"]))
    assert all(np.isfinite(x).all() for x in _host(s3.params))


def test_loss_scale_fault_multiplies_loss_and_gradients_from_its_step(tiny_cfg):
    """``resilience.fault.loss_scale``: the same batch and state give F x the loss and F x the
    gradient norm from ``loss_scale_at_step`` on. F = 2 scales every BF16 operand of the backward
    exactly, so only float32 summation order remains (relative error bound 1e-6)."""
    state, plain, b_sh = _step_fn(tiny_cfg("mesh.data=1", "resilience.guard=false"))
    _, scaled, _ = _step_fn(tiny_cfg("mesh.data=1", "resilience.guard=false", "resilience.fault.loss_scale=2.0",
                                     "resilience.fault.loss_scale_at_step=2"))
    batch = {k: jax.device_put(v, b_sh) for k, v in _batch(tiny_cfg(), seed=0).items()}
    first = state.replace(step=jnp.int32(0))
    second = state.replace(step=jnp.int32(1))  # the step that reports as step 2
    _, m_plain = plain(first, batch)
    _, m_before = scaled(first, batch)
    assert float(m_before["loss"]) == float(m_plain["loss"])
    _, m_after = scaled(second, batch)
    _, m_plain2 = plain(second, batch)
    np.testing.assert_allclose(float(m_after["loss"]), 2.0 * float(m_plain2["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m_after["grad_norm"]), 2.0 * float(m_plain2["grad_norm"]), rtol=1e-6)


def test_rerun_keeps_every_step_bit_identical_and_tells_a_transient_fault_from_a_persistent_one():
    """Two microbatches and FP8 delayed scaling (the scan and the scaling state inside the re-run). Steps: 1 good; 2 NaN gradients in the first evaluation only (transient); 3 NaN gradients in
    every evaluation (persistent); 4 the loss x10 (a spike, persistent); 5 good. With re-runs on,
    every step's state and metrics equal the step's without them bit for bit, and the verdicts
    are 0, differed, reproduced, reproduced, 0.

    The two steps are two programs, so bit-equality also needs XLA to compile their shared part
    alike: it does with XLA's own CPU fusion emitters, which this test runs in a process of its
    own (tests/conftest.py turns them off for the suite's compile time; with the loop emitters the
    two programs' FP32 sums differed in the last bit)."""
    env = cpu_env(8, PYTHONPATH=REPO)
    # (jaxlib 0.11 has the fusion emitters only, and no flag for them)
    emitters = ["--xla_cpu_use_fusion_emitters=true"] if xla_knows_cpu_fusion_emitters_flag() else []
    env["XLA_FLAGS"] = " ".join([f for f in env["XLA_FLAGS"].split() if not f.startswith("--xla_cpu_use_fusion_emitters")]
                                + emitters)
    code = "from tests.test_guard import _rerun_case; _rerun_case()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("rerun case ok"), proc.stdout[-2000:]


def _rerun_case():
    """The body of the test above, in its own process."""
    import tempfile
    out = tempfile.mkdtemp()

    def tiny_cfg(*overrides):
        return load_config(None, TINY + [f"run.output_dir={out}"] + list(overrides))

    faults = ["mesh.data=1", "run.deterministic=true", "train.microbatches=2", "precision.default=fp8_delayed",
              "resilience.spike_warmup=1",
              "resilience.fault.transient_nonfinite_at_steps=[2]", "resilience.fault.nonfinite_at_steps=[3]",
              "resilience.fault.loss_scale=10", "resilience.fault.loss_scale_at_step=4"]
    plain_state, plain_step, b_sh = _step_fn(tiny_cfg(*faults))
    state, step, _ = _step_fn(tiny_cfg(*faults, "resilience.rerun_skipped=true"))
    verdicts = []
    for i in range(5):
        batch = {k: jax.device_put(v, b_sh) for k, v in _batch(tiny_cfg(), seed=i).items()}
        plain_state, plain_m = plain_step(plain_state, batch)
        state, m = step(state, batch)
        assert "rerun_verdict" not in plain_m
        verdicts.append(int(m.pop("rerun_verdict")))
        # Every leaf but the random key (a key array; it never changes): params, optimizer, precision, guard.
        for a, b in zip(_host(state.replace(rng=None)) + _host(m),
                        _host(plain_state.replace(rng=None)) + _host(plain_m)):
            assert np.array_equal(a, b, equal_nan=True) and a.tobytes() == b.tobytes()
    assert verdicts == [NOT_RERUN, DIFFERED, REPRODUCED, REPRODUCED, NOT_RERUN]
    assert int(m["skipped_steps"]) == 3
    print("rerun case ok")


def test_rerun_needs_deterministic_ops_and_the_guard(tmp_path):
    base = [f"run.output_dir={tmp_path}", "resilience.rerun_skipped=true"]
    with pytest.raises(ConfigError, match=r"^resilience.rerun_skipped=True: expected false unless run.determ"):
        load_config(None, base)
    with pytest.raises(ConfigError, match=r"^resilience.rerun_skipped=True: expected false with resilience.guard="):
        load_config(None, base + ["run.deterministic=true", "resilience.guard=false"])
    with pytest.raises(ConfigError, match=r"^resilience.rerun_drain_after=0: expected an integer >= 1$"):
        load_config(None, base + ["run.deterministic=true", "resilience.rerun_drain_after=0"])
    assert load_config(None, base + ["run.deterministic=true"]).resilience.rerun_skipped


def test_rerun_lines_name_the_devices_and_say_drain_once_faults_repeat():
    """The host side on real devices: one device is named exactly; several are named as a group,
    since the re-run compares results summed over all of them."""
    lines = []
    one = RerunHook(describe_devices(jax.devices()[:1], 0, 1, "node7"), single_device=True, drain_after=2,
                    say=lines.append, is_writer=True)
    good = {"loss": 2.0, "grad_norm": 1.0}
    for step, verdict, loss in ((1, NOT_RERUN, 2.0), (2, DIFFERED, float("nan")), (3, REPRODUCED, 9.0),
                                (4, DIFFERED, 2.0), (5, DIFFERED, 2.0)):
        one.after_step(None, step, dict(good, loss=loss, rerun_verdict=verdict), False)
    assert lines == [
        "rerun: step 2 skipped (non-finite); its re-run gave a different result: a transient hardware fault "
        "(silent data corruption) on device cpu:0 of process 0 (host node7), 1 in this run",
        "rerun: step 3 skipped (spike); its re-run reproduced it bit for bit: a divergence or bad data, not a "
        "hardware fault (device cpu:0 of process 0 (host node7))",
        "rerun: step 4 skipped (spike); its re-run gave a different result: a transient hardware fault "
        "(silent data corruption) on device cpu:0 of process 0 (host node7), 2 in this run",
        "rerun: device cpu:0 of process 0 (host node7) gave different results on 2 re-runs (steps 2, 4): drain it",
        "rerun: step 5 skipped (spike); its re-run gave a different result: a transient hardware fault "
        "(silent data corruption) on device cpu:0 of process 0 (host node7), 3 in this run",
    ]
    assert [(r["step"], r["skip"], r["verdict"]) for r in reruns_of([one])] == [
        (2, "non-finite", "differed"), (3, "spike", "reproduced"), (4, "spike", "differed"), (5, "spike", "differed")]

    lines.clear()
    group = RerunHook(describe_devices(jax.devices()[:4], 1, 2, "node7"), single_device=False, drain_after=1,
                      say=lines.append, is_writer=True)
    group.after_step(None, 9, dict(good, rerun_verdict=DIFFERED), False)
    assert lines[-1].startswith("rerun: 1 re-runs (steps 9) gave different results on one of the 4 devices of "
                                "processes 0..1: one of them is faulty")
    silent = RerunHook("device cpu:0", single_device=True, drain_after=1, say=lines.append, is_writer=False)
    silent.after_step(None, 9, dict(good, rerun_verdict=DIFFERED), False)
    assert len(lines) == 2 and reruns_of([silent])[0]["verdict"] == "differed" and reruns_of([]) is None
