"""The planner (`python -m trainer.plan`): valid layouts only, plan.json, args the trainer accepts,
and the memory model against the parameters a real pipeline rank holds.

One small planning run (tiny config, fixed sentence length, given link, no data loading) is
shared by the tests that read its plan.json.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from models.config import ModelConfig
from models.m2m100 import BlockKind, M2M100Translation
from parallel.pipeline.plan import make_plan
from trainer import plan as planner
from trainer.config.parse import parse_config
from trainer.errors import ConfigError
from trainer.planner import search, space
from trainer.planner.blocks import Shape, block_param_counts, measure_kind_costs
from trainer.planner.cost import CostContext, block_costs, layout_stage_costs, predict_step
from trainer.planner.hardware import LinkModel, device_spec
from trainer.planner.layout import Layout, layout_args
from trainer.run.preflight import validate_early

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    planner.main(
        ["--config", TINY, "--world_size", "2", "--seq_len", "12", "--link_gbps", "1", "--repeats", "1",
         "--remat", "none,full", "--output", str(out), "--max_microbatches", "4", "--keep", "1000",
         "--calibrate", "false"]
    )  # fmt: skip
    return json.loads(out.read_text())


def test_meshes_are_the_ones_parallel_dims_accepts() -> None:
    arch = ModelConfig(vocab_size=100, d_model=48, encoder_attention_heads=3, decoder_attention_heads=3,
                       encoder_ffn_dim=96, decoder_ffn_dim=96)  # fmt: skip
    valid, rejected = space.meshes(world=4, gpus_per_node=2, arch=arch)
    assert sorted((d.pp, d.tp, d.dp) for d in valid) == [(1, 1, 4), (2, 1, 2), (4, 1, 1)]
    reasons = dict(rejected)
    assert "does not divide encoder_attention_heads(3)" in reasons["pp=1 tp=2 dp=2"]
    assert "LOCAL_WORLD_SIZE(2)" in reasons["pp=1 tp=4 dp=1"]


def test_batch_cuts_keep_the_global_batch() -> None:
    cfg = parse_config(["--config", TINY])  # 8 sentences x m=1 x g=1 x dp=2 on 2 ranks
    budget = space.batch_budget(cfg, world=2)
    assert budget.total == 16 and not budget.token_mode
    for dp in (1, 2):
        cuts = list(space.batch_cuts(budget, dp, max_m=64))
        assert cuts and all(b * m * g * dp == 16 for m, g, b in cuts)
    assert list(space.batch_cuts(budget, 3, max_m=64)) == []
    tokens = parse_config(["--config", TINY, "--max_tokens_per_microbatch", "256"])
    tb = space.batch_budget(tokens, world=2)
    assert tb.token_mode and tb.total == 512
    assert all(cap >= tb.longest for _, _, cap in space.batch_cuts(tb, 1, max_m=64))


def test_plan_json_ranks_valid_candidates(tiny_plan: dict) -> None:
    rows = tiny_plan["candidates"]
    assert rows, tiny_plan["rejected_counts"]
    times = [r["predicted_step_time_s"] for r in rows]
    assert times == sorted(times) and all(t > 0 for t in times)
    assert [r["rank"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        assert r["predicted_peak_memory_bytes"] > 0 and r["reason"]
        lay = r["layout"]
        assert lay["pp"] * lay["tp"] * lay["dp"] == 2
        assert lay["microbatch"] * lay["m"] * lay["g"] * lay["dp"] == 16  # the config's global batch
        assert lay["remat"] in ("none", "full")
    assert {(r["layout"]["pp"], r["layout"]["tp"]) for r in rows} == {(1, 1), (2, 1), (1, 2)}
    # dp > 1: every data_parallel_sharding mode is costed and written into the flags
    dp2 = {r["layout"]["sharding"] for r in rows if r["layout"]["dp"] == 2}
    assert dp2 == {"none", "zero1", "fsdp"}
    for r in rows:
        assert r["args"][r["args"].index("--data_parallel_sharding") + 1] == r["layout"]["sharding"]
        # issue 36: every row carried --virtual_pipeline_stages 2, zero_bubble's and 1f1b's too, which the
        # trainer now refuses (docs/training.md); only interleaved_1f1b's flags set it
        assert ("--virtual_pipeline_stages" in r["args"]) == (r["layout"]["schedule"] == "interleaved_1f1b")
    assert {"zero_bubble", "interleaved_1f1b"} <= {r["layout"]["schedule"] for r in rows}
    # interleaved 1F1B needs m % p == 0: the trainer's own check dropped those, with its message
    reasons = [x["reason"] for x in tiny_plan["rejected"]]
    assert any("trainer rejects it" in x and "multiple of pipeline_parallel_size" in x for x in reasons)


def test_candidate_args_run_the_predicted_layout(tiny_plan: dict) -> None:
    for row in tiny_plan["candidates"][:: max(1, len(tiny_plan["candidates"]) // 12)]:
        cfg = parse_config(row["args"])
        dims = validate_early(cfg, world=2)
        lay = row["layout"]
        assert (dims.pp, dims.tp, dims.dp) == (lay["pp"], lay["tp"], lay["dp"])
        p = cfg.parallel
        assert (p.num_microbatches, p.pipeline_schedule, p.virtual_stages, p.activation_checkpointing) == (
            lay["m"], lay["schedule"], lay["v"], lay["remat"])  # fmt: skip
        assert cfg.training.gradient_accumulation_steps == lay["g"]
        assert cfg.training.per_device_train_batch_size == lay["microbatch"]
        if lay["pp"] * lay["v"] > 1:
            assert p.partition_balance() == lay["balance"]


def test_memory_model_counts_the_parameters_each_rank_holds() -> None:
    mc = ModelConfig(vocab_size=300, d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=48)  # fmt: skip
    per_block, table = block_param_counts(mc)
    model = M2M100Translation(mc)
    assert sum(per_block) + table == sum(p.numel() for p in model.parameters()) == mc.num_parameters()
    # 9 blocks, 2 ranks x 2 virtual stages: rank 0 holds both embeddings, rank 1 the head
    balance = (2, 2, 3, 2)
    layout = Layout(2, 1, 1, 2, 1, 2, "interleaved_1f1b", 2, "none", "explicit", balance)
    ctx = CostContext(mc, LinkModel(1e-5, 1e9, 1e-5, 1e9), 2, False, False, 1e-9)
    kinds = measure_kind_costs(mc, Shape(2, 5, 6), "none", bf16=False, repeats=1)
    costs = block_costs(kinds, mc, Shape(2, 5, 6), 1, ctx)
    pred = predict_step(layout, layout_stage_costs(layout, costs, Shape(2, 5, 6), ctx), ctx)
    plan = make_plan(model.blocks, balance, 2, 2, 2, "interleaved_1f1b")
    for rank in range(2):
        held = M2M100Translation(mc).keep_only(plan.rank_blocks(rank))
        assert pred.params_per_pp_rank[rank] == sum(p.numel() for p in held.parameters())
    if ("zbv", 2) in space.schedule_space():  # V placement: rank 0 holds the first and the last stage
        v_layout = replace(layout, schedule="zbv")
        v_pred = predict_step(v_layout, layout_stage_costs(v_layout, costs, Shape(2, 5, 6), ctx), ctx)
        v_plan = make_plan(model.blocks, balance, 2, 2, 2, "zbv")
        for rank in range(2):
            held = M2M100Translation(mc).keep_only(v_plan.rank_blocks(rank))
            assert v_pred.params_per_pp_rank[rank] == sum(p.numel() for p in held.parameters())
    worst = pred.memory
    assert worst["parameters"] == worst["gradients"] == 4 * max(pred.params_per_pp_rank)
    assert worst["optimizer"] == 8 * max(pred.params_per_pp_rank)
    assert pred.peak_memory_bytes == sum(worst.values())
    zero1_layout = replace(layout, dp=2, sharding="zero1")
    zero1_ctx = replace(ctx, gpus_per_node=4)
    zero1 = predict_step(
        zero1_layout, layout_stage_costs(zero1_layout, costs, Shape(2, 5, 6), zero1_ctx), zero1_ctx
    )
    assert zero1.memory["optimizer"] == worst["optimizer"] / 2


def test_tp_rank_is_measured_on_its_shard() -> None:
    """A tp rank's blocks are profiled on its shard (no process group), not scaled from the
    unsharded block: its layers keep fewer bytes, and full remat keeps the layer input whole
    under tp; with sequence parallelism (S = 7 and T = 5 padded to 8 and 6, so a key mask)
    the layer receives the whole input and keeps its T/p split."""
    mc = ModelConfig(vocab_size=200, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)  # fmt: skip
    shape = Shape(2, 7, 5)
    one = measure_kind_costs(mc, shape, "none", bf16=False, timed=False)
    two = measure_kind_costs(mc, shape, "none", bf16=False, timed=False, tp=2)
    for kind in (BlockKind.ENC_LAYER, BlockKind.DEC_LAYER, BlockKind.HEAD):
        assert two[kind].activation_bytes < one[kind].activation_bytes, kind
    full = measure_kind_costs(mc, shape, "full", bf16=False, timed=False, tp=2)
    assert full[BlockKind.ENC_LAYER].activation_bytes == 4 * 2 * 7 * 32
    sp = measure_kind_costs(mc, shape, "full", bf16=False, timed=False, tp=2, sequence_parallel=True)
    assert sp[BlockKind.ENC_LAYER].activation_bytes == 4 * 2 * 8 * 32 + 4 * 2 * 4 * 32 + 2 * 8
    assert sp[BlockKind.DEC_LAYER].activation_bytes == 4 * 2 * (8 + 6) * 32 + 4 * 2 * 3 * 32 + 2 * 8


def test_device_table_errors_name_the_valid_choices() -> None:
    assert device_spec("H100", bf16=True).peak_flops == 989e12
    with pytest.raises(ValueError, match=r"unknown device 'B300'.*'A100', 'H100', 'H200'"):
        device_spec("B300", bf16=True)
    # one ConfigError line each (the entry point: exit 2), not argparse's usage block and SystemExit (issue 36)
    with pytest.raises(ConfigError, match=r"^--gpus_per_node=3 must be >= 1 and divide --world_size=8$"):
        planner.parse_args(["--config", TINY, "--world_size", "8", "--gpus_per_node", "3"])
    with pytest.raises(ConfigError, match=r"^--remat \['sometimes'\] unknown; choose from \['none'"):
        planner.parse_args(["--config", TINY, "--world_size", "2", "--remat", "sometimes"])
    with pytest.raises(ConfigError, match=r"^world_size='two' is not an integer$"):
        planner.parse_args(["--config", TINY, "--world_size", "two"])
    with pytest.raises(ConfigError, match=r"^the following arguments are required: --world_size$"):
        planner.parse_args(["--config", TINY])


def test_memory_limit_drops_layouts_with_the_reason(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    planner.main(
        ["--config", TINY, "--world_size", "2", "--device", "H100", "--device_memory_gib", "0.0005",
         "--seq_len", "12", "--remat", "none", "--schedules", "1f1b", "--max_microbatches", "2",
         "--output", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    fits = result["candidates"]
    assert all(r["predicted_peak_memory_bytes"] <= 0.9 * 0.0005 * 2**30 for r in fits)
    dropped = [x for x in result["rejected"] if x["reason"].startswith("does not fit")]
    assert dropped and "GiB per rank" in dropped[0]["reason"]
    assert result["costs"] == "device table: H100"


def test_block_profile_counts_what_remat_keeps() -> None:
    mc = ModelConfig(vocab_size=200, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)  # fmt: skip
    shape = Shape(2, 7, 5)
    none = measure_kind_costs(mc, shape, "none", bf16=False, timed=False)
    full = measure_kind_costs(mc, shape, "full", bf16=False, timed=False)
    selective = measure_kind_costs(mc, shape, "selective", bf16=False, timed=False)
    for kind in (BlockKind.ENC_LAYER, BlockKind.DEC_LAYER):
        assert full[kind].activation_bytes < selective[kind].activation_bytes < none[kind].activation_bytes
        assert none[kind].forward_s == none[kind].backward_s == 0.0  # timed=False measures bytes only
    # full remat keeps the layer input (B, S, H) fp32; the decoder also the encoder output
    assert full[BlockKind.ENC_LAYER].activation_bytes == 4 * 2 * 7 * 32
    assert full[BlockKind.DEC_LAYER].activation_bytes == 4 * 2 * (7 + 5) * 32


def _calibration_entry(pp: int, dp: int, schedule: str = "1f1b", bound: float = 1.0):  # type: ignore[no-untyped-def]
    link = LinkModel(1e-4, 1e9, 1e-4, 1e9)
    mc = parse_config(["--config", TINY]).model.model_config(1000, {})
    ctx = CostContext(mc, link, 2, False, False, 1e-9)
    layout = Layout(pp, 1, dp, 2, 1, 8, schedule, 1, "none", "uniform", (4, 4) if pp == 2 else (8,))
    from parallel.pipeline.simulate import StageCosts

    sc = StageCosts([0.01] * pp, [0.02] * pp, [0.0] * pp, 1e-4)
    return bound, layout, sc, ctx


def test_calibration_fit_reproduces_its_run_and_scales_the_mesh() -> None:
    """The fitted prediction of the calibration layout is its measured step; other layouts of
    the mesh move by the same compute scale and offset; other meshes are untouched."""
    from trainer.planner import calibrate as cal

    entry = _calibration_entry(2, 1)
    _, layout, sc, ctx = entry
    model_compute = cal.predicted_compute_s(layout, sc)
    assert model_compute == pytest.approx(2 * (0.01 + 0.02) * 2)  # g m (F + I + W), both stages
    fit = cal.fit(layout, sc, ctx, {"step_time_s": 0.5, "compute_s": 2 * model_compute}, [])
    assert fit.compute_scale == pytest.approx(2.0)
    other = _calibration_entry(1, 2)
    [(_, lay, sc2, ctx2), (_, lay_o, sc_o, ctx_o)] = cal.apply([entry, other], {(2, 1, 1, False): fit})
    assert predict_step(lay, sc2, ctx2).step_time_s == pytest.approx(0.5)
    assert list(sc2.forward) == [0.02, 0.02] and sc2.link == sc.link
    assert sc_o is other[2] and ctx_o is other[3]


def test_calibration_layout_is_the_family_s_cheapest_1f1b_or_zero_bubble() -> None:
    from trainer.planner import calibrate as cal

    entries = [_calibration_entry(2, 1, "zero_bubble", 0.1), _calibration_entry(2, 1, "1f1b", 0.3),
               _calibration_entry(2, 1, "1f1b", 0.2), _calibration_entry(1, 2, "1f1b", 0.5),
               _calibration_entry(2, 1, "gpipe", 0.05), _calibration_entry(2, 1, "zbv", 0.01)]  # fmt: skip
    chosen = cal.calibration_layouts(entries)
    assert chosen[(2, 1, 1, False)] is entries[2] and chosen[(1, 1, 2, False)] is entries[3]
    assert chosen[(2, 1, 1, True)] is entries[0] and len(chosen) == 3


def test_calibrate_true_refuses_a_world_this_machine_cannot_run() -> None:
    import argparse

    from trainer.planner import calibrate as cal

    opts = argparse.Namespace(calibrate="true", world_size=10_000)
    with pytest.raises(ValueError, match="--world_size 10000 >"):
        cal.should_calibrate(opts, measured_here=True)
    opts.calibrate = "auto"
    assert cal.should_calibrate(opts, measured_here=True)[0] is False
    assert cal.should_calibrate(opts, measured_here=False) == (
        False,
        "costs come from the device table (--device)",
    )


def test_stage_activation_bytes_match_the_executor_meter() -> None:
    """Summed from per-kind profiles, a stage's bytes equal the meter's count of that stage run
    as one (the encoder output that every decoder layer receives counted once, not per layer)."""
    from models.loss import cross_entropy_sum
    from models.m2m100 import block_specs
    from parallel.pipeline.memory import SavedTensorMeter
    from trainer.planner.blocks import synthetic_batch
    from trainer.planner.cost import stage_activation_bytes

    mc = parse_config(["--config", TINY]).model.model_config(1000, {})
    shape = Shape(4, 10, 13)
    kinds = measure_kind_costs(mc, shape, "none", False, timed=False)
    costs = [kinds[s.kind] for s in block_specs(mc)]
    model = M2M100Translation(mc).train()
    batch = synthetic_batch(mc, shape)
    meter = SavedTensorMeter(model)
    summed_blocks_over = 0
    for lo, hi in [(0, 8), (0, 4), (4, 8), (3, 8), (5, 8), (2, 6), (6, 7)]:
        state: dict = {}
        for spec in model.blocks[:lo]:
            state = {k: v.detach() for k, v in model.run_block(spec, state, batch).items()}
        inputs = {k: v.detach().requires_grad_(True) for k, v in state.items()}
        meter.reset()
        with meter.record("stage", inputs):
            out = model.run_blocks(dict(inputs), batch, model.blocks[lo:hi])
            if "logits" in out:  # the last stage's forward includes its loss
                cross_entropy_sum(out["logits"], batch.labels)
        assert stage_activation_bytes(costs, range(lo, hi)) == meter.held["stage"], (lo, hi)
        summed_blocks_over += sum(c.activation_bytes for c in costs[lo:hi]) > meter.held["stage"]
    assert summed_blocks_over  # the plain sum over blocks does over-count (what this replaces)


def test_validate_runs_in_rounds_and_measures_the_drift(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every round runs each candidate and each calibration layout once; a family's drift is its
    calibration layout's re-measured step over the plan-time one (here the host got 10% slower)."""
    import argparse

    from trainer.planner import report as plan_report

    layout_a = {"pp": 2, "tp": 1, "dp": 1, "m": 1, "g": 1, "microbatch": 16, "schedule": "1f1b", "v": 1,
                "remat": "none", "partition": "uniform", "balance": [4, 4], "token_mode": False}  # fmt: skip
    layout_b = {**layout_a, "schedule": "gpipe"}
    speed = {"cal": 0.44, "a": 0.50, "b": 0.66}  # seconds per step now; the calibration measured 0.40
    calls: list[str] = []

    def fake_run(args: list[str], world: int, out_dir: Path, opts: argparse.Namespace) -> dict[str, float]:
        calls.append(args[0])
        return {"step_time_s": speed[args[0]], "peak_activation_bytes": 10.0, "compute_s": 0.1}

    monkeypatch.setattr(plan_report, "_run_once", fake_run)
    cand = {"predicted_step_time_s": 0.45, "predicted_peak_activation_bytes_per_pp_rank": [8.0, 10.0]}
    result = {
        "candidates": [{**cand, "rank": 1, "args": ["a"], "layout": layout_a},
                       {**cand, "rank": 2, "args": ["b"], "layout": layout_b}],
        "calibration": [{"args": ["cal"], "layout": layout_a, "measured_step_time_s": 0.40}],
    }  # fmt: skip
    opts = argparse.Namespace(validate_dir=str(tmp_path), validate_repeats=2, world_size=2)
    rows = plan_report.validate(result, 2, opts)
    assert calls == ["a", "b", "cal"] * 2
    assert [r["drift"] for r in rows] == pytest.approx([1.1, 1.1])
    assert rows[0]["step_time_error"] == pytest.approx(0.50 / 0.45 - 1)
    assert rows[0]["step_time_error_at_drift"] == pytest.approx(0.50 / (0.45 * 1.1) - 1)
    assert rows[1]["measured_peak_activation_bytes"] == 10.0 and not rows[0]["calibration_layout"]
    text = plan_report.format_validation(rows)
    assert "measured best: #1" in text and "+1.0%" in text


