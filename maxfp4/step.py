"""The one pure train step: ``train_step(state, batch) -> (state, metrics)``.

Gradient accumulation runs inside the step as a scan over microbatches. Each microbatch's loss
is its summed token loss over the valid tokens of the whole global batch, so the accumulated
gradient is the global mean gradient (M microbatches give the same update as one batch, up to
summation order). The FP8 delayed-scaling amaxes come back as the cotangents of the scales and
combine across microbatches by max (see maxfp4.precision.recipes).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jax.sharding import Mesh

from maxfp4.config import Config, ConfigError
from maxfp4.parallel.context import to_zigzag
from maxfp4.parallel.mesh import split_microbatches, traced_in_mesh
from maxfp4.reliability.faults import loss_scale, poison_first_evaluation, poison_gradients
from maxfp4.reliability.guard import guard_metrics, judge
from maxfp4.reliability.rerun import evaluate_with_rerun
from maxfp4.model import get_model
from maxfp4.model.loss import chunked_loss_sum, token_losses
from maxfp4.parallel.pipeline import make_pipelined_loss
from maxfp4.optim import global_norm
from maxfp4.precision import PrecisionPolicy
from maxfp4.precision.catalog import SPECS
from maxfp4.precision.state import scales_of, update_precision_state, with_reciprocals
from maxfp4.model.router_state import combine_cotangents, router_metrics, update_router_state, with_aux_weight
from maxfp4.model_spec import model_spec
from maxfp4.state import TrainState

Batch = dict[str, jax.Array]


def check_loss_chunks(cfg: Config, policy: PrecisionPolicy) -> None:
    """train.loss_chunks > 1 computes the LM head a slice of the sequence at a time, which only
    keeps the recipe's arithmetic when the head is BF16 (no tensor-wide scale or amax)."""
    chunks, recipe = cfg.train.loss_chunks, policy.recipe_for("lm_head", None)
    if chunks > 1 and not SPECS[recipe].token_local:
        local = ", ".join(name for name, spec in SPECS.items() if spec.token_local)
        raise ConfigError(f"train.loss_chunks={chunks}: needs the lm_head layer class in {local}, the "
                          f"precision policy gives it {recipe!r} (its scales span the whole tensor)")


def make_loss_fn(cfg: Config, policy: PrecisionPolicy, mesh: Mesh | None = None,
                 runs_per_row: int | None = None) -> Callable:
    """The loss, traced under ``mesh`` (None: as the caller traces it; the train step traces
    itself under its mesh). ``runs_per_row``: a bound on the segment runs in any row of the batches the loss will see
    (the training data's, from its packing layout), so attention picks its kernel when tracing
    (:func:`maxfp4.model.attention.attend`); None decides on the device per batch."""
    check_loss_chunks(cfg, policy)
    if cfg.mesh.pipeline > 1:  # the stages stream the microbatches themselves
        return traced_in_mesh(make_pipelined_loss(cfg, policy, runs_per_row, mesh), mesh)
    forward = get_model(cfg.model).forward
    chunks = cfg.train.loss_chunks

    def loss_fn(params: Any, scales: Any, batch: Batch, key: jax.Array, denom: jax.Array) -> jax.Array:
        """Summed token loss of ``batch`` divided by ``denom`` (FP32)."""
        # mesh.context > 1: every per-token array in the load-balanced order the context split
        # needs (maxfp4.parallel.context); the summed loss does not depend on the order.
        batch = to_zigzag(batch, cfg.mesh.context)
        scales = with_reciprocals(scales, policy)
        out = forward(params, batch["inputs"], batch["positions"], batch["segment_ids"],
                      cfg=cfg.model, policy=policy, scales=scales, key=key, remat=cfg.train.remat,
                      scan_layers=cfg.train.scan_layers, logits=chunks == 1,
                      runs_per_row=runs_per_row, sequence_parallel=cfg.mesh.sequence_parallel)
        mask_BT = batch["loss_mask"].astype(jnp.float32)
        if chunks == 1:
            return jnp.sum(token_losses(out, batch["targets"]) * mask_BT) / denom
        return chunked_loss_sum(params, out, batch["targets"], mask_BT, chunks, cfg=cfg.model,
                                policy=policy, scales=scales, key=key) / denom
    return traced_in_mesh(loss_fn, mesh)


