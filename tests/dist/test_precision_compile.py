"""Mixed precision and regional compilation through the real trainer, on CPU.

- `bf16: true` (bf16 working weights cast once per step over fp32 masters, fp32
  gradient accumulation over two micro-batches) tracks the fp32 losses within 3%
  over 30 steps; so does `fp16: true` (fp16 working weights, dynamic loss scaling
  from the default 65536).
- `torch_compile: true` (each encoder/decoder layer compiled by inductor, dynamic shapes,
  lengths in buckets of `pad_to_multiple_of`) gives the eager fp32 losses and grad norms
  within 1e-5 relative on (pp, dp, tp) = (2, 1, 2) with selective remat (against one eager
  process), and an NLLB-MoE model (every layer sparse) gives its eager run's in one process
  (its experts over ep or tp do not yet, and are refused: `trainer.run.preflight`). On varying
  lengths nothing recompiles after the first step (run_summary.json), and a tp=2 layer is one
  graph with dropout off (its collectives traced, not broken at); with dropout its tp-split sites
  break it.

Compiling is the cost (dynamo and AOT autograd tracing with symbolic shapes, then inductor's
codegen and g++): each rank compiles its stage's layers. The compiled mesh has no dp axis (pp and
tp are what change the compiled regions: a stage's layers, the tp collectives traced in them);
dp reduces gradients outside the layers, at the executor's actions, and a second replica
compiles the same layers again on 4 more ranks (its tp group has another name, so the inductor
cache misses): the group took 161 CPU-s on (2, 2, 2), 107 on (2, 1, 2). The runs share an
inductor cache directory, with few steps.
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_distributed
from tests.dist.train_workers import base_config, compile_group, train_summaries
from tests.dist.train_workers import mesh_overrides as mesh

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1500)]
TOL = 1e-5
# Every layer sparse: a dense layer compiles as the dense model's do (the (2, 1, 2) group); with
# sparse_step 2 the one-process compile took 92 s (4 graphs), all sparse 67 s (2 graphs).
MOE = {"num_experts": 4, "encoder_sparse_step": 1, "decoder_sparse_step": 1, "moe_token_dropout": 0.0,
       "router_aux_loss_coef": 0.01, "max_steps": 3}  # fmt: skip


@pytest.fixture(scope="module")
def inductor_env(tmp_path_factory) -> dict[str, str]:
    """One inductor cache for the module's groups; compile in the rank's process (no worker pool)."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor")),
            "TORCHINDUCTOR_COMPILE_THREADS": "1"}  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, inductor_env) -> tuple[dict[str, list], dict[str, dict], str]:
    """Every single-process run in one spawned group (spawning and imports dominate):
    fp32, bf16 and fp16 over 30 steps, eager over 5 (the compiled mesh's reference), NLLB-MoE eager
    and compiled over 3, all with run-0's tokenizer."""
    tmp = str(tmp_path_factory.mktemp("one"))
    tok = f"{tmp}/run-0/tokenizer"
    cases = {
        "fp32": mesh(),
        # Two micro-batches per step: the bf16 working weights serve both (one cast per step).
        "bf16": mesh(m=2, bf16=True, tokenizer_name=tok),
        "fp16": mesh(m=2, fp16=True, tokenizer_name=tok),
        "eager": mesh(max_steps=5, tokenizer_name=tok),
        "moe eager": mesh(tokenizer_name=tok, **MOE),
        "moe compiled": mesh(torch_compile=True, tokenizer_name=tok, **MOE),
    }
    base = base_config(tmp, max_steps=30)
    [runs] = run_distributed(
        train_summaries, 1, args=(base, list(cases.values())), timeout=900, env=inductor_env
    )
    return {k: hist for k, (hist, _) in zip(cases, runs)}, {k: s for k, (_, s) in zip(cases, runs)}, tok


