"""Compare the jitted train step's StableHLO between two source trees (a refactor must not change
the compiled program).

For each case (tiny dense and hybrid models; scanned and unrolled blocks; bf16, fp8_delayed and
nvfp4; remat none and save_gemm; one device and a 2 x 2 fsdp x tensor mesh; the Mamba-2 Pallas
kernels) each tree's ``maxfp4.train`` builds the state shapes and the step exactly as the
trainer does (``state_maker``, ``jit_train_step``) and lowers it, in a child process with that
tree first on ``PYTHONPATH`` (on CPU with 4 virtual devices unless ``--platform`` says
otherwise; a case needing more devices than there are is skipped). The texts are compared
after dropping location metadata and renaming SSA values and symbols in order of appearance;
where they differ, the count of each op kind is compared too.

    mkdir -p /tmp/old && git archive OLD_COMMIT | tar -x -C /tmp/old
    python benchmarks/hlo_compare.py /tmp/old . [--only hybrid] [--platform cuda] [--json out.json] [--keep DIR]

Exit code 0 when every case is identical (or has the same op counts), 1 otherwise.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

TINY = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=128",
        "model.vocab_size=256", "data.seq_len=32", "data.global_batch=8", "data.source=synthetic"]
HYBRID = ["model.kind=hybrid", "model.pattern=M*-M-M", "model.mlp=relu2", "model.mamba.d_state=16",
          "model.mamba.head_dim=8", "model.mamba.chunk_size=16"]
RECIPES = {
    "bf16": ["precision.default=bf16"],
    "fp8_delayed": ["precision.default=fp8_delayed", "precision.rules=[{classes: [lm_head], recipe: bf16}]"],
    # The first and last blocks in BF16: three scan groups, as the NVFP4 preset makes.
    "nvfp4": ["precision.default=nvfp4", "precision.rules=[{classes: [lm_head], recipe: bf16}, "
              "{layers: ':1', recipe: bf16}, {layers: '-1:', recipe: bf16}]"],
}


def cases(only: str = "") -> dict[str, list[str]]:
    """The cases whose names contain ``only``."""
    out = {}
    for family, model in (("dense", []), ("hybrid", HYBRID)):
        for recipe, prec in RECIPES.items():
            for scan in ("true", "false"):
                for remat in ("none", "save_gemm"):
                    name = f"{family}-{recipe}-scan_{scan}-remat_{remat}"
                    out[name] = TINY + model + prec + [f"train.scan_layers={scan}", f"train.remat={remat}"]
        out[f"{family}-fp8_delayed-mesh_fsdp2_tensor2"] = (
            TINY + model + RECIPES["fp8_delayed"] + ["train.remat=save_gemm", "mesh.data=1", "mesh.fsdp=2",
                                                     "mesh.tensor=2"])
    # The Mamba-2 kernels (Pallas; interpret mode off GPU), and with FP8 the mixer fused with them.
    for recipe in ("bf16", "fp8_delayed"):
        out[f"hybrid-{recipe}-pallas_mixer-remat_save_gemm"] = (
            TINY + HYBRID + RECIPES[recipe] + ["model.mamba.kernels=pallas", "model.mamba.head_dim=16",
                                              "train.remat=save_gemm"])
    return {name: overrides for name, overrides in out.items() if only in name}


def lower_all(out_dir: str, only: str) -> None:
    """Child: lower every case with the ``maxfp4`` found on sys.path; one .mlir file per case."""
    import jax

    from maxfp4.config import load_config
    from maxfp4.parallel.mesh import batch_sharding, make_mesh
    from maxfp4.optim import make_optimizer, make_schedule
    from maxfp4.precision import resolve_policy
    from maxfp4.train import jit_train_step, state_maker

    for name, overrides in cases(only).items():
        cfg = load_config(None, overrides)
        n = cfg.mesh.fsdp * cfg.mesh.tensor
        if n > jax.device_count():
            print(f"{name}: skipped, {n} devices needed")
            continue
        mesh = make_mesh(cfg.mesh, jax.devices()[:n])
        policy = resolve_policy(cfg.precision, cfg.model.n_layers)
        optimizer = make_optimizer(cfg)
        make, state_sh = state_maker(cfg, mesh, optimizer, policy)
        state = jax.eval_shape(make, jax.random.key(cfg.run.seed))
        state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), state, state_sh)
        b, t = cfg.data.global_batch, cfg.data.seq_len
        b_sh = batch_sharding(mesh)
        batch = {k: jax.ShapeDtypeStruct((b, t), "int32", sharding=b_sh)
                 for k in ("inputs", "targets", "positions", "segment_ids")}
        batch["loss_mask"] = jax.ShapeDtypeStruct((b, t), "float32", sharding=b_sh)
        step = jit_train_step(cfg, policy, optimizer, make_schedule(cfg), mesh, state_sh, {}, runs_per_row=None)
        text = step.lower(state, batch).as_text()
        with open(os.path.join(out_dir, name + ".mlir"), "w") as f:
            f.write(text)


_LOC = re.compile(r"\s*loc\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)")
_UNIT_AXIS = re.compile(r'"\w+"=1, |, "\w+"=1(?=\])')  # in sdy.mesh <["data"=1, ...]>
_UNIT_AXIS_ENTRY = re.compile(r'\{name = "\w+", size = 1 : i64\}, |, \{name = "\w+", size = 1 : i64\}(?=\])')
_VALUE = re.compile(r"%[\w.#$-]+")
_SYMBOL = re.compile(r"@[\w.$-]+")


def normalize(text: str) -> str:
    """Drop location metadata and the mesh's axes of size 1 (a new mesh axis left at 1 changes
    no sharding); name SSA values and symbols by their order of first appearance."""
    lines = [ln for ln in text.splitlines() if not ln.startswith("#loc")]
    text = _LOC.sub("", "\n".join(lines))
    text = _UNIT_AXIS.sub("", _UNIT_AXIS_ENTRY.sub("", text))
    for pattern, prefix in ((_VALUE, "%v"), (_SYMBOL, "@f")):
        names: dict[str, str] = {}
        text = pattern.sub(lambda m: names.setdefault(m.group(0), f"{prefix}{len(names)}"), text)
    return text


_OP = re.compile(r"(?:^|=\s*|\s)\"?((?:stablehlo|chlo|mhlo|sdy|func|tensor|shard_map)\.[a-z_]+)\"?[\s(<{]")


def op_counts(text: str) -> collections.Counter:
    return collections.Counter(m.group(1) for line in text.splitlines() for m in [_OP.search(line)] if m)


def lower_tree(tree: str, out_dir: str, only: str, platform: str) -> None:
    # One hash seed for both trees: code that iterates over a set of strings traces in an order
    # that depends on it.
    # The tree goes first on the path; what was there (packages installed beside the image's) stays.
    path = os.pathsep.join([os.path.abspath(tree)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS=platform, PYTHONHASHSEED="0")
    if platform == "cpu":
        flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
        env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", out_dir, "--only", only], env=env, check=True,
                   cwd=os.path.abspath(tree))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("old", help="the old source tree (or, with --child, the output folder)")
    parser.add_argument("new", nargs="?", help="the new source tree")
    parser.add_argument("--json", help="write the per-case results here")
    parser.add_argument("--keep", help="keep the lowered texts under this folder")
    parser.add_argument("--only", default="", help="only the cases whose names contain this")
    parser.add_argument("--platform", default="cpu", help="lower for this JAX platform (cuda: the GPU paths)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        lower_all(args.old, args.only)
        return 0
    root = args.keep or tempfile.mkdtemp(prefix="hlo-compare-")
    dirs = {side: os.path.join(root, side) for side in ("old", "new")}
    for side, tree in (("old", args.old), ("new", args.new)):
        os.makedirs(dirs[side], exist_ok=True)
        lower_tree(tree, dirs[side], args.only, args.platform)
    results, ok = [], True
    print(f"{'case':<44}{'identical':>10}{'same ops':>10}{'ops':>7}  differences")
    for name in cases(args.only):
        if not all(os.path.exists(os.path.join(dirs[s], name + ".mlir")) for s in ("old", "new")):
            continue
        old, new = (normalize(open(os.path.join(dirs[s], name + ".mlir")).read()) for s in ("old", "new"))
        same = old == new
        counts_old, counts_new = op_counts(old), op_counts(new)
        diff = {op: counts_new[op] - counts_old[op] for op in counts_old | counts_new
                if counts_new[op] != counts_old[op]}
        ok &= same or not diff
        results.append({"case": name, "identical": same, "same_op_counts": not diff, "ops": sum(counts_new.values()),
                        "op_count_differences": diff})
        print(f"{name:<44}{str(same):>10}{str(not diff):>10}{sum(counts_new.values()):>7}  {diff or ''}")
        if not same:  # where they part, to say what changed when the op counts agree
            at = next(i for i, (a, b) in enumerate(zip(old.splitlines() + [""], new.splitlines() + [""])) if a != b)
            for side, text in (("old", old), ("new", new)):
                print(f"    {side} line {at + 1}: {(text.splitlines() + [''])[at].strip()[:220]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print("all identical" if all(r["identical"] for r in results) else
          "same op counts everywhere" if ok else "DIFFERENT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
