"""Device time per kernel from a ``train.profile_steps`` trace: where a step's time goes.

    python benchmarks/profile_summary.py runs/NAME/profile [--top 40] [--steps 1] [--hlo DUMP_DIR]

Reads the Perfetto trace (``perfetto_trace.json.gz``, newest under the folder) that the profiler
writes next to its XPlane files, sums the duration of every event on the GPU streams by name,
and prints the top kernels and a total per kind (GEMM, attention, Pallas kernels, collectives,
copies, other fusions). ``--steps`` divides the totals to give milliseconds per step. With
``--hlo`` (a folder written by ``XLA_FLAGS=--xla_dump_to=DIR``), each top kernel also gets the
JAX operation and source line that XLA recorded for it, which says what a fusion came from.
With ``--hlo``, the GEMMs are also listed one line per HLO GEMM shape: its operand and result
shapes, contracted dimensions, calls, us a call and TFLOP/s, from the ``hlo_op`` each GPU
kernel event names (which GEMM is slow, where the kernel names alone do not say).
With ``--gaps N``, it also reads each GPU's timeline: how long its compute kernels left it idle
(collectives do not count as compute), and the N longest idle gaps with the kernels on either side
and the collectives in flight, which says which communication the compute waited for.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import pathlib
import re
import sys


def kind_of(name: str) -> str:
    low = name.lower()
    if any(w in low for w in ("gemm", "cublas", "cutlass", "matmul", "xmma", "nvjet")):
        return "GEMM"
    if "flash" in low or "fmha" in low or "cudnn" in low or "attention" in low:
        return "attention"
    if "pallas" in low or "triton" in low and "fusion" not in low:
        return "Pallas/Triton kernels"
    if "nccl" in low or "all-reduce" in low or "all-gather" in low or "reduce-scatter" in low:
        return "collectives"
    if "memcpy" in low or "memset" in low or "copy" in low:
        return "copies"
    if "transpose" in low:
        return "transposes"
    if "reduce" in low:
        return "reductions"
    return "other fusions"


def newest_trace(folder: pathlib.Path) -> pathlib.Path:
    traces = sorted(folder.rglob("perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not traces:
        sys.exit(f"error: no perfetto_trace.json.gz under {folder} (was train.profile_steps set?)")
    return traces[-1]


def _gpu_pids(trace: dict) -> set:
    """The trace's processes that are GPU devices."""
    return {e["pid"] for e in trace["traceEvents"]
            if e.get("ph") == "M" and e.get("name") == "process_name"
            and "gpu" in str(e.get("args", {}).get("name", "")).lower()}


def gpu_kernel_times(trace: dict) -> tuple[collections.Counter, collections.Counter]:
    """Total microseconds and launch count per event name over the processes that are GPU
    devices. XLA reuses one compiled kernel for identical fusions, so a name can stand for many
    launches a step (one per block, say): the count tells one big kernel from many small ones."""
    gpu_pids = _gpu_pids(trace)
    totals: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            totals[e["name"]] += float(e.get("dur", 0.0))
            counts[e["name"]] += 1
    return totals, counts


def _gpu_events(trace: dict) -> dict[int, list[tuple[float, float, str]]]:
    """(start us, end us, name) of every kernel, per GPU process, in start order."""
    gpu_pids = _gpu_pids(trace)
    events: dict[int, list] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("pid") in gpu_pids:
            start = float(e["ts"])
            events[e["pid"]].append((start, start + float(e.get("dur", 0.0)), e["name"]))
    return {pid: sorted(evs) for pid, evs in events.items()}


def idle_gaps(events: list[tuple[float, float, str]], min_us: float = 20.0):
    """Where one GPU ran no compute kernel: (busy us, span us, gaps), each gap (start, length,
    kernel before, kernel after, collectives overlapping it). Collectives run on their own
    stream and are not compute: a gap they overlap is communication the compute waited for."""
    compute = [e for e in events if kind_of(e[2]) != "collectives"]
    collectives = [e for e in events if kind_of(e[2]) == "collectives"]
    busy, gaps = 0.0, []
    end, before = compute[0][0], ""
    for start, stop, name in compute:
        if start - end >= min_us:
            during = sorted({c[2][:40] for c in collectives if c[0] < start and c[1] > end})
            gaps.append((end, start - end, before, name, during))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, before = stop, name
    return busy, end - compute[0][0], gaps


