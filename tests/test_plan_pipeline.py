"""The planner's pipeline stages: the trainer's schedule and cut, priced; exactly the stage
layouts the trainer runs offered, and the config's own refused with the trainer's line; the
measured pipeline step, the cluster-scale plans of docs/PLANNING.md, and the refusals."""

import importlib.util
import json
from types import SimpleNamespace

import pytest

from maxfp4.config import ConfigError, load_config
from maxfp4.parallel.mesh import resolve_mesh_shape
from maxfp4.parallel.pipeline_schedule import bubble_fraction, schedule_table
from maxfp4.parallel.pipeline_stages import check_stages, stage_model
from maxfp4.plan import command as plan, context as context_plan, cost as plan_model, layout, rates
from maxfp4.plan.layout import _with
from maxfp4.model_spec import model_spec
from maxfp4.plan.stages import PlanMesh

WIDE_HYBRID = ["model.d_model=512", "model.d_ff=8192", "data.seq_len=2048", "data.global_batch=16",
               "train.microbatches=8", "mesh.data=1"]


def test_stages_are_the_trainers_cut_and_its_ticks_set_the_step():
    """A hybrid of Mamba-2, MLP and attention blocks (each costing differently), in the stages
    the trainer runs: the FLOP-balanced cut is the trainer's equal cut (each stage the stage
    model's blocks, in order); the planner's block time with stages is the rows of the schedule
    table the loss runs x the costliest stage's time on one microbatch, and it holds every
    tick's activations."""
    cfg = load_config("configs/hybrid-tiny.yaml", [*WIDE_HYBRID, "model.pattern=-*M-*M-*M-*M"])
    times = plan_model.block_seconds_per_token(cfg, 1, "bf16", "h200")
    assert len(set(times)) == 3
    for stages, repeats in [(2, 1), (4, 1), (2, 2)]:
        mesh = PlanMesh(1, 1, 1, stages, repeats)
        c = _with(cfg, 16, mesh, 8)
        check_stages(c)  # the trainer runs it
        part = stage_model(cfg.model, stages, repeats).n_layers
        split = plan_model.stage_split(c, mesh)
        assert split.chunks == tuple(tuple(range(a, a + part)) for a in range(0, 12, part))
        table = schedule_table(stages, repeats, 8)
        slowest = max(sum(times[b] for b in chunk) for chunk in split.chunks)
        want = len(table) * slowest / sum(times) / 8
        assert plan_model.stage_factor(c, mesh, "bf16", "h200") == pytest.approx(want, rel=1e-12)
        assert plan_model.in_flight_share(c, mesh) == len(table) / (repeats * 8)


def test_the_planner_offers_exactly_the_stage_layouts_the_trainer_runs():
    """Every mesh and microbatch count of the layout search on 24 GPUs, against the trainer's
    start-up check of the config the planner hands over: offered if and only if it passes. Alike
    and unequal stages (other block types, or recipes that change every 4 blocks) both run, as
    slots; with repeats the microbatches go in groups of P."""
    seen = {}
    rules = "[{layers: '::4', recipe: fp8_current}]"
    for pattern, rule in (("M*M*M*M*M*M*", "[]"), ("M*M*M*M*M*M*", rules)):
        cfg = load_config("configs/hybrid-tiny.yaml", [f"model.pattern={pattern}", f"precision.rules={rule}"])
        for across in (False, True):
            for mesh in layout.candidate_meshes(cfg.model, 24, 8, across):
                offered = layout.microbatch_options(cfg.model, mesh, 12) or []
                for micro in (1, 2, 3, 4, 6, 12):
                    try:
                        check_stages(_with(cfg, 12 * mesh.batch_shards, mesh, micro))
                        runs = True
                    except ConfigError:
                        runs = False
                    assert (micro in offered) == runs, (pattern, rule, mesh, micro)
                    seen.setdefault((pattern, rule, mesh.pipeline, mesh.repeats, micro), runs)
    twelve = "M*M*M*M*M*M*"
    assert seen[twelve, "[]", 3, 2, 6] and not seen[twelve, "[]", 3, 2, 4]  # repeats: groups of 3
    assert seen[twelve, "[]", 2, 1, 2] and not seen[twelve, "[]", 2, 1, 1]  # at least one a stage
    assert seen[twelve, "[]", 4, 1, 4] and seen[twelve, rules, 2, 1, 2]  # unequal stages


