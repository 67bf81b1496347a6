"""Mixed precision and regional compilation through the real trainer, on CPU.

- `bf16: true` (bf16 working weights cast once per step over fp32 masters, fp32
  gradient accumulation over two micro-batches) tracks the fp32 losses within 3%
  over 30 steps; so does `fp16: true` (fp16 working weights, dynamic loss scaling
  from the default 65536).
- `torch_compile: true` (each encoder/decoder layer compiled) gives the eager fp32
  losses within 1e-4 over 5 steps, alone, with full rematerialisation, under tensor
  parallelism and in a pipeline.
"""

from __future__ import annotations

import pytest

from tests.dist.harness import run_distributed
from tests.dist.train_workers import base_config, train_cases
from tests.dist.train_workers import mesh_overrides as mesh

pytestmark = [pytest.mark.dist, pytest.mark.timeout(1500)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[dict[str, list], str]:
    """Every single-process run in one spawned group (spawning and imports dominate):
    fp32, bf16 and fp16 over 30 steps, eager and compiled over 5, all with run-0's tokenizer."""
    tmp = str(tmp_path_factory.mktemp("one"))
    tok = f"{tmp}/run-0/tokenizer"
    cases = {
        "fp32": mesh(),
        # Two micro-batches per step: the bf16 working weights serve both (one cast per step).
        "bf16": mesh(m=2, bf16=True, tokenizer_name=tok),
        "fp16": mesh(m=2, fp16=True, tokenizer_name=tok),
        "eager": mesh(max_steps=5, tokenizer_name=tok),
        "compile": mesh(max_steps=5, torch_compile=True, tokenizer_name=tok),
    }
    base = base_config(tmp, max_steps=30)
    [hists] = run_distributed(train_cases, 1, args=(base, list(cases.values())), timeout=900)
    return dict(zip(cases, hists)), tok


def test_bf16_tracks_fp32_over_30_steps(one_process) -> None:
    runs, _ = one_process
    ref, got = runs["fp32"], runs["bf16"]
    assert [s for s, _, _ in got] == [s for s, _, _ in ref]
    worst = max(abs(g[1] - r[1]) / r[1] for g, r in zip(got, ref))
    assert worst <= 0.03, f"bf16 vs fp32 loss: worst relative difference {worst:.3e} over 30 steps"
    assert got[-1][1] < got[0][1] * 0.9, "bf16 training does not learn"


def test_fp16_tracks_fp32_over_30_steps(one_process) -> None:
    runs, _ = one_process
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


def test_torch_compile_equals_eager(one_process, tmp_path) -> None:
    runs, tok = one_process
    ref, got = runs["eager"], runs["compile"]
    cases = [
        mesh(tp=2, torch_compile=True, activation_checkpointing="full"),
        mesh(pp=2, m=2, torch_compile=True, activation_checkpointing="selective"),
    ]
    two = base_config(str(tmp_path / "two"), tok)
    two_ranks = run_distributed(train_cases, 2, args=(two, cases), timeout=900)[0]
    assert len(ref) == 5
    for name, hist in [
        ("compile", got),
        ("compile tp2 full remat", two_ranks[0]),
        ("compile pp2 selective", two_ranks[1]),
    ]:
        if hist is None:  # this rank does not log (pp2: the last stage logs)
            continue
        for (step, loss, norm), (_, r_loss, r_norm) in zip(hist, ref):
            assert abs(loss - r_loss) <= 1e-4 and abs(norm - r_norm) <= 1e-4 * max(1.0, r_norm), (
                f"{name} step {step}: loss {loss} vs eager {r_loss}, grad norm {norm} vs {r_norm}"
            )