def test_bf16_tracks_fp32_over_30_steps(one_process) -> None:
    runs, _, _ = one_process
    ref, got = runs["fp32"], runs["bf16"]
    assert [s for s, _, _ in got] == [s for s, _, _ in ref]
    worst = max(abs(g[1] - r[1]) / r[1] for g, r in zip(got, ref))
    assert worst <= 0.03, f"bf16 vs fp32 loss: worst relative difference {worst:.3e} over 30 steps"
    assert got[-1][1] < got[0][1] * 0.9, "bf16 training does not learn"


def test_fp16_tracks_fp32_over_30_steps(one_process) -> None:
    runs, _, _ = one_process
    ref, got = runs["fp32"], runs["fp16"]
    assert [s for s, _, _ in got] == [s for s, _, _ in ref]
    worst = max(abs(g[1] - r[1]) / r[1] for g, r in zip(got, ref))
    final = abs(got[-1][1] - ref[-1][1]) / ref[-1][1]
    print(
        f"fp16 vs fp32 loss over 30 steps: final {got[-1][1]:.6f} vs {ref[-1][1]:.6f} (relative {final:.2e}), "
        f"worst step {worst:.2e}"
    )
    assert final <= 0.03 and worst <= 0.03, f"fp16 vs fp32 loss: final {final:.3e}, worst {worst:.3e}"
    assert got[-1][1] < got[0][1] * 0.9, "fp16 training does not learn"


def _max_rel(hist: list, ref: list) -> float:
    assert [s for s, _, _ in hist] == [s for s, _, _ in ref[: len(hist)]], (hist, ref)
    return max(max(abs(a[1] - b[1]) / abs(b[1]), abs(a[2] - b[2]) / abs(b[2])) for a, b in zip(hist, ref))


def test_torch_compile_equals_eager(one_process, tmp_path, inductor_env) -> None:
    runs, summaries, tok = one_process
    ref = runs["eager"]
    assert len(ref) == 5
    three = base_config(str(tmp_path / "compiled"), tok, max_steps=3)
    cases = {
        "3d-2x1x2 selective": mesh(
            pp=2, dp=1, tp=2, m=2, torch_compile=True, activation_checkpointing="selective"
        ),
    }
    results = run_distributed(compile_group, 4, args=(three, list(cases.values())), timeout=1400,
                              collective_timeout=600, env=inductor_env)  # fmt: skip
    by_case = [next(r[1][i] for r in results if r[1][i][0] is not None) for i in range(len(cases))]
    got = dict(zip(cases, by_case))
    errors = {
        "3d-2x1x2 selective": _max_rel(got["3d-2x1x2 selective"][0], ref),
        "nllb-moe 1 process": _max_rel(runs["moe compiled"], runs["moe eager"]),
    }
    print("compiled vs eager, max relative error (loss, grad norm):", {k: f"{v:.2e}" for k, v in errors.items()})
    print("tp=2 layers, (graphs, breaks):", results[0][0])
    compiled = {"3d-2x1x2 selective": got["3d-2x1x2 selective"][1], "moe compiled": summaries["moe compiled"]}
    for name, summary in compiled.items():
        print(f"{name}: {summary['compile']}")
    assert all(e <= TOL for e in errors.values()), errors
    for name, summary in compiled.items():
        comp = summary["compile"]
        assert comp["torch_compile"] and comp["graphs_warmup"] > 0, (name, comp)
        assert comp["recompiles_after_warmup"] == 0, (name, comp)  # lengths vary from step to step
    captured = [any(layers for layers in b.values()) for b, _ in results]
    assert captured == [True, True] + [False] * 2, captured  # the first tp pair captures
    for breaks, _ in results[:2]:  # each rank of a tp pair: a tp=2 layer is one graph (dropout off), with and without sp
        for key, layers in breaks.items():
            if "dropout=0.0" in key:
                assert all(v == (1, 0) for v in layers.values()), (key, layers)
            else:  # the tp-split dropout sites' per-rank generator forks break it
                assert all(v[1] > 0 for v in layers.values()), (key, layers)
    assert summaries["eager"]["compile"]["graphs_warmup"] == 0