def make_train_step(cfg: Config, policy: PrecisionPolicy, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, mesh: Mesh | None = None,
                    runs_per_row: int | None = None) -> Callable:
    """The step, traced under ``mesh`` (:func:`maxfp4.parallel.mesh.traced_in_mesh`: the one way the mesh
    reaches the layers, the recipes and the kernels); None: no mesh (one device, tests)."""
    # The stages need the mesh itself (maxfp4.parallel.pipeline); any other loss is traced inside
    # the step, which the mesh already surrounds.
    loss_mesh = mesh if cfg.mesh.pipeline > 1 else None
    grad_fn = jax.value_and_grad(make_loss_fn(cfg, policy, loss_mesh, runs_per_row), argnums=(0, 1))
    m = cfg.train.microbatches
    res = cfg.resilience
    nan_steps = tuple(res.fault.nonfinite_at_steps)
    first_evaluation_nan_steps = tuple(res.fault.transient_nonfinite_at_steps)
    scale_from, scale = res.fault.loss_scale_at_step, res.fault.loss_scale
    moe_blocks = model_spec(cfg.model).blocks_with("moe")

    def loss_and_grads(state: TrainState, batch: Batch, scales: Any, step_key: jax.Array, denom: jax.Array,
                       evaluation: jax.Array | int = 0):
        """The step's loss, gradients and amaxes from its inputs: what a re-run evaluates again
        (``evaluation`` 1; the transient fault strikes evaluation 0 only)."""
        if m == 1 or cfg.mesh.pipeline > 1:
            loss, (grads, amaxes) = grad_fn(state.params, scales, batch, step_key, denom)
        else:
            def accumulate(carry, xs):
                loss_acc, grads_acc, amax_acc = carry
                micro, i = xs
                loss, (grads, amaxes) = grad_fn(state.params, scales, micro,
                                                jax.random.fold_in(step_key, i), denom)
                return (loss_acc + loss, jax.tree.map(jnp.add, grads_acc, grads),
                        combine_cotangents(amax_acc, amaxes)), None

            init = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state.params),
                    jax.tree.map(jnp.zeros_like, scales))
            (loss, grads, amaxes), _ = jax.lax.scan(
                accumulate, init, (split_microbatches(batch, m), jnp.arange(m)))
        if nan_steps:
            grads = poison_gradients(grads, state.step + 1, nan_steps)
        if first_evaluation_nan_steps:
            grads = poison_first_evaluation(grads, jnp.where(evaluation == 0, state.step + 1, 0),
                                            first_evaluation_nan_steps)
        return loss, grads, amaxes

    def train_step(state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        n_tokens = jnp.sum(batch["loss_mask"].astype(jnp.float32))
        denom = jnp.maximum(n_tokens, 1.0)
        if scale_from:
            denom = denom / loss_scale(state.step + 1, scale_from, scale)
        scales = with_aux_weight(scales_of(state.precision), cfg.model.moe.aux_loss_coef / m)
        step_key = jax.random.fold_in(state.rng, state.step)
        rerun = {}
        if res.guard and res.rerun_skipped:  # a bad step is evaluated once more (maxfp4.reliability.rerun)
            def is_bad(results):
                loss, grads, _ = results
                return ~judge(state.guard, loss, global_norm(grads), margin=res.spike_margin, warmup=res.spike_warmup)[0]

            (loss, grads, amaxes), verdict = evaluate_with_rerun(
                lambda i: loss_and_grads(state, batch, scales, step_key, denom, i), is_bad)
            rerun = {"rerun_verdict": verdict}
        else:
            loss, grads, amaxes = loss_and_grads(state, batch, scales, step_key, denom)
        grad_norm = global_norm(grads)

        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        precision = update_precision_state(state.precision, amaxes, policy)
        precision = update_router_state(precision, amaxes, cfg.model.moe.bias_update_rate)
        guard = state.guard
        ok = jnp.array(True)
        if res.guard:
            # A bad step keeps the old state; the step counter still advances (maxfp4.reliability.guard).
            # The old or the new state is selected element-wise rather than by a cond: XLA fuses
            # the select into the optimizer's own update passes (it reads the old values there
            # anyway), while a cond makes the host read the predicate from the device in the
            # middle of every step and only then launch the branch (hybrid-1b on an H100: the
            # select made the FP8 step 1.1-1.8 ms faster than the cond, 2026-11-25).
            ok, guard = judge(state.guard, loss, grad_norm, margin=res.spike_margin, warmup=res.spike_warmup)

            def keep_old_if_bad(new, old):
                return jnp.where(ok, new, old)

            params, opt_state, precision = jax.tree.map(
                keep_old_if_bad, (params, opt_state, precision), (state.params, state.opt_state, state.precision))
        metrics = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": schedule(state.step),
            "tokens": n_tokens,
            **guard_metrics(guard, ok),
            **rerun,
            **router_metrics(amaxes, moe_blocks, m),
        }
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  precision=precision, guard=guard)
        return new_state, metrics

    return traced_in_mesh(train_step, mesh)
