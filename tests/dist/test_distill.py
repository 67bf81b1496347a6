"""Word-level distillation through the real trainer (issue 35), on one gloo group per world size.

The contracts: the student's losses (and their CE and KD parts) on pp2 x tp2 x dp2 equal one
process (rel 1e-5, fp32, dropout off) with a dense teacher (a checkpoint of ours, saved by one process, read by DCP onto the mesh) and with an NLLB-MoE
teacher on ep2 (an HF directory);
`distillation_alpha: 0` reproduces plain training bit for bit; the teacher's weights end every
run as they were read (every rank's shard, bit for bit; an HF teacher's as its files hold them),
frozen; a run that dies after its step-2
checkpoint (kill -9: nothing but the committed checkpoint survives) resumes with the same steps
3-5; the vocab-parallel KD loss equals the full-vocabulary reference (fp64) with padded columns.
"""

from __future__ import annotations

import pytest

from tests.dist.distill_workers import distill_cases, make_teachers
from tests.dist.harness import run_distributed
from tests.dist.train_workers import base_config
from tests.dist.train_workers import mesh_overrides as mesh

TOL = 1e-5
# The checkpoint teacher starts from the student's own initial weights (same seed): another seed for
# the distilled student, so the KD term is not near 0 (where it is a difference of near-equal logsumexps)
DENSE_KD = {"distillation_temperature": 2.0, "seed": 7}
pytestmark = [pytest.mark.dist, pytest.mark.timeout(1500)]


def _reference_group(rank: int, world: int, base: dict, tmp: str) -> tuple[dict, list]:
    """One process: plain training (its tokenizer becomes the teachers', its last checkpoint the
    dense teacher), then the NLLB-MoE teacher, then alpha 0 and the two distilled students."""
    plain = distill_cases(rank, world, base, [mesh()])
    teachers = make_teachers(f"{base['output_dir']}-0/tokenizer", tmp)
    teachers["dense"] = f"{base['output_dir']}-0/checkpoint-5"  # one of our checkpoints, saved by one process
    tok = {"tokenizer_name": f"{base['output_dir']}-0/tokenizer"}
    cases = [
        mesh(teacher_model_name_or_path=teachers["dense"], distillation_alpha=0.0, output_dir=f"{tmp}/a0", **tok),
        mesh(teacher_model_name_or_path=teachers["dense"], output_dir=f"{tmp}/d", **DENSE_KD, **tok),
        mesh(teacher_model_name_or_path=teachers["moe"], output_dir=f"{tmp}/m", **tok),
    ]
    return teachers, plain + distill_cases(rank, world, base, cases)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict, list, dict]:
    tmp = str(tmp_path_factory.mktemp("distill"))
    base = base_config(tmp)
    [(teachers, results)] = run_distributed(_reference_group, 1, args=(base, tmp), timeout=600)
    return teachers, results, base


def _relative(a: list, b: list) -> float:
    """Max relative error of each step's loss, grad norm and label_loss, and of its kd_loss relative
    to the loss: a small KL is a difference of near-equal logsumexps (fp32 cancellation, summed in
    another order on every mesh), so its own relative error says little."""
    rel = max(abs(x[c] - y[c]) / abs(y[c]) for x, y in zip(a, b) for c in (1, 2, 3))
    return max(rel, max(abs(x[4] - y[4]) / abs(y[1]) for x, y in zip(a, b)))


def test_alpha_zero_is_plain_training_and_the_teacher_is_untouched(reference) -> None:
    _, results, _ = reference
    (plain, _), (alpha0, no_teacher), (dense, dense_ok), (moe, moe_ok) = results
    assert [r[:3] for r in alpha0] == [r[:3] for r in plain], "alpha 0 is not plain training, bit for bit"
    assert no_teacher is None and alpha0[0][3] is None  # the teacher was not even loaded
    assert dense_ok and moe_ok, "a teacher's weights changed, or it was not frozen"
    for hist in (dense, moe):
        assert [r[0] for r in hist] == [1, 2, 3, 4, 5]
        for _, loss, _, label, kd in hist:
            assert kd > 0 and loss == pytest.approx(0.5 * label + 0.5 * kd, rel=1e-5)
    assert abs(dense[-1][1] - plain[-1][1]) > 1e-3, "distillation changed nothing"
    assert min(r[4] for r in dense + moe) > 0.01, "the KD terms are too small to show parity"


def test_3d_students_match_one_process_and_resume_exactly(reference, tmp_path) -> None:
    """pp2 x tp2 x dp2 (m=2) against one process, dense teacher (T=2) and NLLB-MoE teacher on ep2;
    the dense run saves at step 2 and a new run resumes from that checkpoint alone. The same group
    first checks the vocab-parallel KD loss (tp4, V = 53 padded to 56) against full logits (fp64)."""
    teachers, results, base = reference
    tok = {"tokenizer_name": f"{base['output_dir']}-0/tokenizer"}
    tmp = str(tmp_path)
    cases = [
        mesh(pp=2, tp=2, dp=2, m=2, teacher_model_name_or_path=teachers["dense"], save_steps=2,
             output_dir=f"{tmp}/d", **DENSE_KD, **tok),
        mesh(pp=2, tp=2, dp=2, m=2, expert_parallel_size=2, teacher_model_name_or_path=teachers["moe"],
             output_dir=f"{tmp}/m", **tok),
        mesh(pp=2, tp=2, dp=2, m=2, teacher_model_name_or_path=teachers["dense"],
             resume_from_checkpoint=f"{tmp}/d/checkpoint-2", output_dir=f"{tmp}/r", **DENSE_KD, **tok),
    ]  # fmt: skip
    got = run_distributed(distill_cases, 8, args=(base, cases, 4), timeout=1200, collective_timeout=300)
    kd_error = max(r[-1] for r in got)
    print(f"vocab-parallel KD (tp4, V=53 padded to 56) vs full logits, fp64: max error {kd_error:.1e}")
    assert kd_error < 1e-12
    hists = [next(r[i][0] for r in got if r[i][0] is not None) for i in range(len(cases))]
    assert all(r[i][1] for r in got for i in range(len(cases))), "a rank's teacher shard changed"
    (_, _), (_, _), (dense, _), (moe, _) = results
    err_dense, err_moe = _relative(hists[0], dense), _relative(hists[1], moe)
    assert [r[0] for r in hists[2]] == [3, 4, 5]
    err_resume = _relative(hists[2], hists[0][2:])
    print(f"pp2 x tp2 x dp2 vs one process, dense teacher: max rel error {err_dense:.2e}")
    print(f"pp2 x tp2 x dp2 x ep2 vs one process, NLLB-MoE teacher: max rel error {err_moe:.2e}")
    print(f"resumed from checkpoint-2 vs uninterrupted, steps 3-5: max rel error {err_resume:.2e}")
    assert max(err_dense, err_moe, err_resume) <= TOL
