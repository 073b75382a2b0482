"""What compiling a config's train step costs: lowering and compile time, the optimized HLO's
instruction and fusion counts, and which JAX functions the instructions come from.

The step is the trainer's own (``make_train_step`` with the config's mesh, policy, remat and
compiler options), compiled for abstract inputs: no parameters, optimizer state or batch are
allocated, so a full-size config compiles on a laptop CPU as well as on its GPU.

    python benchmarks/compile_cost.py configs/dense-1p3b.yaml configs/precision/nvfp4.yaml \\
        [key=value ...] [--top 12] [--json out.json] [--hlo-out hlo.txt.gz]

Arguments are those of ``python -m maxfp4.train`` (YAML files, then dotted overrides).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import time

import jax
import jax.numpy as jnp

from maxfp4.compiler import compiler_options
from maxfp4.config import Config, add_config_arguments, config_from_arguments
from maxfp4.parallel.mesh import batch_sharding, make_mesh
from maxfp4.optim import make_optimizer, make_schedule
from maxfp4.precision import resolve_policy
from maxfp4.train import jit_train_step, state_maker

# Functions whose instructions are counted under their own name (the innermost one in an
# instruction's op_name wins); everything else is counted under its primitive.
_TRACKED = ("div_rn", "threefry", "round_e2m1", "walsh16", "hadamard16", "quantize_nvfp4",
            "quantize_fp8", "ssd", "attention")


def origin(op_name: str) -> str:
    parts = op_name.split("/")
    for part in reversed(parts):
        for name in _TRACKED:
            if name in part:
                return name
    return parts[-1] if parts else "?"


def hlo_census(hlo_text: str, top: int) -> dict:
    instructions = [line for line in hlo_text.splitlines() if " = " in line and "(" in line]
    by_origin = collections.Counter()
    for line in instructions:
        m = re.search(r'op_name="([^"]*)"', line)
        by_origin[origin(m.group(1)) if m else "<no op_name>"] += 1
    return {
        "instructions": len(instructions),
        "fusions": sum(1 for line in instructions if re.search(r"\bfusion\(", line)),
        "by_origin": dict(by_origin.most_common(top)),
    }


def abstract(shapes, shardings):
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def abstract_step(cfg: Config):
    """(the trainer's jitted step with its compiler options, abstract state, abstract batch, the
    mesh) on this machine's devices: shapes, dtypes and shardings only, nothing allocated."""
    policy = resolve_policy(cfg.precision, cfg.model.n_layers)
    mesh = make_mesh(cfg.mesh, None)
    optimizer = make_optimizer(cfg)
    make, state_sh = state_maker(cfg, mesh, optimizer, policy)
    state = abstract(jax.eval_shape(make, jax.random.key(0)), state_sh)
    b_sh = batch_sharding(mesh)
    bt = (cfg.data.global_batch, cfg.data.seq_len)
    batch = {k: jax.ShapeDtypeStruct(bt, jnp.int32, sharding=b_sh)
             for k in ("inputs", "targets", "positions", "segment_ids")}
    batch["loss_mask"] = jax.ShapeDtypeStruct(bt, jnp.float32, sharding=b_sh)
    options = compiler_options(mesh.devices.flat[0].platform, cfg.train.compiler_options)
    return jit_train_step(cfg, policy, optimizer, make_schedule(cfg), mesh, state_sh, options), state, batch, mesh


def compile_cost(cfg: Config, top: int, hlo_out: str | None = None) -> dict:
    jitted, state, batch, mesh = abstract_step(cfg)
    platform = mesh.devices.flat[0].platform
    t0 = time.perf_counter()
    lowered = jitted.lower(state, batch)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    text = compiled.as_text()
    if hlo_out:
        with gzip.open(hlo_out, "wt") as f:
            f.write(text)
    return {"platform": platform, "devices": int(mesh.devices.size),
            "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
            **hlo_census(text, top)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--top", type=int, default=12, help="origins listed")
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--hlo-out", help="also write the optimized HLO here, gzipped (e.g. hlo.txt.gz)")
    ns = parser.parse_args(argv)
    result = {"args": [ns.config, *ns.overrides], **compile_cost(config_from_arguments(ns), ns.top, ns.hlo_out)}
    print(f"{' '.join(result['args'])} on {result['devices']} {result['platform']} device(s): lower "
          f"{result['lower_s']} s, compile {result['compile_s']} s, {result['instructions']} HLO "
          f"instructions, {result['fusions']} fusions")
    for name, n in result["by_origin"].items():
        print(f"  {n:>8}  {name}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
