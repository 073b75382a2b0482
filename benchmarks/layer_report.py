"""What the one-layer kernel benchmarks (conv_layer.py, norm_layer.py) share: their arguments, and
the report of a layer's calls timed alone: the table of milliseconds against the memory floor
(the bytes a call must move at the GPU's bandwidth), how many of the Mosaic forward's outputs
equal the Triton one's, each call's GPU kernels from a profiler trace (``--kernels``), and the
JSON."""

from __future__ import annotations

import argparse
import json

import jax

from profile_summary import traced_kernel_times
from timing import median_ms

HBM_BYTES_PER_S = 4.8e12  # H200


def layer_arguments(doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--config", default="configs/mamba2-1p3b.yaml")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--json")
    parser.add_argument("--kernels", action="store_true", help="each call's GPU kernels, from a trace")
    return parser.parse_args()


def report(title: str, calls: dict, same: float, diff: float, args: argparse.Namespace) -> None:
    """``calls``: name -> (jitted function, its arguments, bytes it must move)."""
    rows = [(name, median_ms(fn, *fn_args, iters=args.iters), nbytes) for name, (fn, fn_args, nbytes) in calls.items()]
    print(f"{title}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print(f"{'call':34} {'ms':>8} {'floor ms':>9}")
    for name, ms, nbytes in rows:
        print(f"{name:34} {ms:8.3f} {1e3 * nbytes / HBM_BYTES_PER_S:9.3f}")
    print(f"Mosaic forward against Triton: {same:.4%} of outputs identical, largest difference {diff:.1e} "
          "of the largest output")
    if args.kernels:
        for name, (fn, fn_args, _) in calls.items():
            totals, counts = traced_kernel_times([lambda fn=fn, fn_args=fn_args: fn(*fn_args)], 10)
            print(f"{name}: {sum(totals.values()) / 10:.1f} us of kernels a call")
            for kernel, us in totals.most_common(5):
                print(f"  {us / 10:8.1f} us  {counts[kernel] // 10} x {kernel[:90]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "identical": same, "max_rel_diff": diff}, f)
