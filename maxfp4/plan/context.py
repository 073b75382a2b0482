"""The planner's model of context parallelism (mesh.context, maxfp4.parallel.context).

A context degree C splits each sequence over C GPUs, so a GPU holds T/C tokens of each of its
rows: its activations are those of a sequence of T/C tokens, while attention's FLOPs a token
stay those of the whole T. The plan of a config with C > 1 is the plan of its context group's
proxy (``data.seq_len`` = T/C on gpus/C GPUs: the same tokens, FLOPs and memory a GPU, see
:func:`proxy_config`), rescaled to the whole sequence and the whole machine, plus what the split
adds (docs/CONTEXT.md):

- attention: every attention layer all-gathers K and V (the kv heads only) over the C ranks,
  forward, again in a recomputed forward, and reduce-scatters their gradients backward;
- Mamba-2: every Mamba layer all-gathers each chunk's exit state [H, P, N] and decay (FP32),
  forward and backward, and the convolution's W-1 tokens of window (negligible);
- balance: the zigzag order gives every rank the same causal work (:func:`causal_work_per_rank`);
- attention: the causal work of a token at the whole length, at the rate of cuDNN's kernels
  split per chunk (:func:`split_attention_seconds_per_token`).

These collectives are charged as exposed: each feeds the layer that issued it.
"""

from __future__ import annotations

import dataclasses
import math

from maxfp4.config import Config, ConfigError
from maxfp4.errors import UserError
from maxfp4.model_spec import mamba_dims, model_spec
from maxfp4.plan import cost, layout, rates

CONTEXT_SIZES = (2, 4, 8)
ACT_BYTES = 2  # K and V in BF16
STATE_BYTES = 4  # Mamba-2 states and decays in FP32


def causal_work_per_rank(c: int, zigzag: bool = True) -> list[float]:
    """Each rank's share of the causal score entries of a sequence of 2C equal chunks, in the
    zigzag order (rank r: chunks r and 2C-1-r) or contiguous (rank r: chunks 2r and 2r+1).
    Chunk j sees j whole chunks and its own lower triangle: j + 1/2 chunk-squares, 2C^2 in all."""
    def chunk(j):
        return j + 0.5
    ranks = [(r, 2 * c - 1 - r) if zigzag else (2 * r, 2 * r + 1) for r in range(c)]
    total = (2 * c) ** 2 / 2
    return [(chunk(a) + chunk(b)) / total for a, b in ranks]


def imbalance(c: int, zigzag: bool = True) -> float:
    """The busiest rank's causal work over the mean (1.0: balanced)."""
    work = causal_work_per_rank(c, zigzag)
    return max(work) * c / sum(work)


