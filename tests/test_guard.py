"""The non-finite / spike guard: its statistic against a NumPy reference, and inside the real train
step (good steps bit-identical to the step without the guard; a NaN step leaves the state alone)."""

import collections

import jax
import numpy as np
import pytest

from maxfp4.guard import REL_STD_FLOOR, init_guard_state, judge
from maxfp4.mesh import batch_sharding, make_constrain, make_mesh
from maxfp4.optim import make_optimizer, make_schedule
from maxfp4.precision import resolve_policy
from maxfp4.step import make_train_step
from maxfp4.train import init_state
from tests.test_step import _batch


def _reference(series, window, sigmas, warmup):
    """Plain NumPy: mean and population std of the last `window` accepted values."""
    losses, gnorms = collections.deque(maxlen=window), collections.deque(maxlen=window)
    out = []
    for loss, gnorm in series:
        ok = bool(np.isfinite(loss) and np.isfinite(gnorm))
        if ok and len(losses) >= warmup:
            for hist, v in ((losses, loss), (gnorms, gnorm)):
                h = np.asarray(hist, np.float64)
                std = max(h.std(), REL_STD_FLOOR * abs(h.mean()))
                ok = ok and not v > h.mean() + sigmas * std
        if ok:
            losses.append(loss)
            gnorms.append(gnorm)
        out.append(ok)
    return out


def test_spike_statistic_matches_numpy_reference():
    rng = np.random.default_rng(0)
    n, window, sigmas, warmup = 160, 16, 3.0, 5
    loss = 5.0 - np.linspace(0, 2, n) + 0.05 * rng.standard_normal(n)
    gnorm = 1.0 + 0.1 * rng.standard_normal(n)
    loss[[20, 21, 90]] += [1.0, 0.6, 3.0]  # spikes
    gnorm[[40, 120]] *= [5.0, 30.0]
    loss[[50, 51]] = [np.nan, np.inf]
    gnorm[[3, 70]] = np.nan  # non-finite inside the warm-up too
    loss[100:110] = loss[99] + 0.3 * rng.standard_normal(10)  # noisy stretch: some pass, some not
    series = list(zip(loss.astype(np.float32).tolist(), gnorm.astype(np.float32).tolist()))
    expected = _reference(series, window, sigmas, warmup)

    step = jax.jit(lambda g, l, gn: judge(g, l, gn, sigmas=sigmas, warmup=warmup))
    guard = init_guard_state(window)
    got = []
    for l, gn in series:
        ok, guard = step(guard, np.float32(l), np.float32(gn))
        got.append(bool(ok))
    assert got == expected
    assert not got[3] and not got[20] and not got[40] and not got[50] and not got[120]
    assert 150 > sum(got) > 130
    assert int(guard["skipped"]) == expected.count(False)
    assert int(guard["good"]) == expected.count(True)


def test_consecutive_counter_and_spikes_off():
    guard = init_guard_state(4)
    for value, consecutive in ((np.nan, 1), (np.inf, 2), (1.0, 0), (np.nan, 1)):
        ok, guard = judge(guard, np.float32(value), np.float32(1.0), sigmas=0.0, warmup=2)
        assert int(guard["consecutive"]) == consecutive
    for _ in range(5):  # spikes off: any finite value passes
        ok, guard = judge(guard, np.float32(1e30), np.float32(1e30), sigmas=0.0, warmup=2)
        assert bool(ok)


def _step_fn(cfg):
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    optimizer = make_optimizer(cfg)
    state, state_sh = init_state(cfg, mesh, optimizer)
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    step = make_train_step(cfg, policy, optimizer, make_schedule(cfg), make_constrain(mesh))
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
    assert int(s2.step) == 2  # the step counter (and so the data) moved on
    for a, b in zip(_host(s2.params) + _host(s2.opt_state) + _host(s2.precision), after1):
        assert np.array_equal(a, b)

    s3, m3 = step(s2, batches[2])
    assert int(m3["skipped"]) == 0 and int(m3["consecutive_skips"]) == 0 and np.isfinite(float(m3["loss"]))
    assert all(np.isfinite(x).all() for x in _host(s3.params))