def test_moe_params_memory_and_meshes_follow_expert_parallelism() -> None:
    """NLLB-MoE: per-block counts hold the router and E / ep experts (all E: the model's count),
    the rank's memory shards the experts' state over edp, and ep is searched with the mesh."""
    from trainer.planner.blocks import block_expert_counts, kind_key
    from trainer.planner.moe import a2a_bytes

    mc = ModelConfig(vocab_size=300, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=48, num_experts=4,
                     encoder_sparse_step=2, decoder_sparse_step=2)  # fmt: skip
    per_block, table = block_param_counts(mc)
    assert sum(per_block) + table == sum(p.numel() for p in M2M100Translation(mc).parameters())
    assert sum(per_block) + table == mc.num_parameters()
    one, two = block_expert_counts(mc), block_expert_counts(mc, ep=2)
    assert [x // 2 for x in one] == two and sum(x > 0 for x in one) == 2  # encoder and decoder layer 1
    assert {kind_key(mc, s) for s, x in zip(M2M100Translation(mc).blocks, one) if x} == {
        "enc_layer+moe",
        "dec_layer+moe",
    }
    valid, _ = space.meshes(world=4, gpus_per_node=4, arch=mc)
    assert sorted((d.pp, d.dp, d.ep) for d in valid if d.tp == 1) == [
        (1, 4, 1), (1, 4, 2), (1, 4, 4), (2, 2, 1), (2, 2, 2), (4, 1, 1)
    ]  # fmt: skip
    # 100 kept assignments over ep 4: 75 rows leave, each H wide, both ways, forward and backward
    assert a2a_bytes(100, 4, 32, 4, 2) == 75 * 32 * (4 + 2) * 2
    assert a2a_bytes(100, 4, 32, 4, 2, recompute=True) == 75 * 32 * (4 + 2) * 3
    assert a2a_bytes(100, 1, 32) == 0.0
    layout = Layout(1, 1, 4, 1, 1, 2, "1f1b", 1, "none", "uniform", (len(per_block),), sharding="zero1")
    ctx = CostContext(mc, LinkModel(1e-5, 1e9, 1e-5, 1e9), 4, False, False, 1e-9)
    kinds = measure_kind_costs(mc, Shape(2, 5, 6), "none", bf16=False, repeats=1)
    assert {"enc_layer+moe", "dec_layer+moe"} <= set(kinds)
    preds = {}
    for ep in (1, 4):
        lay = replace(layout, ep=ep)
        costs = block_costs(kinds, mc, Shape(2, 5, 6), 1, ctx, ep)
        preds[ep] = predict_step(lay, layout_stage_costs(lay, costs, Shape(2, 5, 6), ctx), ctx)
    experts = sum(one)
    dense = sum(per_block) + table - experts
    assert preds[1].params_per_pp_rank == [dense + experts]
    assert preds[4].params_per_pp_rank == [dense + experts // 4]
    # zero1: dense moments over dp = 4, the experts' (E / ep each) over edp = 1
    assert preds[4].memory["optimizer"] == pytest.approx(8 * (dense / 4 + experts / 4))
    assert preds[1].memory["optimizer"] == pytest.approx(8 * (dense + experts) / 4)
    assert preds[4].memory["parameters"] < preds[1].memory["parameters"]
    # the trainer's partition counts a sparse layer with this rank's experts too
    from trainer.run.balance import _param_counts

    four, _ = block_param_counts(mc, ep=4)
    got = _param_counts(mc, ep=4)
    assert got[1:] == four[1:] and got[0] == four[0] + table


def test_plan_announces_its_phases_and_counts_the_work(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 30: the NLLB-MoE-54B plan ran 6 minutes without a word before its table. Now each
    phase is announced when it starts, and costing and simulating show a bar (stderr)."""
    import logging
    import re

    caplog.set_level(logging.INFO, logger="trainer.plan")
    planner.main(
        ["--config", TINY, "--world_size", "2", "--seq_len", "12", "--link_gbps", "1", "--repeats", "1",
         "--remat", "none", "--schedules", "1f1b", "--max_microbatches", "2", "--device", "H100",
         "--output", str(tmp_path / "plan.json")]
    )  # fmt: skip
    phases = [r.getMessage() for r in caplog.records if r.getMessage().startswith("phase ")]
    assert [p.split(":")[0] for p in phases] == [f"phase {i}/5" for i in range(1, 6)], phases
    pairs = int(re.search(r"= (\d+) \(mesh, cut\) pairs", phases[1]).group(1))  # type: ignore[union-attr]
    err = capsys.readouterr().err
    assert re.search(rf"plan: cost layouts: 100%\|\S+\| {pairs}/{pairs} .*mesh=pp=", err), err[-2000:]
    assert re.search(r"plan: simulate: 100%\|\S+\| (\d+)/\1 ", err), err[-2000:]


def test_layout_flags_unset_the_configs_virtual_stages_for_other_schedules() -> None:
    """A job on interleaved_1f1b v=4 planned onto zero_bubble: its flags unset the config's
    virtual_pipeline_stages (`null`), which the trainer would refuse with zero_bubble, and they pass
    the trainer's own checks (the planner's TrainerCheck reads the same `layout_fields`)."""
    base = ["--config", TINY, "--pipeline_parallel_size", "2", "--pipeline_schedule", "interleaved_1f1b",
            "--virtual_pipeline_stages", "4", "--num_microbatches", "2"]  # fmt: skip
    job = parse_config(list(base))
    for schedule, v, flag in (("zero_bubble", 1, "null"), ("interleaved_1f1b", 2, "2"), ("1f1b", 1, "null")):
        layout = Layout(2, 1, 1, 2, 1, 8, schedule, v, "none", "uniform")
        args = layout_args(layout, base, job.parallel)
        assert args[len(base) :].count("--virtual_pipeline_stages") == 1
        assert args[args.index("--virtual_pipeline_stages", len(base)) + 1] == flag
        cfg = parse_config(args)
        assert (cfg.parallel.pipeline_schedule, cfg.parallel.virtual_stages) == (schedule, v)
        validate_early(cfg, world=2)
        assert search.TrainerCheck(job, 2)(layout) == ""
    with pytest.raises(
        ConfigError, match=r"^virtual_pipeline_stages=2 does nothing with pipeline_schedule='zero_bubble'"
    ):
        validate_early(
            parse_config(
                [*base[:-4], "--pipeline_schedule", "zero_bubble", "--virtual_pipeline_stages", "2"]
            ),
            2,
        )
    tiny = parse_config(["--config", TINY])  # a config that sets none: no flag at all for zero_bubble
    assert "--virtual_pipeline_stages" not in layout_args(
        Layout(2, 1, 1, 2, 1, 8, "zero_bubble", 1, "none", "uniform"), [], tiny.parallel
    )