def split_attention_seconds_per_token(cfg: Config, c: int, gpu: str) -> float:
    """Seconds a token of a rank spends in the split's attention beyond what its proxy (T/C tokens,
    no split) was charged: the causal work of a token at T, balanced by the zigzag order
    (:func:`imbalance`), on cuDNN's kernels split per chunk (model.attention auto, cudnn,
    cudnn_mask: rates.SPLIT_ATTENTION_H200_TFLOPS at the model's head dim; the proxy ran cuDNN's
    causal kernel whole) or XLA's (model.attention=xla), x 4/3 under full remat (the forward
    again)."""
    m, t = cfg.model, cfg.data.seq_len
    spec = model_spec(m)
    xla = cost.runs_xla_attention(cfg)
    proxy_rate = rates.attention_tflops(gpu, xla=xla) * 1e12
    split_rate = proxy_rate if xla else rates.split_attention_tflops(gpu, m.resolved_head_dim) * 1e12
    split = spec.attention_flops_per_token(t) * imbalance(c) / split_rate
    proxy = spec.attention_flops_per_token(t // c) / proxy_rate
    recompute = 4 / 3 if cfg.train.remat == "full" else 1.0
    return (split - proxy) * recompute


def comm_bytes_per_device(cfg: Config, c: int, rows_per_device: float) -> dict[str, float]:
    """Bytes a GPU receives a step for the context split of ``rows_per_device`` sequences."""
    m = cfg.model
    spec = model_spec(m)
    t = cfg.data.seq_len
    passes = 2 if cfg.train.remat == "full" else 1  # forward gathers, recomputed once more under remat
    share = (c - 1) / c
    kv = 2 * t * m.n_kv_heads * m.resolved_head_dim * ACT_BYTES * share
    attention = len(spec.blocks_with("attention")) * rows_per_device * kv * (passes + 1)  # + gradients' reduce-scatter
    mamba = 0.0
    if spec.blocks_with("mamba"):
        d = mamba_dims(m)
        state = (d["H"] * d["P"] * d["N"] + d["H"]) * STATE_BYTES
        mamba = len(spec.blocks_with("mamba")) * rows_per_device * 2 * c * state * share * (passes + 1)
    return {"attention_kv": attention, "mamba_state": mamba}


def proxy_config(cfg: Config, c: int) -> Config:
    """The config a context group of ``c`` GPUs costs like a GPU each: sequences of T/C tokens,
    no context axis."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=cfg.data.seq_len // c),
                               mesh=dataclasses.replace(cfg.mesh, context=1))


# The memory terms of the parameters' state, which is sharded over context too
# (maxfp4.parallel.mesh): 1/C of the proxy's on each GPU of a context group.
STATE_TERMS = ("master", "adam", "grads", "gathered_stages")


def state_over_context(breakdown: dict[str, float], c: int) -> dict[str, float]:
    """The proxy's memory terms (:func:`proxy_config`) as a GPU of a context group of ``c`` holds
    them: the state's terms divided by ``c``, the rest (a GPU's T/C tokens) as they are."""
    return {k: v / c if k in STATE_TERMS else v for k, v in breakdown.items()}


def with_context(cfg: Config, c: int) -> Config:
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, context=c))


def rows_with_context(cfg: Config, rows: list[dict], c: int, gpus: int, tokens: float, gpu: str,
                      gpus_per_node: int) -> list[dict]:
    """The proxy's plan rows (:func:`proxy_config` on gpus/C GPUs) for the config with context C:
    whole sequences, all ``gpus``, attention at the whole length, the split's collectives."""
    m = cfg.model
    t = cfg.data.seq_len
    link = rates.GPUS[gpu]["nvlink_gbs"] if c <= gpus_per_node else cost.IB_GBS
    out = []
    for row in rows:
        tokens_per_step = row["tokens_per_step"] * c
        # a context group shares its rows: each GPU gathers K and V for every row of its group
        rows_per_device = row["global_batch"] / (row["mesh"]["data"] * row["mesh"]["fsdp"])
        # with pipeline stages a device runs (and splits) only its stages' layers, ~1/P of them
        comm = sum(comm_bytes_per_device(cfg, c, rows_per_device).values()) / row["mesh"]["pipeline"] / (link * 1e9)
        tokens_per_gpu = row["tokens_per_step"] / (gpus / c)
        extra = tokens_per_gpu * split_attention_seconds_per_token(cfg, c, gpu)
        step = row["step_time_s"] + extra + comm
        flops = sum(cost.flops_by_block_type(m, t).values())
        steps = math.ceil(tokens / tokens_per_step)
        wall = steps * step / row["goodput"]
        breakdown = state_over_context(row["memory_breakdown_gb"], c)
        state = {k: breakdown[k] for k in STATE_TERMS if k in breakdown}
        saved = sum(row["memory_breakdown_gb"].values()) - sum(breakdown.values())
        memory = row["memory_per_device_gb"] - saved
        fits = memory <= cost.USABLE_MEMORY * rates.GPUS[gpu]["memory_gb"]
        notes = [n for n in row["notes"] if not (fits and n.startswith("note: the model estimates"))]
        out.append(dict(row, gpus=gpus, memory_per_device_gb=memory, fits=fits, context=c,
                        memory_breakdown_gb=dict(row["memory_breakdown_gb"], **state),
                        memory_other_remat_gb=row["memory_other_remat_gb"] - saved, tokens_per_step=tokens_per_step, steps=steps, step_time_s=step,
                        compute_s=row["compute_s"] + extra, comm_s=row["comm_s"] + comm, flops_per_token=flops,
                        flops_per_token_by_block=cost.flops_by_block_type(m, t),
                        mfu=flops * tokens_per_step / step / gpus / (rates.datasheet_tflops(gpu, "bf16") * 1e12),
                        days=wall / 86400, gpu_hours=wall * gpus / 3600,
                        notes=notes + [context_note(cfg, c, rows_per_device, comm)]))
    return out


