"""The planner's choice of global batch and mesh for a GPU count, and its what-if grid.

The config's own batch and mesh are kept when they split over the GPUs asked for (a memory
estimate over the GPU is a note: the estimate runs high); otherwise (the batch does not split
over the mesh, or starves the GPUs) the planner picks:

- batch: ``--batch-tokens`` (default ~4M tokens, the size Llama 3 started its 8B and 70B runs
  at) rounded to a whole number of sequences on every data x fsdp shard;
- mesh: tensor x fsdp inside a node (or whole nodes, when a node cannot hold the model state),
  pipeline stages and data parallelism across nodes: of the meshes whose memory fits, the fastest
  per token among those whose rounded batch stays within BATCH_TOLERANCE of the target;
- train.microbatches: without stages the fewest that fit memory; with P stages the fastest of
  those from P up (more shrink the bubble, and gather FSDP's weights more often), and the
  stages' repeats (``mesh.pipeline_repeats``) with them.

Stage layouts are offered only where the trainer runs them: the rules of
:mod:`maxfp4.parallel.pipeline_stages` (alike stages of the blocks and of the config's recipes,
microbatches that fill the schedule) decide both, so a chosen plan passes the trainer's start-up
check; a config whose own stages break them is refused with the trainer's line.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from maxfp4.config import Config, ModelConfig
from maxfp4.errors import ConfigError, UserError
from maxfp4.parallel.mesh import resolve_mesh_shape
from maxfp4.parallel.pipeline_schedule import bubble_fraction
from maxfp4.parallel.pipeline_stages import microbatches_problem, stages_problem
from maxfp4.plan import cost as model
from maxfp4.plan.stages import PlanMesh
from maxfp4.plot import save_figure

DEFAULT_BATCH_TOKENS = 4 * 2**20
# A rounded batch may miss the asked tokens by this factor before a mesh that rounds closer wins.
BATCH_TOLERANCE = 1.5
# Fewer tokens than this per data x fsdp shard and a step is mostly fixed costs (small GEMMs,
# optimizer passes, collectives): the config's batch is then called starved and replaced.
STARVED_TOKENS_PER_SHARD = 4096
TENSOR_SIZES = (1, 2, 4, 8)
PIPELINE_REPEATS = (1, 2, 4, 8)  # mesh.pipeline_repeats the search tries
# Stages of one block or two leave each tick too little work to hide a hand-over behind and are
# not searched: a stage keeps at least this many blocks a repeat.
MIN_BLOCKS_PER_CHUNK = 2
DEFAULT_WHAT_IF_GPUS = (8, 64, 256, 1024, 4096, 8192, 16384)


@dataclasses.dataclass(frozen=True)
class Layout:
    cfg: Config  # the config with the chosen data.global_batch, mesh and train.microbatches
    mesh: PlanMesh  # with the pipeline's repeats, which a config may not carry
    chosen: bool  # False: the config's own batch and mesh
    reasons: tuple[str, ...]  # what was chosen and why, one line each


def _with(cfg: Config, global_batch: int, mesh: PlanMesh, microbatches: int,
          remat: str | None = None) -> Config:
    axes = dict(data=mesh.data, fsdp=mesh.fsdp, tensor=mesh.tensor, pipeline=mesh.pipeline,
                pipeline_repeats=mesh.repeats, pipeline_overlap=mesh.overlap,
                shard_optimizer_over_data=mesh.shard_optimizer)
    return dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, global_batch=global_batch),
        mesh=dataclasses.replace(cfg.mesh, **axes),
        train=dataclasses.replace(cfg.train, microbatches=microbatches, remat=remat or cfg.train.remat))


def usable_gb(gpu: str) -> float:
    return model.USABLE_MEMORY * model.GPUS[gpu]["memory_gb"]


def memory_gb(cfg: Config, mesh: PlanMesh, precision: str = "bf16") -> float:
    params = model.param_count(cfg.model)
    return sum(model.memory_per_device(cfg, mesh, params, precision, cfg.train.remat).values()) / 1e9


def candidate_meshes(m: ModelConfig, gpus: int, gpus_per_node: int,
                     across_nodes: bool = False) -> Iterator[PlanMesh]:
    """Meshes with tensor inside a node and dividing the KV heads and MLP width, fsdp x tensor
    inside a node (``across_nodes``: whole nodes), and pipeline stages (with their repeats, each
    chunk at least MIN_BLOCKS_PER_CHUNK blocks, hand-overs waited for or overlapped) and data
    parallelism over the rest (the optimizer's moments whole or split over it)."""
    for tensor in TENSOR_SIZES:
        if tensor > gpus_per_node or gpus % tensor or m.n_kv_heads % tensor or m.d_ff % tensor:
            continue
        for fsdp in range(1, gpus // tensor + 1):
            inner = fsdp * tensor
            if gpus % inner:
                continue
            if (inner > gpus_per_node and inner % gpus_per_node == 0) if across_nodes else inner <= gpus_per_node:
                for stages in _divisors(gpus // inner):
                    for repeats in PIPELINE_REPEATS if stages > 1 else (1,):
                        if stages * repeats * MIN_BLOCKS_PER_CHUNK <= m.n_layers:
                            data = gpus // inner // stages
                            for overlap in (False, True) if stages > 1 else (False,):
                                for sharded in (False, True) if data > 1 else (False,):
                                    yield PlanMesh(data, fsdp, tensor, stages, repeats, overlap, sharded)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def config_mesh(cfg: Config, gpus: int) -> PlanMesh:
    """The config's own mesh on ``gpus`` (an explicit mesh that cannot be built, or stages the
    trainer refuses to run the model and its recipes in, is an error: the trainer's line)."""
    mesh = PlanMesh.of(resolve_mesh_shape(cfg.mesh, gpus), cfg.mesh)
    problem = stages_problem(cfg.model, mesh.pipeline, mesh.repeats)
    if problem:
        raise ConfigError(problem)
    return mesh


def _config_layout_problem(cfg: Config, gpus: int, gpu: str) -> str | None:
    """Why the config's own batch and mesh are not kept, or None to keep them."""
    mesh = config_mesh(cfg, gpus)
    shards = mesh.batch_shards
    g, micro = cfg.data.global_batch, cfg.train.microbatches
    if g % (micro * shards):
        return (f"data.global_batch={g} does not split over train.microbatches x data x fsdp = "
                f"{micro} x {shards} (the config's mesh on {gpus:,} GPUs)")
    problem = microbatches_problem(mesh.pipeline, mesh.repeats, micro, mesh.overlap)
    if problem:
        return f"{problem} (the config's mesh on {gpus:,} GPUs)"
    tokens_per_shard = g * cfg.data.seq_len // shards
    if tokens_per_shard < STARVED_TOKENS_PER_SHARD:
        return (f"data.global_batch={g} leaves {tokens_per_shard:,} tokens a step on each of {shards:,} "
                f"batch shards (under {STARVED_TOKENS_PER_SHARD:,}: the GPUs would wait on fixed costs)")
    return None


def describe(mesh: PlanMesh) -> str:
    """``data=D x pipeline=P (repeats V) x fsdp=F x tensor=T``, the pipeline only where there is one."""
    how = [f"repeats {mesh.repeats}"] * (mesh.repeats > 1) + ["overlapped hand-overs"] * mesh.overlap
    stages = "" if mesh.pipeline == 1 else f"pipeline={mesh.pipeline} " + (
        f"({', '.join(how)}) " if how else "") + "x "
    moments = " (moments split over data)" if mesh.shard_optimizer else ""
    return f"data={mesh.data:,}{moments} x {stages}fsdp={mesh.fsdp} x tensor={mesh.tensor}"


def overrides(mesh: PlanMesh) -> str:
    """The mesh as the config keys that train with it. With a tensor axis, sequence parallelism:
    the memory model splits every block's activations over tensor (``memory_per_device``), which
    holds for the residual stream between blocks only with it."""
    keys = f"mesh.data={mesh.data} mesh.pipeline={mesh.pipeline} mesh.fsdp={mesh.fsdp} mesh.tensor={mesh.tensor}"
    return (keys + (f" mesh.pipeline_repeats={mesh.repeats}" if mesh.repeats > 1 else "")
            + (" mesh.pipeline_overlap=true" if mesh.overlap else "")
            + (" mesh.shard_optimizer_over_data=true" if mesh.shard_optimizer else "")
            + (" mesh.sequence_parallel=true" if mesh.tensor > 1 else ""))


def layout_for(cfg: Config, gpus: int, gpu: str, batch_tokens: float | None = None,
               gpus_per_node: int = model.GPUS_PER_NODE, stages_only: bool = False) -> Layout:
    """The config's batch and mesh if they run well on ``gpus``; else a chosen one. An explicit
    ``batch_tokens`` always chooses, and so does ``stages_only`` (among meshes with stages)."""
    if stages_only:
        why = "layout chosen among meshes with pipeline stages (--stages)"
        return choose_layout(cfg, gpus, gpu, batch_tokens or DEFAULT_BATCH_TOKENS, gpus_per_node, why, stages_only=True)
    if batch_tokens is None:
        problem = _config_layout_problem(cfg, gpus, gpu)
        if problem is None:
            mesh = config_mesh(cfg, gpus)
            reasons = [f"layout: the config's data.global_batch={cfg.data.global_batch}, mesh "
                       f"{describe(mesh)}, "
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


def microbatch_options(m: ModelConfig, mesh: PlanMesh, per_shard: int) -> list[int] | None:
    """Microbatch counts to try on ``mesh`` with ``per_shard`` rows a batch shard: each divides the
    rows and fills the stages (from ``pipeline`` up; with repeats, whole groups of ``pipeline``).
    None where the trainer refuses the mesh's stages for the model."""
    if stages_problem(m, mesh.pipeline, mesh.repeats):
        return None
    return [d for d in _divisors(per_shard) if microbatches_problem(mesh.pipeline, mesh.repeats, d, mesh.overlap) is None]


def choose_layout(cfg: Config, gpus: int, gpu: str, batch_tokens: float, gpus_per_node: int,
                  why: str = "layout chosen", stages_only: bool = False) -> Layout:
    usable = usable_gb(gpu)
    seq = cfg.data.seq_len
    fitting, tried, refused = [], 0, 0
    # FSDP across nodes only if no node-sized model group without stages fits; full remat only if
    # nothing without stages fits without it. Meshes with stages compete at every step on speed.
    for remat, across in [(r, a) for a in (False, True) for r in dict.fromkeys((cfg.train.remat, "full"))]:
        fit_whole = set()  # meshes that fit with the moments whole over data
        for mesh in candidate_meshes(cfg.model, gpus, gpus_per_node, across):
            if stages_only and mesh.pipeline == 1:
                continue
            # Split moments only buy memory (and expose the weights' gather): tried where the
            # same mesh with them whole does not fit (candidate_meshes yields that one first).
            if mesh.shard_optimizer and mesh._replace(shard_optimizer=False) in fit_whole:
                continue
            shards = mesh.batch_shards
            # with stages, at least one row a stage on every shard: microbatches >= stages
            rows = max(mesh.pipeline, round(batch_tokens / seq / shards)) * shards
            options = microbatch_options(cfg.model, mesh, rows // shards)
            if options is None:
                refused += 1
                continue
            tried += 1
            best = None
            for micro in options:
                c = _with(cfg, rows, mesh, micro, remat)
                need = memory_gb(c, mesh)
                if need <= usable:
                    step = model.project(c, mesh, gpu, "bf16", gpus_per_node=gpus_per_node)["step_time_s"]
                    if best is None or step < best[0]:
                        best = (step, c, need)
                    if mesh.pipeline == 1:  # without stages more microbatches only cost: the fewest that fit
                        break
            if best is not None and not mesh.shard_optimizer:
                fit_whole.add(mesh)
            if best is not None:
                step, c, need = best
                # Across nodes, the smallest group of nodes that holds the model (data parallel
                # over the rest, as hybrid sharding does): FSDP over IB scales worse than the model says.
                group = mesh.fsdp * mesh.tensor if across else 0
                fitting.append((group, step / (rows * seq), mesh.tensor, -mesh.data, rows, c, mesh, need))
        # (moments split over data fit more meshes, not the ones this rule is about: they compete
        # on speed with the rest)
        if any(f[6].pipeline == 1 and not f[6].shard_optimizer for f in fitting):
            break
    if not fitting:
        raise UserError(f"--gpus {gpus}: no mesh {'with pipeline stages ' if stages_only else ''}of {gpus:,} {gpu.upper()} GPUs fits {model.param_count(cfg.model) / 1e9:.1f}B "
                        f"parameters in {usable:.0f} GB a GPU (tried {tried} meshes, train.remat=full "
                        f"included); expected more GPUs or GPUs with more memory")
    # A batch far above the asked one changes the training recipe, so it is taken only when no
    # mesh can split a smaller one (the batch shards, data x fsdp, each need a whole sequence).
    smallest = min(f[4] for f in fitting)
    ceiling = max(batch_tokens / seq, smallest) * BATCH_TOLERANCE
    near = [f for f in fitting if f[4] <= ceiling]
    # of groups of whole nodes, the smallest for each pipeline degree and way of keeping the
    # moments (split over data they let a smaller group hold the model, at a price of their own)
    smallest_group = {}
    for f in near:
        if f[0]:
            kind = (f[6].pipeline, f[6].shard_optimizer)
            smallest_group[kind] = min(f[0], smallest_group.get(kind, f[0]))
    near = [f for f in near if f[0] in (0, smallest_group.get((f[6].pipeline, f[6].shard_optimizer)))]
    best = min(near, key=lambda f: f[1:5])
    *_, c, mesh, need = best
    rows = c.data.global_batch
    inner = mesh.fsdp * mesh.tensor
    stages = (f"{mesh.pipeline} pipeline stages" + (f" of {mesh.repeats} repeats" if mesh.repeats > 1 else "")
              + (" across nodes, " if inner * mesh.pipeline > gpus_per_node else ", ")) if mesh.pipeline > 1 else ""
    if inner <= gpus_per_node:
        placement = (f"fsdp x tensor = {inner} GPUs inside a node, {stages}" + (
            f"data parallel across {mesh.data:,} groups" + (f" ({gpus // gpus_per_node:,} nodes of {gpus_per_node})"
                                                            if gpus >= gpus_per_node else "")
            if mesh.data > 1 else "no data parallelism"))
    else:
        placement = (f"fsdp x tensor = {inner} GPUs ({inner // gpus_per_node} nodes: one node cannot hold "
                     f"the state), {stages}data parallel across {mesh.data:,} such groups")
    reasons = [
        why,
        f"  batch: {rows:,} sequences x {c.data.seq_len:,} = {rows * c.data.seq_len:,} tokens a step "
        f"(~{batch_tokens:,.0f} asked, rounded to whole sequences on each of {mesh.batch_shards:,} data x fsdp shards)",
        f"  mesh: {describe(mesh)}: {placement}; "
        + ("the smallest such group, then " if inner > gpus_per_node else "")
        + f"the fastest per token of the {len(near)} meshes that fit {usable:.0f} GB with a batch under {ceiling * seq:,.0f} tokens "
        f"({BATCH_TOLERANCE}x the asked or the smallest the GPUs can split); BF16 needs {need:.1f} GB "
        f"({tried - len(fitting)} of {tried} meshes did not fit"
        + (f"; {refused} more have stages the trainer refuses" if refused else "") + ")",
    ]
    if mesh.pipeline > 1:
        bubble = bubble_fraction(mesh.pipeline, c.train.microbatches, mesh.repeats, mesh.lag)
        reasons.append(f"  stages: {c.train.microbatches} microbatches through {mesh.pipeline} stages x "
                       f"{mesh.repeats} repeats, bubble {bubble:.1%}"
                       + (", hand-overs overlapped with the next tick" if mesh.overlap else ""))
    if (c.train.microbatches > 1 and mesh.pipeline == 1) or c.train.remat != cfg.train.remat:
        reasons.append(f"  to fit: train.microbatches={c.train.microbatches}, train.remat={c.train.remat}")
    # The cost model charges an E block under tensor as expert tensor parallelism (its w_down
    # summed over tensor, each expert's weights 1/tensor a device): the layout to train with it.
    etp = mesh.tensor > 1 and "E" in c.model.pattern and not c.model.moe.expert_tensor_parallel
    reasons.append(f"  to train with it: data.global_batch={rows} {overrides(mesh)} "
                   f"train.microbatches={c.train.microbatches}"
                   + (f" train.remat={c.train.remat}" if c.train.remat != cfg.train.remat else "")
                   + (" model.moe.expert_tensor_parallel=true" if etp else ""))
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
        m = r["mesh"]
        mesh = f"{m['data']}x{m['fsdp']}x{m['tensor']}" + (f" p{m['pipeline']}" if m["pipeline"] > 1 else "")
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
