"""The planner's choice of global batch and mesh for a GPU count, and its what-if grid.

The config's own batch and mesh are kept when they split over the GPUs asked for (a memory
estimate over the GPU is a note: the estimate runs high); otherwise (the batch does not split
over the mesh, or starves the GPUs) the planner picks:

- batch: ``--batch-tokens`` (default ~4M tokens, the size Llama 3 started its 8B and 70B runs
  at) rounded to a whole number of sequences on every data x fsdp shard;
- mesh: tensor x fsdp inside a node (or whole nodes, when a node cannot hold the model state),
  data parallelism across nodes: of the meshes whose memory fits, the fastest per token among
  those whose rounded batch stays within BATCH_TOLERANCE of the target;
- train.microbatches: the fewest that fit memory.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from maxfp4.config import Config, ModelConfig
from maxfp4.errors import UserError
from maxfp4.parallel.mesh import resolve_mesh_shape
from maxfp4.plan import cost as model
from maxfp4.plot import save_figure

DEFAULT_BATCH_TOKENS = 4 * 2**20
# A rounded batch may miss the asked tokens by this factor before a mesh that rounds closer wins.
BATCH_TOLERANCE = 1.5
# Fewer tokens than this per data x fsdp shard and a step is mostly fixed costs (small GEMMs,
# optimizer passes, collectives): the config's batch is then called starved and replaced.
STARVED_TOKENS_PER_SHARD = 4096
TENSOR_SIZES = (1, 2, 4, 8)
DEFAULT_WHAT_IF_GPUS = (8, 64, 256, 1024, 4096, 8192, 16384)


@dataclasses.dataclass(frozen=True)
class Layout:
    cfg: Config  # the config with the chosen data.global_batch, mesh and train.microbatches
    mesh: tuple[int, int, int]
    chosen: bool  # False: the config's own batch and mesh
    reasons: tuple[str, ...]  # what was chosen and why, one line each


def _with(cfg: Config, global_batch: int, mesh: tuple[int, int, int], microbatches: int,
          remat: str | None = None) -> Config:
    data, fsdp, tensor = mesh
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, global_batch=global_batch),
        mesh=dataclasses.replace(cfg.mesh, data=data, fsdp=fsdp, tensor=tensor),
        train=dataclasses.replace(cfg.train, microbatches=microbatches, remat=remat or cfg.train.remat))


def usable_gb(gpu: str) -> float:
    return model.USABLE_MEMORY * model.GPUS[gpu]["memory_gb"]


def memory_gb(cfg: Config, mesh: tuple[int, int, int], precision: str = "bf16") -> float:
    params = model.param_count(cfg.model)
    return sum(model.memory_per_device(cfg, mesh, params, precision, cfg.train.remat).values()) / 1e9


def candidate_meshes(m: ModelConfig, gpus: int, gpus_per_node: int,
                     across_nodes: bool = False) -> Iterator[tuple[int, int, int]]:
    """(data, fsdp, tensor) with tensor inside a node and dividing the KV heads and MLP width,
    and fsdp x tensor inside a node (``across_nodes``: whole nodes), so data parallelism spans
    the nodes."""
    for tensor in TENSOR_SIZES:
        if tensor > gpus_per_node or gpus % tensor or m.n_kv_heads % tensor or m.d_ff % tensor:
            continue
        for fsdp in range(1, gpus // tensor + 1):
            inner = fsdp * tensor
            if gpus % inner:
                continue
            if (inner > gpus_per_node and inner % gpus_per_node == 0) if across_nodes else inner <= gpus_per_node:
                yield gpus // inner, fsdp, tensor


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _config_layout_problem(cfg: Config, gpus: int, gpu: str) -> str | None:
    """Why the config's own batch and mesh are not kept, or None to keep them."""
    mesh = resolve_mesh_shape(cfg.mesh, gpus)  # an explicit mesh that cannot be built is an error
    shards = mesh[0] * mesh[1]
    g, micro = cfg.data.global_batch, cfg.train.microbatches
    if g % (micro * shards):
        return (f"data.global_batch={g} does not split over train.microbatches x data x fsdp = "
                f"{micro} x {shards} (the config's mesh on {gpus:,} GPUs)")
    tokens_per_shard = g * cfg.data.seq_len // shards
    if tokens_per_shard < STARVED_TOKENS_PER_SHARD:
        return (f"data.global_batch={g} leaves {tokens_per_shard:,} tokens a step on each of {shards:,} "
                f"batch shards (under {STARVED_TOKENS_PER_SHARD:,}: the GPUs would wait on fixed costs)")
    return None