def print_gaps(trace: dict, top: int, steps: int) -> None:
    for pid, events in sorted(_gpu_events(trace).items()):
        busy, span, gaps = idle_gaps(events)
        idle = span - busy
        print(f"\nGPU process {pid}: compute busy {busy / 1e3 / steps:.1f} ms/step, idle "
              f"{idle / 1e3 / steps:.1f} ms/step ({len(gaps)} gaps of 20 us or more; the gap "
              f"between the traced steps counts too)")
        print(f"{'at ms':>9}{'gap us':>10}  last kernel before -> first after; collectives in flight")
        t0 = events[0][0]
        for at, length, before, after, during in sorted(gaps, key=lambda g: -g[1])[:top]:
            print(f"{(at - t0) / 1e3:>9.2f}{length:>10.0f}  {before[:40]} -> {after[:40]}; "
                  f"{', '.join(during) or '-'}")


def traced_kernel_times(calls, reps: int) -> tuple[collections.Counter, collections.Counter]:
    """``gpu_kernel_times`` of ``reps`` runs of each of ``calls`` (zero-argument functions, each
    run once untraced first, so compiling stays out of the trace), traced here: what a probe or
    benchmark uses to time its own kernels without dispatch overhead."""
    import tempfile

    import jax  # here, so reading a trace file needs no JAX

    for call in calls:
        jax.block_until_ready(call())
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        for call in calls:
            for _ in range(reps):
                out = call()
            jax.block_until_ready(out)
        jax.profiler.stop_trace()
        with gzip.open(newest_trace(pathlib.Path(folder))) as fh:
            return gpu_kernel_times(json.load(fh))


_HLO_LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) .*?metadata=\{([^}]*)\}")


