"""XLA's buffer assignment for the train step of each measured row of
benchmarks/plan_calibration.py, beside the planner's memory terms: compiles, runs nothing.

    python benchmarks/memory_breakdown.py [--rows SUBSTRING] [--json OUT.json]
    python benchmarks/memory_breakdown.py --config configs/quickstart.yaml --set data.global_batch=4

Per device: arguments (the state and the batch), outputs, what donation aliases, temporaries
(gradients, activations, logits, working copies, collectives' buffers) and the sum, which is what
the step needs at its peak as XLA planned it; then the planner's terms and the measured peak.
Only the rows whose GPU count this machine has are compiled; a precision column runs its recipe
everywhere (the NVFP4 preset's BF16 ends are not applied). For the buffers live at XLA's
peak, add XLA_FLAGS=--xla_dump_to=DIR: each module's *buffer-assignment.txt lists them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from maxfp4.config import load_config  # noqa: E402
from maxfp4.optim import make_optimizer, make_schedule  # noqa: E402
from maxfp4.parallel.mesh import make_mesh, resolve_mesh_shape  # noqa: E402
from maxfp4.plan import cost  # noqa: E402
from maxfp4.plan.stages import PlanMesh  # noqa: E402
from maxfp4.precision import resolve_policy  # noqa: E402
from maxfp4.train import jit_train_step, state_maker  # noqa: E402
from maxfp4.compiler import compiler_options  # noqa: E402
from maxfp4.plan.rates import PLAN_RECIPES  # noqa: E402


def xla_bytes(cfg, devices) -> dict[str, float]:
    """Per-device bytes of the compiled step: arguments, outputs, aliased, temporaries, total."""
    mesh = make_mesh(cfg.mesh, devices)
    optimizer = make_optimizer(cfg)
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    make, state_sh = state_maker(cfg, mesh, optimizer, policy)
    state = jax.eval_shape(make, jax.random.key(0))
    b, t = cfg.data.global_batch, cfg.data.seq_len
    batch = {k: jax.ShapeDtypeStruct((b, t), jnp.float32 if k == "loss_mask" else jnp.int32)
             for k in ("inputs", "targets", "segment_ids", "positions", "loss_mask")}
    step = jit_train_step(cfg, policy, optimizer, make_schedule(cfg), mesh, state_sh,
                          compiler_options(devices[0].platform, cfg.train.compiler_options, cfg.run.deterministic))
    m = step.lower(state, batch).compile().memory_analysis()
    out = {"arguments": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
           "aliased": m.alias_size_in_bytes, "temporaries": m.temp_size_in_bytes}
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out


def breakdown(label, path, overrides, gpus, gpu, precision, peak_gib) -> dict:
    cfg = load_config(path, [*overrides, f"precision.default={PLAN_RECIPES[precision]}", "resilience.preflight=false"])
    plan_mesh = PlanMesh.of(resolve_mesh_shape(cfg.mesh, gpus), cfg.mesh)
    planned = cost.memory_per_device(cfg, plan_mesh, cost.param_count(cfg.model), precision, cfg.train.remat)
    return {"run": label, "gpu": gpu, "precision": precision, "xla_gb": {k: v / 1e9 for k, v in xla_bytes(cfg, jax.devices()[:gpus]).items()},
            "planner_gb": {k: v / 1e9 for k, v in planned.items()} | {"total": sum(planned.values()) / 1e9},
            "measured_peak_gb": peak_gib * 2**30 / 1e9 if peak_gib else None}


def format_row(r: dict) -> str:
    x, p = r["xla_gb"], r["planner_gb"]
    peak = f"{r['measured_peak_gb']:.1f}" if r["measured_peak_gb"] else "-"
    terms = " ".join(f"{k} {v:.2f}" for k, v in p.items() if k != "total")
    return (f"{r['run']} ({r['gpu']}, {r['precision']}): measured {peak} GB | XLA {x['total']:.2f} = args "
            f"{x['arguments']:.2f} + out {x['outputs']:.2f} - aliased {x['aliased']:.2f} + temp "
            f"{x['temporaries']:.2f} | planner {p['total']:.1f} ({terms})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="only the rows whose label contains this")
    parser.add_argument("--config", help="one config instead of the calibration's rows")
    parser.add_argument("--set", nargs="*", default=[], help="overrides of --config")
    parser.add_argument("--precision", default="bf16", choices=sorted(PLAN_RECIPES))
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    if args.config:
        rows = [(args.config, args.config, args.set, 1, "this device", args.precision, None)]
    else:
        import plan_calibration
        rows = [(label, path, ov, gpus, gpu, precision, peak)
                for label, path, ov, gpus, gpu, precision, _, peak, stale in plan_calibration.MEASURED
                if not stale and args.rows in label and gpus <= len(jax.devices())]
    out = []
    for row in rows:
        r = breakdown(*row)
        print(format_row(r), flush=True)
        out.append(r)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
