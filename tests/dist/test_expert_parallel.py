"""Expert parallelism below the trainer: the (pp, dp, tp, ep) model equals one process.

One spawned group of 4 gloo ranks builds each mesh stage- and expert-locally (meta device,
keyed init: no rank holds experts it does not own) and trains 3 AdamW steps of a 4-expert
NLLB-MoE model; per-step loss and grad norm equal one process (computed on each rank, no
collectives) within 1e-5 relative. Dropless routing without the load-balancing loss is
compared with the unsplit batch (whatever the grouping); capacity drops and the aux loss
with one process that routes the same micro-batches. Covered: every schedule family
(1f1b, gpipe, interleaved, ZB-V), remat (full, stage) with keyed routing randomness
(`sampling` second expert, expert output masking) recomputed identically, tp over the
experts' FFN dim with sequence parallelism, ZeRO-1 and FSDP over edp.
"""

from __future__ import annotations

import pytest

from tests.dist.expert_workers import Case, mesh_cases
from tests.dist.harness import run_distributed

TOL = 1e-5
pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

CASES = {
    "pp2-dp2-ep2-1f1b-dropless": Case(pp=2, dp=2, ep=2),
    "pp2-dp2-ep2-zbv-capacity-aux-sampling-eom-full-remat": Case(
        pp=2,
        dp=2,
        ep=2,
        schedule="zbv",
        remat="full",
        dropless=False,
        aux=0.01,
        model={"second_expert_policy": "sampling", "moe_token_dropout": 0.2},
    ),
    "pp2-dp2-ep2-interleaved-stage-remat-aux": Case(
        pp=2, dp=2, ep=2, schedule="interleaved_1f1b", remat="stage", aux=0.01
    ),
    "dp2-tp2-ep2-sequence-parallel-aux": Case(dp=2, tp=2, ep=2, sequence_parallel=True, aux=0.01),
    "dp4-ep2-zero1-capacity": Case(dp=4, ep=2, m=1, sharding="zero1", dropless=False, capacity_factor=0.5),
    "dp4-ep4-fsdp-gpipe": Case(dp=4, ep=4, schedule="gpipe", sharding="fsdp"),
}


def test_expert_parallel_meshes_match_one_process() -> None:
    results = run_distributed(mesh_cases, 4, args=(list(CASES.values()),), timeout=500, collective_timeout=200)
    bad = []
    for i, name in enumerate(CASES):
        r = results[0][i]
        sent = [res[i]["bytes"] for res in results]
        print(f"{name:<56} max rel err {r['err']:.1e}  dropped {r['dropped']}  a2a bytes/rank {sent}")
        if max(res[i]["err"] for res in results) > TOL:
            bad.append((name, r["got"], r["ref"]))
        if CASES[name].ep > 1:
            assert any(sent), f"{name}: no token crossed the ep group"
        if not CASES[name].dropless:
            assert r["dropped"] > 0, f"{name}: capacity dropped nothing; the case tests nothing"
    assert not bad, bad
