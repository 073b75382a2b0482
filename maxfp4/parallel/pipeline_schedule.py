"""The pipeline's schedule, without JAX: its ticks and bubble, the table of which microbatch and
which repeat each device runs at each tick, and where each device's stages come from in the
stacked blocks. The trainer runs the table (:mod:`maxfp4.parallel.pipeline`); the planner prices
its ticks and bubble (:mod:`maxfp4.plan.cost`).

Circular schedule (MaxText's "circular pipeline"; the forward order of Megatron's interleaved one): the
block stack is cut into S = P x V stages (P = ``mesh.pipeline`` devices, V =
``mesh.pipeline_repeats``), stage s on device s mod P, so each device holds V stages that are
P stages apart and a microbatch goes round the devices V times. The microbatches go in groups
of P: device 0 runs group g's P microbatches through its first stage, then (as they come back
from device P - 1) through its second, ..., then starts group g + 1; device p runs the same
order p ticks later. With M a multiple of P every device is busy for V x M of the
V x M + P - 1 ticks of a pass, so the bubble fraction is (P - 1) / (V x M + P - 1), each tick
being a 1 / V of a GPipe stage. V = 1 is GPipe's schedule: (P - 1) / (M + P - 1). Autodiff runs
the ticks backwards, so the backward pass has the same table reversed and the same bubble.

Overlapped hand-overs (``mesh.pipeline_overlap``, lag L = 2): a stage's output goes to the next
device during the tick after the one that made it, while that tick computes, and is read a tick
later still; every hand-over takes L ticks instead of one. Device p runs the same order L x p
ticks after device 0, groups hold L x P microbatches (so the first is back at device 0 as the
last leaves it), and a pass takes V x M + L (P - 1) ticks: bubble L (P - 1) / (V x M + L (P - 1)).
The overlap pays where a hand-over's time exceeds the bubble's growth (MaxText's "delay
activation forwarding"; Megatron overlaps its sends with the next microbatch the same way).

Dimension letters: T ticks, P devices on the pipeline axis, V repeats, K chunks a device sends
another; L the hand-over lag in ticks (1, or 2 overlapped).
"""

from __future__ import annotations

import numpy as np

IDLE = -1


def handover_lag(overlap: bool) -> int:
    """Ticks from a stage computing a microbatch to the next stage computing it (``L``)."""
    return 2 if overlap else 1


def ticks(stages: int, microbatches: int, repeats: int = 1, lag: int = 1) -> int:
    """Ticks of a pass: V x M + L (P - 1) (each device works V x M of them)."""
    return repeats * microbatches + lag * (stages - 1)


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1, lag: int = 1) -> float:
    """The share of a pass each device idles: L (P - 1) / (V x M + L (P - 1)) (V = 1: GPipe's)."""
    return lag * (stages - 1) / ticks(stages, microbatches, repeats, lag)


def group_size(stages: int, repeats: int, lag: int = 1) -> int:
    """Microbatches that go round the devices together when V > 1: L x P, so that the first is
    back at device 0 just as the last leaves it (1 for GPipe: any count works)."""
    return lag * stages if repeats > 1 else 1


def device_order(stages: int, repeats: int, microbatches: int, lag: int = 1) -> list[tuple[int, int]]:
    """(microbatch, repeat) in the order every device runs them: groups of L x P microbatches,
    each group through all V repeats before the next starts."""
    group = group_size(stages, repeats, lag)
    if microbatches % group:
        raise ValueError(f"{microbatches} microbatches do not make groups of {group} for {repeats} repeats")
    return [(g + j, v) for g in range(0, microbatches, group) for v in range(repeats)
            for j in range(min(group, microbatches - g))]


def schedule_table(stages: int, repeats: int, microbatches: int, lag: int = 1) -> np.ndarray:
    """[T, P, 2] int32: (microbatch, repeat) device p runs at tick t, (IDLE, IDLE) when idle.
    The pipelined loss reads this table; the bubble is its share of idle entries."""
    order = device_order(stages, repeats, microbatches, lag)
    table_TP2 = np.full((ticks(stages, microbatches, repeats, lag), stages, 2), IDLE, np.int32)
    for p in range(stages):
        table_TP2[lag * p:lag * p + len(order), p] = order
    return table_TP2


