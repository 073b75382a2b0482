"""Wall-clock timing of a jitted function for the benchmark scripts beside this file."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_ms(fn, *args, iters: int = 10) -> float:
    """Median milliseconds of ``fn(*args)`` over ``iters`` calls after one warm-up call, each
    waited for on the device (dispatch is asynchronous)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))