def layout_for(cfg: Config, gpus: int, gpu: str, batch_tokens: float | None = None,
               gpus_per_node: int = model.GPUS_PER_NODE) -> Layout:
    """The config's batch and mesh if they run well on ``gpus``; else a chosen one. An explicit
    ``batch_tokens`` always chooses."""
    if batch_tokens is None:
        problem = _config_layout_problem(cfg, gpus, gpu)
        if problem is None:
            mesh = resolve_mesh_shape(cfg.mesh, gpus)
            reasons = [f"layout: the config's data.global_batch={cfg.data.global_batch}, mesh "
                       f"data={mesh[0]} x fsdp={mesh[1]} x tensor={mesh[2]}, "
                       f"train.microbatches={cfg.train.microbatches} (they split over the GPUs)"]
            need = memory_gb(cfg, mesh)
            if need > usable_gb(gpu):
                # Kept: the memory model runs high (up to ~40% over measured peaks, docs/PLANNING.md),
                # and a config that was measured to run must not be replaced on its estimate.
                reasons.append(f"note: the model estimates {need:.1f} GB a GPU, over the {usable_gb(gpu):.0f} GB "
                               f"usable on {gpu.upper()}; it runs high, so try it, or pass --batch-tokens "
                               f"to have a layout chosen that fits the estimate")
            return Layout(cfg, mesh, False, tuple(reasons))
        why = f"layout chosen because {problem}"
    else:
        why = f"layout chosen for --batch-tokens {batch_tokens:,.0f}"
    return choose_layout(cfg, gpus, gpu, batch_tokens or DEFAULT_BATCH_TOKENS, gpus_per_node, why)