def idle_fraction(table_TP2: np.ndarray) -> float:
    """The share of (tick, device) slots of a schedule table that run nothing."""
    return float(np.mean(table_TP2[..., 0] == IDLE))


def dependency_errors(table_TP2: np.ndarray, repeats: int, lag: int = 1) -> list[str]:
    """Every slot whose input was not produced by the slot L ticks earlier on the device before
    it (a hand-over is one ``ppermute`` round the ring, L ticks from send to use); empty for a
    runnable table."""
    ticks, stages, _ = table_TP2.shape
    errors = []
    for t in range(ticks):
        for p in range(stages):
            mb, v = table_TP2[t, p]
            if mb == IDLE or (p == 0 and v == 0):
                continue
            want = (mb, v) if p > 0 else (mb, v - 1)
            if t < lag or tuple(table_TP2[t - lag, (p - 1) % stages]) != want:
                errors.append(f"tick {t} device {p}: microbatch {mb} repeat {v} has no input")
    return errors


def circular_chunks(stages: int, repeats: int) -> tuple[np.ndarray, np.ndarray, int]:
    """How each device's V stages reach it from the stacked blocks, stored P contiguous parts
    over the pipeline axis (the checkpoint's order; device p holds chunks p x V ... p x V + V - 1
    of the P x V stages). Stage c belongs to device c mod P, as its (c // P)-th stage.

    Returns ``send_PPK`` (device p's local chunk it sends device d, as the k-th of K; padded with
    0, never read), ``recv_PV`` (where device p finds its v-th stage in what an all-to-all hands
    it, [source device x K + k] flattened) and K."""
    p_, v_ = stages, repeats
    sends = [[[u for u in range(v_) if (p * v_ + u) % p_ == d] for d in range(p_)] for p in range(p_)]
    k = max(1, max(len(s) for row in sends for s in row))
    send_PPK = np.zeros((p_, p_, k), np.int32)
    for p in range(p_):
        for d in range(p_):
            send_PPK[p, d, :len(sends[p][d])] = sends[p][d]
    recv_PV = np.zeros((p_, v_), np.int32)
    for p in range(p_):
        for v in range(v_):
            chunk = v * p_ + p
            src, u = divmod(chunk, v_)
            recv_PV[p, v] = src * k + sends[src][p].index(u)
    return send_PPK, recv_PV, k



def exchange_tables(rows: int, stages: int, wanted_PR: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """How each device gathers the rows ``wanted_PR[p]`` (-1: a slot it never reads) of a stack of
    ``rows`` stored as P contiguous parts over the pipeline axis, in one all-to-all: the general
    form of :func:`circular_chunks`, for stages that are not whole chunks of the stack.

    Returns ``send_PPK`` (device q's local rows it sends device d, as the k-th of K; padded with
    0, never read), ``recv_PR`` (where device p finds its r-th row in what the all-to-all hands
    it, [source device x K + k] flattened; 0 for a -1) and K."""
    part = rows // stages
    sends = [[sorted({int(r) % part for r in wanted_PR[d] if r >= 0 and r // part == q}) for d in range(stages)]
             for q in range(stages)]
    k = max(1, max(len(s) for row in sends for s in row))
    send_PPK = np.zeros((stages, stages, k), np.int32)
    for q in range(stages):
        for d in range(stages):
            send_PPK[q, d, :len(sends[q][d])] = sends[q][d]
    recv_PR = np.zeros(wanted_PR.shape, np.int32)
    for p in range(stages):
        for j, r in enumerate(wanted_PR[p]):
            if r >= 0:
                src = int(r) // part
                recv_PR[p, j] = src * k + sends[src][p].index(int(r) % part)
    return send_PPK, recv_PR, k