def step_hlo(dump: pathlib.Path) -> str:
    """The largest optimized HLO module in an XLA dump (the train step), as text."""
    modules = sorted(dump.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
    if not modules:
        sys.exit(f"error: no *after_optimizations.txt under {dump} (XLA_FLAGS=--xla_dump_to=DIR)")
    return modules[-1].read_text(encoding="utf-8", errors="replace")


def hlo_origins(hlo_text: str) -> dict[str, str]:
    """Kernel name -> 'result shape, JAX op_name' from the step's HLO text (``step_hlo``).
    Kernel names are HLO instruction names with '.' written as '_'."""
    origins: dict[str, str] = {}
    for line in hlo_text.splitlines():
        m = _HLO_LINE.match(line)
        if m:
            op = re.search(r'op_name="([^"]*)"', m.group(3))
            origins[m.group(1).replace(".", "_")] = f"{m.group(2)[:50]} {op.group(1)[-90:] if op else '?'}"
    return origins


_HLO_ARRAY = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = [a-z0-9]+\[([0-9,]*)\]")
_GEMM_CALL = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = \(([a-z0-9]+)\[([0-9,]*)\][^)]*\) custom-call\(%?([\w.\-#]+), "
                        r"%?([\w.\-#]+).*custom_call_target=\"__cublas")


def hlo_gemms(dump_text: str) -> dict[str, tuple[str, float]]:
    """HLO GEMM instruction name (as a kernel event's ``hlo_op`` names it) -> (signature, FLOPs)
    from an optimized HLO module: the signature names the result, the two operands' shapes and
    the contracted dimensions, and the op_name's last part; FLOPs are 2 x result elements x
    contracted size (0 where an operand's shape is not an array in the text)."""
    shapes = {m.group(1): [int(d) for d in m.group(2).split(",") if d]
              for m in map(_HLO_ARRAY.match, dump_text.splitlines()) if m}
    gemms = {}
    for line in dump_text.splitlines():
        m = _GEMM_CALL.match(line)
        if not m:
            continue
        name, dtype, dims, lhs, rhs = m.groups()
        out = [int(d) for d in dims.split(",") if d]
        contract = re.search(r'"lhs_contracting_dimensions":\["?([0-9"]*)', line)
        lhs_shape, rhs_shape = shapes.get(lhs), shapes.get(rhs)
        k = lhs_shape[int(contract.group(1).strip('"'))] if lhs_shape and contract and contract.group(1) else 0
        op = re.search(r'op_name="([^"]*)"', line)
        where = op.group(1).split("/")[-2] if op and "/" in op.group(1) else "?"
        signature = f"{dtype}{out} = {lhs_shape} . {rhs_shape} over {k} ({where})"
        gemms[name] = (signature, 2.0 * math.prod(out) * k)
    return gemms


def print_gemm_rates(trace: dict, hlo_text: str, steps: int) -> None:
    """One line per GEMM signature: calls a step, us a call, TFLOP/s, the kernel most used."""
    gemms = hlo_gemms(hlo_text)
    gpu_pids = _gpu_pids(trace)
    us: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    flops: collections.Counter = collections.Counter()
    kernels: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unmatched: collections.Counter = collections.Counter()
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or e.get("pid") not in gpu_pids or kind_of(e["name"]) != "GEMM":
            continue
        op = str(e.get("args", {}).get("hlo_op", ""))
        if op not in gemms:
            unmatched[op] += float(e.get("dur", 0.0))
            continue
        signature, f = gemms[op]
        us[signature] += float(e.get("dur", 0.0))
        calls[signature] += 1
        flops[signature] += f
        kernels[signature][e["name"][:36]] += 1
    if not us:
        print("\n(no GEMM events name an HLO GEMM of the dump: per-GEMM rates not shown)")
        return
    print(f"\n{'GEMM (result = lhs . rhs over K)':<92}{'calls/step':>11}{'us/call':>9}{'TFLOP/s':>9}  kernel")
    for signature, t in us.most_common():
        print(f"{signature[:91]:<92}{calls[signature] / steps:>11g}{t / calls[signature]:>9.1f}"
              f"{flops[signature] / t / 1e6:>9.0f}  {kernels[signature].most_common(1)[0][0]}")
    if unmatched:
        # GEMM kernels whose hlo_op is no cuBLAS call of the dump (a fusion's GEMM, a name the
        # runtime gave): their time, so the table's coverage is visible.
        names = ", ".join(f"{op or '(none)'} {t / steps / 1e3:.1f} ms" for op, t in unmatched.most_common(6))
        print(f"GEMM time not in the table: {sum(unmatched.values()) / steps / 1e3:.1f} ms/step ({names})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=pathlib.Path)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--steps", type=int, default=1, help="steps in the trace (per-step times)")
    ap.add_argument("--hlo", type=pathlib.Path, help="an XLA dump folder (--xla_dump_to) for origins")
    ap.add_argument("--gaps", type=int, default=0, help="print the N longest idle gaps per GPU")
    a = ap.parse_args()
    path = newest_trace(a.folder)
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        trace = json.load(fh)
    totals, counts = gpu_kernel_times(trace)
    if not totals:
        sys.exit(f"error: {path} holds no GPU events")
    all_ms = sum(totals.values()) / 1e3 / a.steps
    print(f"{path}: {all_ms:.1f} ms of GPU time per step over {len(totals)} kernels")
    kinds: collections.Counter = collections.Counter()
    for name, us in totals.items():
        kinds[kind_of(name)] += us
    print(f"\n{'kind':<24}{'ms/step':>10}{'share':>8}")
    for kind, us in kinds.most_common():
        print(f"{kind:<24}{us / 1e3 / a.steps:>10.2f}{us / 1e3 / a.steps / all_ms:>8.1%}")
    print(f"\n{'kernel':<64}{'calls/step':>11}{'us/call':>9}{'ms/step':>10}{'share':>8}")
    hlo_text = step_hlo(a.hlo) if a.hlo else ""
    origins = hlo_origins(hlo_text)
    for name, us in totals.most_common(a.top):
        calls = counts[name] / a.steps
        print(f"{name[:63]:<64}{calls:>11g}{us / counts[name]:>9.1f}"
              f"{us / 1e3 / a.steps:>10.2f}{us / 1e3 / a.steps / all_ms:>8.1%}")
        if name in origins:
            print(f"    from {origins[name]}")
    if a.hlo:
        print_gemm_rates(trace, hlo_text, a.steps)
    if a.gaps:
        print_gaps(trace, a.gaps, a.steps)


if __name__ == "__main__":
    main()
