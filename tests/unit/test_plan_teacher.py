"""The planner's distillation teacher (`trainer.planner.teacher`): what a teacher adds to a layout.

Its weights per pp rank are the working dtype's bytes of the parameters the trainer's own cut puts
there (`trainer.run.distill.build_teacher`: by parameters over the student's pp stages, E / ep
experts), the last rank adds the flush's hidden states, the step adds g forward-only flushes of
its pipeline, and the student's last stage its head per micro-batch. A dense student may spread
an NLLB-MoE teacher's experts over ep: the meshes searched follow the teacher's experts.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from models.config import ModelConfig
from models.m2m100 import M2M100Translation
from parallel.pipeline.plan import make_plan
from parallel.pipeline.profile import BlockPhases
from trainer.planner import space
from trainer.planner.blocks import Shape, block_param_counts
from trainer.planner.cost import CostContext, predict_step
from trainer.planner.hardware import LinkModel
from trainer.planner.layout import Layout
from trainer.planner.teacher import TeacherBlocks, teacher_layout, teacher_step
from trainer.run.balance import param_partition

TEACHER = ModelConfig(vocab_size=300, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_experts=4,
                      encoder_sparse_step=2, decoder_sparse_step=2)  # fmt: skip
STUDENT = ModelConfig(vocab_size=300, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                      decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)  # fmt: skip
LINK = LinkModel(0.0, 1e12, 0.0, 1e12)  # free: the pipeline's makespan is its compute


def _blocks(ep: int, fwd: float = 1.0) -> TeacherBlocks:
    n = TEACHER.encoder_layers + TEACHER.decoder_layers + 4
    costs = tuple(BlockPhases(fwd, 2 * fwd, 2 * fwd, 0.0, 1000) for _ in range(n))
    return TeacherBlocks(TEACHER, costs, Shape(2, 5, 6), 1, ep)


def test_teacher_weights_time_and_states_per_rank() -> None:
    layout = Layout(2, 1, 2, 4, 3, 2, "1f1b", 1, "none", "uniform", (4, 4), ep=2)
    step = teacher_step(layout, _blocks(ep=2), LINK, 8, half=True)
    lay = teacher_layout(layout, TEACHER)
    assert lay.balance == tuple(param_partition(TEACHER, 2, 2)) and lay.schedule == "gpipe"
    # the parameters the trainer's stage-local build gives each pp rank, E / ep experts each
    plan = make_plan(M2M100Translation(TEACHER).blocks, lay.balance, 2, 1, 4, "gpipe")
    per_block, table = block_param_counts(TEACHER, 1, 2)
    for rank in range(2):
        held = M2M100Translation(TEACHER).keep_only(plan.rank_blocks(rank))
        experts = sum(p.numel() for n, p in held.named_parameters() if ".experts." in n)
        assert step.params_per_pp_rank[rank] == sum(p.numel() for p in held.parameters()) - experts // 2
        assert step.startup_bytes_per_pp_rank[rank] == 2 * step.params_per_pp_rank[rank]  # bf16
    states = 4 * 2 * 6 * TEACHER.d_model * 2  # m x (b t H) x bf16, on the last stage's rank
    assert step.bytes_per_pp_rank[1] - step.startup_bytes_per_pp_rank[1] > states
    assert step.bytes_per_pp_rank[0] == step.startup_bytes_per_pp_rank[0] + 1000  # one block's transient
    # g forward-only flushes of balanced-ish stages: at least g (m + p - 1) of the slower stage's
    stages = [k - (1.0 if s == 1 else 0.0) for s, k in enumerate(lay.balance)]  # the head runs in the KD loss
    assert step.forward_s == pytest.approx(3 * (4 * max(stages) + min(stages)))
    assert step.kd_s == 1.0  # the head's forward, on the student's last stage


def test_predict_step_adds_the_teacher() -> None:
    from trainer.planner.cost import layout_stage_costs

    layout = Layout(2, 1, 2, 4, 1, 2, "1f1b", 1, "none", "uniform", (4, 4), ep=2)
    ctx = CostContext(STUDENT, LINK, 8, True, False, 0.0)
    costs = [BlockPhases(1.0, 2.0, 2.0, 0.0, 100) for _ in range(8)]
    sc = layout_stage_costs(layout, costs, Shape(2, 5, 6), ctx)
    plain = predict_step(layout, sc, ctx)
    distilled = predict_step(layout, sc, replace(ctx, teacher=_blocks(ep=2)))
    assert distilled.teacher_forward_s > 0
    assert distilled.step_time_s >= plain.step_time_s + distilled.teacher_forward_s
    assert distilled.memory["teacher"] > 0 and "teacher" not in plain.memory
    assert distilled.startup_memory_bytes > plain.startup_memory_bytes


def test_meshes_spread_a_sparse_teachers_experts_over_a_dense_student() -> None:
    alone, _ = space.meshes(world=4, gpus_per_node=4, arch=STUDENT)
    assert {d.ep for d in alone} == {1}
    with_teacher, _ = space.meshes(world=4, gpus_per_node=4, arch=STUDENT, teacher=TEACHER)
    assert sorted((d.pp, d.dp, d.ep) for d in with_teacher if d.tp == 1) == [
        (1, 4, 1), (1, 4, 2), (1, 4, 4), (2, 2, 1), (2, 2, 2), (4, 1, 1)
    ]  # fmt: skip