def test_a_config_whose_stages_the_trainer_refuses_is_refused_or_replaced(capsys):
    """More stages than blocks: the planner exits with the trainer's own line. Microbatches that
    do not go round the repeats in groups: the layout is replaced, by one the trainer runs."""
    overrides = ["model.pattern=-*M", "mesh.data=1", "mesh.pipeline=3", "mesh.pipeline_repeats=2",
                 "train.microbatches=3", "data.global_batch=12"]
    cfg = load_config("configs/hybrid-tiny.yaml", overrides)
    with pytest.raises(ConfigError) as trainer:
        check_stages(cfg)
    assert plan.main(["configs/hybrid-tiny.yaml", *overrides, "--gpus", "3", "--gpu", "h100", "--tokens", "1e9"]) == 2
    assert capsys.readouterr().err == f"error: {trainer.value}\n"
    cfg = load_config("configs/quickstart.yaml", ["mesh.data=1", "mesh.pipeline=2", "mesh.pipeline_repeats=2",
                                                  "train.microbatches=3", "data.global_batch=12"])
    chosen = layout.layout_for(cfg, 2, "h100")
    assert chosen.chosen and chosen.reasons[0].startswith(
        "layout chosen because train.microbatches=3: expected a multiple of mesh.pipeline=2")
    check_stages(chosen.cfg)


def test_the_measured_pipeline_and_context_steps_are_within_15_percent():
    """dense-1p3b on two H200s, cuDNN's attention in the stages and on the context ranks
    (docs/PERFORMANCE.md, 2026-11-28): pipeline=2 with 8 microbatches at 1,024 and 2,048 tokens,
    with 2 repeats at 2,048, their fsdp=2 twin at 2,048 and the XLA-attention twin at 1,024;
    context=2 at 16,384 tokens; and every context row (the 8B models' on two and four H200s too,
    2026-11-29), planned at its own degree. The three stage layouts are planned as measured (the
    repeats included) and none is charged XLA's attention. (The 8B models' pipelined rows are
    held to the goal with every other row by tests/test_plan.py's calibration test.)"""
    spec = importlib.util.spec_from_file_location("plan_calibration", "benchmarks/plan_calibration.py")
    calibration = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibration)
    rows = [r for r in calibration.MEASURED if r[0].startswith("dense-1p3b") and "B=16 T=" in r[0]]
    assert len(rows) == 5
    staged = []
    for label, path, overrides, gpus, gpu, precision, step_ms, _, _ in rows:
        cfg = load_config(path, overrides)
        mesh = PlanMesh(*resolve_mesh_shape(cfg.mesh, gpus), cfg.mesh.pipeline_repeats)
        predicted = plan_model.project(cfg, mesh, gpu, precision)["step_time_s"] * 1e3
        assert abs(predicted / step_ms - 1) <= calibration.GOAL, (label, predicted, step_ms)
        assert plan_model.runs_xla_attention(cfg) == ("xla-attention" in label)
        if mesh.pipeline > 1:
            staged.append((mesh, cfg.train.microbatches))
    assert staged == [(PlanMesh(1, 1, 1, 2), 8), (PlanMesh(1, 1, 1, 2), 8), (PlanMesh(1, 1, 1, 2, 2), 8)]
    # Each split's rate is fitted at its head dim (rates.py); the named misses within their bound.
    for (label, path, overrides, gpus, gpu, precision, step_ms, counted) in calibration.MEASURED_CONTEXT:
        bound = calibration.STEP_BOUND_UNEXPLAINED if label in calibration.STEP_UNEXPLAINED else calibration.GOAL
        bound = bound if counted else 0.30
        cfg = load_config(path, overrides)
        [row] = [r for r in context_plan.plan_rows(cfg, gpus, gpu, 1e9, None, None, 8, 0.9)
                 if r["precision"] == precision]
        assert row["context"] == gpus and abs(row["step_time_s"] * 1e3 / step_ms - 1) <= bound, (label, row["step_time_s"])


