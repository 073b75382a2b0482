"""The non-finite and spike guard, evaluated inside the jitted train step (no host sync).

A step is *bad* when its loss or gradient norm is non-finite, or, once ``spike_warmup`` good
steps have been seen, when its loss or gradient norm exceeds the mean of the recent good steps
by more than ``spike_sigmas`` standard deviations. A bad step's update is not applied: the
caller keeps the old parameters, optimizer state and precision state, while the step counter
(and so the learning-rate schedule and the data) moves on, exactly as if the batch had been
dropped from the dataset. Re-feeding the same batch would only fail the same way.

Running statistics: a fixed ring buffer of the last ``spike_window`` good steps' loss and
gradient norm, rather than an EMA. A ring buffer gives the exact mean and (population, ddof=0)
standard deviation of a known set of steps, forgets a regime change completely after one window,
and is trivially checked against NumPy; it costs two float32 vectors of ``spike_window``
entries. Bad steps never enter the buffer, so a spike cannot inflate the tolerance that judges
the next one. The standard deviation is floored at ``REL_STD_FLOOR`` x |mean| so that a
near-constant series (a flat loss) does not turn rounding noise into "spikes".

The state is a dict of arrays inside ``TrainState.guard`` and so is checkpointed with it:

    {"loss_hist": f32[W], "gnorm_hist": f32[W], "good": i32 (good steps ever),
     "skipped": i32 (skipped steps ever), "consecutive": i32 (skipped steps in a row)}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

REL_STD_FLOOR = 1e-3


def init_guard_state(window: int) -> dict[str, jax.Array]:
    return {"loss_hist": jnp.zeros((window,), jnp.float32), "gnorm_hist": jnp.zeros((window,), jnp.float32),
            "good": jnp.zeros((), jnp.int32), "skipped": jnp.zeros((), jnp.int32),
            "consecutive": jnp.zeros((), jnp.int32)}


def window_stats(hist: jax.Array, good: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean and standard deviation (ddof=0) of the filled part of a ring buffer. Entries are
    written at ``good % W``, so the first ``min(good, W)`` slots are exactly the filled ones."""
    n = jnp.minimum(good, hist.shape[0])
    mask = jnp.arange(hist.shape[0]) < n
    count = jnp.maximum(n, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(mask, hist, 0.0)) / count
    var = jnp.sum(jnp.where(mask, jnp.square(hist - mean), 0.0)) / count
    return mean, jnp.sqrt(var)


def spike_threshold(hist: jax.Array, good: jax.Array, sigmas: float) -> jax.Array:
    mean, std = window_stats(hist, good)
    return mean + sigmas * jnp.maximum(std, REL_STD_FLOOR * jnp.abs(mean))


def judge(guard: dict[str, jax.Array], loss: jax.Array, grad_norm: jax.Array, *, sigmas: float,
          warmup: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns (ok, new guard state): ``ok`` is a bool scalar, True when the update may apply."""
    loss = loss.astype(jnp.float32)
    grad_norm = grad_norm.astype(jnp.float32)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if sigmas > 0:  # static: with spikes off the buffer is still kept, so turning them on later works
        spike = ((loss > spike_threshold(guard["loss_hist"], guard["good"], sigmas))
                 | (grad_norm > spike_threshold(guard["gnorm_hist"], guard["good"], sigmas)))
        ok = ok & ~((guard["good"] >= warmup) & spike)
    slot = guard["good"] % guard["loss_hist"].shape[0]

    def record(hist, value):
        return hist.at[slot].set(jnp.where(ok, value, hist[slot]))

    new = {"loss_hist": record(guard["loss_hist"], loss), "gnorm_hist": record(guard["gnorm_hist"], grad_norm),
           "good": guard["good"] + ok.astype(jnp.int32),
           "skipped": guard["skipped"] + (~ok).astype(jnp.int32),
           "consecutive": jnp.where(ok, 0, guard["consecutive"] + 1).astype(jnp.int32)}
    return ok, new


def guard_metrics(guard: dict[str, jax.Array], ok: jax.Array) -> dict[str, jax.Array]:
    return {"skipped": (~ok).astype(jnp.int32), "skipped_steps": guard["skipped"],
            "consecutive_skips": guard["consecutive"]}