def context_note(cfg: Config, c: int, rows_per_device: float, comm_s: float) -> str:
    b = comm_bytes_per_device(cfg, c, rows_per_device)
    return (f"context: mesh.context={c} splits each {cfg.data.seq_len:,}-token sequence over {c} GPUs "
            f"(zigzag, causal work balance {imbalance(c):.2f}, contiguous would be {imbalance(c, False):.2f}); "
            f"a step's KV all-gathers {b['attention_kv'] / 1e9:.2f} GB and Mamba-2 state exchange "
            f"{b['mamba_state'] / 1e9:.3f} GB a GPU, {comm_s * 1e3:.0f} ms exposed")


def _fitting_layout(cfg: Config, gpus: int, gpu: str, batch_tokens, gpus_per_node: int, c: int = 1):
    """The layout of ``cfg`` (a proxy of context ``c``) on ``gpus`` if its memory estimate fits the
    GPU, its parameters' state divided by ``c`` (sharded over context too), else None."""
    try:
        lay = layout.layout_for(cfg, gpus, gpu, batch_tokens, gpus_per_node)
    except UserError:  # ConfigError included: a fixed mesh axis the proxy's GPUs cannot hold
        return None
    mem = cost.memory_per_device(lay.cfg, lay.mesh, cost.param_count(cfg.model), "bf16", lay.cfg.train.remat)
    need = sum(mem.values()) - (mem["master"] + mem["adam"] + mem["grads"]) * (1 - 1 / c)
    return lay if need / 1e9 <= layout.usable_gb(gpu) else None


def plan_rows(cfg: Config, gpus: int, gpu: str, tokens: float, utilisation, batch_tokens, gpus_per_node: int,
              goodput: float) -> list[dict] | None:
    """The plan rows with context parallelism: the config's mesh.context when it is > 1, else
    the smallest degree that fits a sequence when no layout without one does (None: one does).
    A degree must divide the GPUs and cut the sequence into whole chunks."""
    given = cfg.mesh.context
    if given == 1:
        # Only when no layout fits: a config's own layout is kept over the memory estimate
        # (maxfp4.plan.layout), and a config error (a mesh the GPUs cannot hold) is the user's to fix.
        try:
            layout.layout_for(cfg, gpus, gpu, batch_tokens, gpus_per_node)
            return None
        except ConfigError:
            raise
        except UserError as e:
            unsplit = e
    for c in (given,) if given > 1 else CONTEXT_SIZES:
        if gpus % c or cfg.data.seq_len % (2 * c):
            continue
        proxy = proxy_config(cfg, c)
        lay = _fitting_layout(proxy, gpus // c, gpu, batch_tokens, gpus_per_node, c)
        if lay is None and given > 1:  # the config's own choice: planned, its memory note kept
            lay = layout.layout_for(proxy, gpus // c, gpu, batch_tokens, gpus_per_node)
        if lay is not None:
            rows = cost.rows_for(lay, gpus // c, gpu, tokens, utilisation, gpus_per_node, goodput)
            chosen = [] if given > 1 else [f"context: a {cfg.data.seq_len:,}-token sequence does not fit one GPU; "
                                           f"mesh.context={c} is the smallest degree that fits"]
            return rows_with_context(cfg, [dict(r, notes=chosen + r["notes"]) for r in rows], c, gpus, tokens, gpu,
                                     gpus_per_node)
    if given == 1:  # no degree helps either: the error without one says why
        raise unsplit
    raise UserError(f"--gpus {gpus}: no context degree in {CONTEXT_SIZES} dividing the GPUs fits a "
                    f"{cfg.data.seq_len:,}-token sequence of this model on {gpu.upper()}; expected more GPUs or "
                    f"a shorter data.seq_len")
