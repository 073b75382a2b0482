"""The non-finite and spike guard, evaluated inside the jitted train step (no host sync).

A step is *bad* when its loss or gradient norm is non-finite, or, once ``spike_warmup`` finite
steps have been seen, when its loss is a spike:

    loss > (1 + spike_margin) x median of the last spike_window finite losses

A bad step's update is not applied: the caller keeps the old parameters, optimizer state and
precision state, while the step counter (and so the learning-rate schedule and the data) moves
on, exactly as if the batch had been dropped from the dataset. Whether a bad step was the model's
or a device's doing, a re-run of it tells (``resilience.rerun_skipped``, maxfp4.reliability.rerun).

Why this rule (the measurements are in docs/RELIABILITY.md):
- A spike is transient. Every finite loss enters the window, the skipped ones too, so a value that
  persists becomes the new normal: after a lasting upward level shift of any size, at most
  ``level_shift_bound(W) = W // 2 + 1`` steps are skipped (the median moves once more than half the
  window holds the new level), which validation keeps below ``max_consecutive_skips``, so a level
  shift never triggers a rollback. An earlier rule let only good steps into a mean + 6 sigma
  window and judged a lasting rise a spike for ever.
- The median ignores the few spikes inside the window, where a mean would be pulled up by them.
- A relative margin alone: on healthy GPU runs single batches reach 1.58 x the median and 7.3
  robust standard deviations (1.4826 x MAD) above it, while the MAD reaches 0.29 x the median, so
  a band in standard deviations wide enough for healthy steps would hide a tripled loss.
- The gradient norm is left to clipping (``optim.clip``) unless it is non-finite: healthy steps'
  norms jump 4x from one step to the next, they rise through training, and a large finite norm is
  harmless once clipped.

The state is a dict of arrays inside ``TrainState.guard`` and so is checkpointed with it:

    {"loss_hist": f32[W] (ring buffer of finite losses, written at seen % W),
     "seen": i32 (finite steps ever), "skipped": i32 (skipped steps ever),
     "consecutive": i32 (skipped steps in a row), "streak_nonfinite": i32 (non-finite ones among
     them), "suspend": i32 (steps left with spike judgement suspended, set by the host)}
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def level_shift_bound(window: int) -> int:
    """Most steps skipped after a lasting upward level shift: the n-th shifted loss is judged
    against a window holding n - 1 of them, whose median is a shifted value once n - 1 > W / 2."""
    return window // 2 + 1


def init_guard_state(window: int) -> dict[str, jax.Array]:
    zero = jnp.zeros((), jnp.int32)
    return {"loss_hist": jnp.zeros((window,), jnp.float32), "seen": zero, "skipped": zero,
            "consecutive": zero, "streak_nonfinite": zero, "suspend": zero}


def window_median(hist: jax.Array, seen: jax.Array) -> jax.Array:
    """Median of the filled part of the ring buffer, its first ``n = min(seen, W)`` slots (the
    mean of the two middle values for even n, as NumPy's)."""
    n = jnp.clip(seen, 1, hist.shape[0])
    sorted_W = jnp.sort(jnp.where(jnp.arange(hist.shape[0]) < n, hist, jnp.inf))
    return 0.5 * (sorted_W[(n - 1) // 2] + sorted_W[n // 2])


def spike_threshold(hist: jax.Array, seen: jax.Array, margin: float) -> jax.Array:
    median = window_median(hist, seen)
    return median + margin * jnp.abs(median)


def judge(guard: dict[str, jax.Array], loss: jax.Array, grad_norm: jax.Array, *, margin: float,
          warmup: int) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns (ok, new guard state): ``ok`` is a bool scalar, True when the update may apply."""
    loss = loss.astype(jnp.float32)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    ok = finite
    if margin > 0:  # static: with spikes off the window is still kept, so turning them on later works
        judged = (guard["seen"] >= warmup) & (guard["suspend"] == 0)
        ok = ok & ~(judged & (loss > spike_threshold(guard["loss_hist"], guard["seen"], margin)))
    hist = guard["loss_hist"]
    slot = guard["seen"] % hist.shape[0]
    not_ok = (~ok).astype(jnp.int32)
    new = {"loss_hist": hist.at[slot].set(jnp.where(finite, loss, hist[slot])),
           "seen": guard["seen"] + finite.astype(jnp.int32),
           "skipped": guard["skipped"] + not_ok,
           "consecutive": (guard["consecutive"] + 1) * not_ok,
           "streak_nonfinite": (guard["streak_nonfinite"] + (~finite).astype(jnp.int32)) * not_ok,
           "suspend": jnp.maximum(guard["suspend"] - 1, 0)}
    return ok, new


def guard_metrics(guard: dict[str, jax.Array], ok: jax.Array) -> dict[str, jax.Array]:
    return {"skipped": (~ok).astype(jnp.int32), "skipped_steps": guard["skipped"],
            "consecutive_skips": guard["consecutive"], "streak_nonfinite": guard["streak_nonfinite"]}