def choose_layout(cfg: Config, gpus: int, gpu: str, batch_tokens: float, gpus_per_node: int,
                  why: str = "layout chosen") -> Layout:
    usable = usable_gb(gpu)
    seq = cfg.data.seq_len
    fitting, tried = [], 0
    # FSDP across nodes only if no node-sized model group fits; full remat only if nothing fits without it.
    for remat, across in [(r, a) for a in (False, True) for r in dict.fromkeys((cfg.train.remat, "full"))]:
        for mesh in candidate_meshes(cfg.model, gpus, gpus_per_node, across):
            tried += 1
            shards = mesh[0] * mesh[1]
            rows = max(1, round(batch_tokens / seq / shards)) * shards
            for micro in _divisors(rows // shards):
                c = _with(cfg, rows, mesh, micro, remat)
                need = memory_gb(c, mesh)
                if need <= usable:
                    step = model.project(c, mesh, gpu, "bf16", gpus_per_node=gpus_per_node)["step_time_s"]
                    # Across nodes, the smallest group of nodes that holds the model (data parallel
                    # over the rest, as hybrid sharding does): FSDP over IB scales worse than the model says.
                    group = mesh[1] * mesh[2] if across else 0
                    fitting.append((group, step / (rows * seq), mesh[2], -mesh[0], rows, c, mesh, need))
                    break
        if fitting:
            break
    if not fitting:
        raise UserError(f"--gpus {gpus}: no mesh of {gpus:,} {gpu.upper()} GPUs fits {model.param_count(cfg.model) / 1e9:.1f}B "
                        f"parameters in {usable:.0f} GB a GPU (tried {tried} meshes, train.remat=full "
                        f"included); expected more GPUs or GPUs with more memory")
    # A batch far above the asked one changes the training recipe, so it is taken only when no
    # mesh can split a smaller one (the batch shards, data x fsdp, each need a whole sequence).
    smallest = min(f[4] for f in fitting)
    ceiling = max(batch_tokens / seq, smallest) * BATCH_TOLERANCE
    near = [f for f in fitting if f[4] <= ceiling]
    best = min(near)
    *_, c, mesh, need = best
    data, fsdp, tensor = mesh
    rows = c.data.global_batch
    inner = fsdp * tensor
    if inner <= gpus_per_node:
        placement = (f"fsdp x tensor = {inner} GPUs inside a node, " + (
            f"data parallel across {data:,} groups" + (f" ({gpus // gpus_per_node:,} nodes of {gpus_per_node})"
                                                       if gpus >= gpus_per_node else "")
            if data > 1 else "no data parallelism"))
    else:
        placement = (f"fsdp x tensor = {inner} GPUs ({inner // gpus_per_node} nodes: one node cannot hold "
                     f"the state), data parallel across {data:,} such groups")
    reasons = [
        why,
        f"  batch: {rows:,} sequences x {c.data.seq_len:,} = {rows * c.data.seq_len:,} tokens a step "
        f"(~{batch_tokens:,.0f} asked, rounded to whole sequences on each of {data * fsdp:,} data x fsdp shards)",
        f"  mesh: data={data:,} x fsdp={fsdp} x tensor={tensor}: {placement}; "
        + ("the smallest such group, then " if inner > gpus_per_node else "")
        + f"the fastest per token of the {len(near)} meshes that fit {usable:.0f} GB with a batch under {ceiling * seq:,.0f} tokens "
        f"({BATCH_TOLERANCE}x the asked or the smallest the GPUs can split); BF16 needs {need:.1f} GB "
        f"({tried - len(fitting)} of {tried} meshes did not fit)",
    ]
    if c.train.microbatches > 1 or c.train.remat != cfg.train.remat:
        reasons.append(f"  to fit: train.microbatches={c.train.microbatches}, train.remat={c.train.remat}")
    reasons.append(f"  to train with it: data.global_batch={rows} mesh.data={data} mesh.fsdp={fsdp} "
                   f"mesh.tensor={tensor} train.microbatches={c.train.microbatches}"
                   + (f" train.remat={c.train.remat}" if c.train.remat != cfg.train.remat else ""))
    return Layout(c, mesh, True, tuple(reasons))


# ----------------------------------------------------------------------------- what-if


def what_if(cfg: Config, gpu_counts: list[int], gpu: str, tokens: float, *, batch_tokens: float | None,
            gpus_per_node: int, goodput: float) -> list[dict]:
    """Days and GPU-hours for each GPU count and precision; the layout is chosen per count
    (the config's batch is sized for its own GPUs, not for a grid)."""
    out = []
    for gpus in gpu_counts:
        try:
            layout = choose_layout(cfg, gpus, gpu, batch_tokens or DEFAULT_BATCH_TOKENS, gpus_per_node)
        except UserError:  # too few GPUs to hold the model: a row that says so, not the end of the grid
            out.append({"gpus": gpus, "mesh": None, "global_batch": None, "microbatches": None, "remat": None,
                        **{f"{p}_{k}": None for p in model.PRECISIONS for k in ("days", "gpu_hours", "step_time_s", "mfu")}})
            continue
        rows = model.rows_for(layout, gpus, gpu, tokens, None, gpus_per_node, goodput)
        out.append({"gpus": gpus, "mesh": rows[0]["mesh"], "global_batch": layout.cfg.data.global_batch,
                    "microbatches": layout.cfg.train.microbatches, "remat": layout.cfg.train.remat,
                    **{f"{r['precision']}_{k}": r[k] for r in rows for k in ("days", "gpu_hours", "step_time_s", "mfu")}})
    return out


def format_what_if(grid: list[dict], gpu: str, tokens: float, goodput: float) -> str:
    lines = [f"what-if: {tokens:.3g} tokens on {gpu.upper()}, goodput {goodput:.0%} (days and GPU-hours "
             f"include it); a layout chosen for each GPU count",
             f"{'GPUs':>7} {'mesh d x f x t':>16} {'batch':>6} "
             + "".join(f"{p + ' days':>12}{p + ' GPU-h':>14}{'MFU':>6}" for p in model.PRECISIONS)]
    for r in grid:
        if r["mesh"] is None:
            lines.append(f"{r['gpus']:>7,}  no mesh of {r['gpus']:,} GPUs holds the model")
            continue
        mesh = f"{r['mesh']['data']}x{r['mesh']['fsdp']}x{r['mesh']['tensor']}"
        lines.append(f"{r['gpus']:>7,} {mesh:>16} {r['global_batch']:>6,} "
                     + "".join(f"{r[p + '_days']:>12.1f}{r[p + '_gpu_hours']:>14,.0f}{r[p + '_mfu']:>6.0%}"
                               for p in model.PRECISIONS))
    return "\n".join(lines)


def plot_what_if(grid: list[dict], path: str, title: str) -> None:
    """Days and GPU-hours against GPU count, one line per precision (log-log)."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only, no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot: needs matplotlib (a maxfp4 dependency): pip install matplotlib") from None
    grid = [r for r in grid if r["mesh"] is not None]
    gpus = [r["gpus"] for r in grid]
    fig, (days_ax, hours_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for p in model.PRECISIONS:
        days_ax.plot(gpus, [r[f"{p}_days"] for r in grid], marker="o", label=p)
        hours_ax.plot(gpus, [r[f"{p}_gpu_hours"] for r in grid], marker="o", label=p)
    for ax, ylabel in ((days_ax, "days"), (hours_ax, "GPU-hours")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    save_figure(fig, path, "--plot", dpi=120)