def test_context_attention_is_charged_its_causal_work_at_the_split_rate():
    """A context rank's attention beyond its proxy's (T/C tokens, causal cuDNN): the causal work
    of a token at T, at the rate of cuDNN's per-chunk kernels (auto) or of XLA's (xla), minus the
    proxy's, x 4/3 under full remat."""
    t, c = 16384, 4
    for attention in ("auto", "xla"):
        cfg = load_config("configs/dense-1p3b.yaml", [f"data.seq_len={t}", f"model.attention={attention}",
                                                      "train.remat=full"])
        spec = model_spec(cfg.model)
        causal, proxy = spec.attention_flops_per_token(t), spec.attention_flops_per_token(t // c)
        proxy_rate = plan_model.attention_tflops("h100", xla=attention == "xla") * 1e12
        split_rate = proxy_rate if attention == "xla" else rates.split_attention_tflops("h100", 64) * 1e12
        want = causal / split_rate - proxy / proxy_rate
        got = context_plan.split_attention_seconds_per_token(cfg, c, "h100")
        assert got == pytest.approx(want * 4 / 3, rel=1e-12), attention


def test_stages_keep_their_own_blocks_and_hold_every_microbatch():
    """At pipeline=4 a device keeps a quarter of the blocks' state (the embedding and LM head on
    every stage), one gradient buffer, and the saved activations of all its microbatches plus
    the fill and drain ticks; the hand-overs are exposed, twice a tick, over InfiniBand once the
    stages span nodes."""
    cfg = load_config("configs/llama3-70b.yaml", ["data.global_batch=64", "mesh.data=1"])
    params = plan_model.param_count(cfg.model)
    spec = model_spec(cfg.model)
    other = params - spec.block_matmul_params
    flat, staged = PlanMesh(1, 8, 1), PlanMesh(1, 8, 1, 4)
    c1, c4 = _with(cfg, 64, flat, 16, "full"), _with(cfg, 64, staged, 16, "full")
    one = plan_model.memory_per_device(c1, flat, params, "bf16", "full")
    four = plan_model.memory_per_device(c4, staged, params, "bf16", "full")
    assert four["master"] == pytest.approx((spec.block_matmul_params / 4 + other) / 8 * 4)
    assert one["grads"] == 2 * one["master"] and four["grads"] == four["master"]
    saved = 2 * cfg.model.d_model * 20 * 64 * 8192 / 8  # block inputs (full remat) of 20 blocks, all rows
    recompute = spec.activation_bytes_per_token(spec.blocks[0], "none") * 64 * 8192 / 8 / 16  # one block of one microbatch, being recomputed
    assert four["activations"] == pytest.approx(saved * (16 + 3) / 16 + recompute)
    exposed = {}
    for gpus_per_node in (8, 64):
        exposed[gpus_per_node] = plan_model.comm_seconds(c4, staged, params, "bf16", "h100", gpus_per_node)[0]
    handed = 2 * (16 + 3) * 64 * 8192 / 8 / 16 * cfg.model.d_model * 2
    assert exposed[8] == pytest.approx(handed / (plan_model.IB_GBS * 1e9))
    assert exposed[64] == pytest.approx(handed / (plan_model.GPUS["h100"]["nvlink_gbs"] * 1e9))
    # Overlapped (mesh.pipeline_overlap): the hand-overs of the longer schedule (16 + 2 x 3
    # ticks) move from exposed to overlappable, and every tick's activations are held
    overlapped = staged._replace(overlap=True)
    c4o = _with(cfg, 64, overlapped, 16, "full")
    assert c4o.mesh.pipeline_overlap and overlapped.lag == 2
    check_stages(c4o)
    exposed_o, overlappable_o = plan_model.comm_seconds(c4o, overlapped, params, "bf16", "h100", 8)
    _, overlappable = plan_model.comm_seconds(c4, staged, params, "bf16", "h100", 8)
    handed_o = 2 * (16 + 6) * 64 * 8192 / 8 / 16 * cfg.model.d_model * 2
    assert exposed_o == 0.0
    fsdp_o = overlappable_o - handed_o / (plan_model.IB_GBS * 1e9)
    # FSDP gathers the blocks once a tick of the longer pass (the embedding's sums do not grow)
    assert overlappable < fsdp_o < overlappable * (16 + 6) / (16 + 3)
    four_o = plan_model.memory_per_device(c4o, overlapped, params, "bf16", "full")
    assert four_o["activations"] == pytest.approx(saved * (16 + 6) / 16 + recompute)
    row = plan_model.project(c4o, overlapped, "h100", "bf16")
    assert row["pipeline_bubble"] == pytest.approx(6 / 22) and row["mesh"]["overlap"] is True


# ----------------------------------------------------------------------------- at cluster scale

B405 = ["model.d_model=16384", "model.n_layers=126", "model.n_heads=128", "model.d_ff=53248"]


def _plan(args, capsys):
    assert plan.main([*args, "--gpu", "h100", "--json"]) == 0
    return {r["precision"]: r for r in json.loads(capsys.readouterr().out)}


def test_cluster_scale_plans_of_the_three_large_models(capsys):
    """docs/PLANNING.md, "Pipeline stages at scale": the planner's choices for Llama 3 70B on
    4,096 H100s (BF16), Llama 3 405B on 16,384 (16M tokens a step) and Nemotron-H 56B on 6,144
    (FP8). The goals (40%, 38%, 35%) are not reached, and FSDP x tensor across nodes is still
    chosen (29%, 30%, 32%). With cuDNN's attention in the stages the 70B stage layout 128 x p2 x
    f2 x t8, 8 repeats, 2 microbatches, no remat (which the chooser does not try under the
    config's full remat) would be level with the chosen mesh (its hand-overs split over tensor,
    it still gathers FSDP over InfiniBand every tick), but does not fit: the copy of its 8
    stages' FP32 weights and their gradient that each step gathers is 17 GB a GPU. The 56B hybrid's pattern runs in unequal
    stages (``--stages``), a point under the chosen mesh at its batch (M = P = 2: an 11%
    bubble). These are model outputs, not measurements."""
    llama70 = _plan(["configs/llama3-70b.yaml", "--gpus", "4096", "--tokens", "15e12"], capsys)["bf16"]
    assert llama70["fits"] and llama70["gpus"] == 4096 and 0.27 <= llama70["mfu"] < 0.31
    assert llama70["mesh"] == {"data": 128, "fsdp": 4, "tensor": 8, "pipeline": 1, "repeats": 1, "overlap": False, "shard_optimizer": False}
    cfg = load_config("configs/llama3-70b.yaml")
    stages = PlanMesh(128, 2, 8, 2, 8)
    staged = plan_model.project(_with(cfg, 512, stages, 2, "none"), stages, "h100", "bf16")
    gathered = staged["memory_breakdown_gb"]["gathered_stages"]
    # the FP32 copy and gradient of the blocks the device keeps state for: twice their master weights
    blocks = model_spec(cfg.model).block_matmul_params / plan_model.param_count(cfg.model)
    assert gathered == pytest.approx(2 * staged["memory_breakdown_gb"]["master"] * blocks, rel=0.05)
    usable = plan_model.USABLE_MEMORY * 80
    assert not staged["fits"] and staged["memory_per_device_gb"] - gathered <= usable
    assert abs(staged["mfu"] - llama70["mfu"]) <= 0.01
    llama405 = _plan(["configs/llama3-70b.yaml", *B405, "--gpus", "16384", "--tokens", "15.6e12",
                      "--batch-tokens", "16e6"], capsys)["bf16"]
    assert llama405["fits"] and 0.28 <= llama405["mfu"] < 0.32 and llama405["mesh"]["pipeline"] == 1
    nemotron = _plan(["configs/nemotron-h-56b.yaml", "--gpus", "6144", "--tokens", "20e12"], capsys)
    fp8 = nemotron["fp8"]
    assert fp8["fits"] and fp8["mesh"]["fsdp"] * fp8["mesh"]["tensor"] <= 16  # 2 nodes a model group (6 before)
    assert 0.30 <= fp8["mfu"] < 0.35 and fp8["mfu"] > nemotron["bf16"]["mfu"]
    staged = _plan(["configs/nemotron-h-56b.yaml", "--gpus", "6144", "--tokens", "20e12", "--stages"], capsys)["fp8"]
    assert staged["fits"] and staged["mesh"]["pipeline"] > 1 and 0.27 <= staged["mfu"] < fp8["mfu"]


def test_a_config_with_stages_is_planned_as_written_and_prints_its_bubble(capsys):
    args = ["configs/llama3-70b.yaml", "mesh.data=4", "mesh.pipeline=4", "mesh.fsdp=8", "train.microbatches=8",
            "data.global_batch=256", "--gpus", "128", "--gpu", "h100", "--tokens", "1e12"]
    assert plan.main(args) == 0
    out = capsys.readouterr().out
    assert "mesh data=4 x pipeline=4 x fsdp=8 x tensor=1" in out
    assert f"(bubble {bubble_fraction(4, 8):.1%})" in out and "layout: the config's" in out
    # the nvfp4 row's preset keeps BF16 ends: the stages run them as slots, so no note
    assert "NVFP4 preset" not in out
    rows = _plan(args[:-4] + ["--gpus", "128", "--tokens", "1e12"], capsys)
    assert rows["bf16"]["pipeline_bubble"] == pytest.approx(3 / 11)
    assert rows["bf16"]["mesh"] == {"data": 4, "fsdp": 8, "tensor": 1, "pipeline": 4, "repeats": 1, "overlap": False, "shard_optimizer": False}


def test_refusals_are_one_line(capsys):
    tiny = ["configs/quickstart.yaml", "--gpu", "h100", "--tokens", "1e9"]
    assert plan.main([*tiny, "mesh.data=1", "mesh.pipeline=16", "--gpus", "16"]) == 2
    err = capsys.readouterr().err
    assert err == "error: mesh.pipeline=16: 16 stages for the model's 4 blocks; expected at most 4\n"
    with pytest.raises(ConfigError, match=r"^mesh.context=2: .*expected mesh.context=1$"):
        resolve_mesh_shape(SimpleNamespace(data=-1, pipeline=1, fsdp=1, context=2, expert=1, tensor=1), 8)
    # microbatches that cannot fill the stages: the config's layout is replaced, and the reason printed
    assert plan.main([*tiny, "mesh.data=1", "mesh.pipeline=2", "train.microbatches=1", "--gpus", "2"]) == 0
    assert capsys.readouterr().out.startswith(
        "layout chosen because train.microbatches=1: expected at least mesh.pipeline=2 microbatches")


def test_a_stage_keeps_state_for_every_expert_of_its_blocks_and_none_of_the_others():
    """A mixture-of-experts stack at pipeline=2: a device keeps master weights, moments and
    gradients for half the blocks' weights, every expert of them (what memory holds, though a
    token passes through top_k), and the embedding, head and norms whole over the stages."""
    from maxfp4.model_spec import model_spec
    from maxfp4.plan import cost
    from maxfp4.plan.stages import PlanMesh
    cfg = load_config("configs/moe-1b-active.yaml", [])
    params = cost.param_count(cfg.model)
    blocks = model_spec(cfg.model).blocks
    stored = sum(b.matmul_params_total for b in blocks)
    assert stored > sum(b.matmul_params for b in blocks)  # top_k of the experts is less
    one = cost.state_params_per_device(cfg, params, PlanMesh(1, 1, 1))
    two = cost.state_params_per_device(cfg, params, PlanMesh(1, 1, 1, pipeline=2))
    assert one == params
    assert two == pytest.approx(stored / 2 + (params - stored), rel=1e-9)


def test_the_expert_axis_divides_the_experts_state_and_working_copy_in_the_memory_model():
    """mesh.expert=2 on moe-1b-active: a device keeps state for half of every E block's
    experts (the rest of the model whole over expert), and its working copy of a block holds
    half of them: the preflight's estimate (the same model) no longer counts them all."""
    from maxfp4.model_spec import model_spec
    from maxfp4.plan import cost
    from maxfp4.plan.stages import PlanMesh
    one = load_config("configs/moe-1b-active.yaml", ["mesh.data=2"])
    two = load_config("configs/moe-1b-active.yaml", ["mesh.data=1", "mesh.expert=2"])
    params = cost.param_count(one.model)
    experts = sum(lin.params_total for b in model_spec(one.model).blocks for lin in b.linears if lin.experts)
    mesh = PlanMesh.of(resolve_mesh_shape(two.mesh, 2), two.mesh)
    assert mesh == PlanMesh.of(resolve_mesh_shape(one.mesh, 2), one.mesh)  # expert modelled as data outside
    assert cost.state_params_per_device(one, params, mesh) == params
    assert cost.state_params_per_device(two, params, mesh) == pytest.approx(params - experts / 2, rel=1e-9)
    m1 = cost.memory_per_device(one, mesh, params, "bf16", "full")
    m2 = cost.memory_per_device(two, mesh, params, "bf16", "full")
    assert m2["master"] == pytest.approx(m1["master"] - experts / 2 * cost.MASTER_BYTES, rel=1e-9)
    assert m2["working_copy"] < m1["working_copy"]


def test_stages_of_rows_that_may_hold_several_documents_are_priced_on_xlas_attention():
    """Pipeline stages run XLA's attention for rows of several documents (cuDNN's packed and
    masked kernels do not compile inside them): the planner prices a stage layout on real data
    at XLA's rate, on synthetic rows of one document at cuDNN's, and a layout without stages on
    cuDNN's either way."""
    import dataclasses
    cfg = load_config("configs/llama3-8b.yaml", ["mesh.data=1"])
    text = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="builtin"))
    stages, flat = PlanMesh(1, 2, 1, 2), PlanMesh(1, 4, 1)

    def step_s(c, mesh):
        return plan_model.project(_with(c, 16, mesh, 8), mesh, "h100", "bf16")["step_time_s"]

    assert not plan_model.runs_xla_attention(_with(cfg, 16, stages, 8))
    assert plan_model.runs_xla_attention(_with(text, 16, stages, 8))
    assert not plan_model.runs_xla_attention(_with(text, 16, flat, 8))
    assert step_s(text, stages) > 1.2 * step_s(cfg, stages)
    assert step_s(text, flat) == pytest.approx(step_s(cfg, flat), rel=1e-9)
