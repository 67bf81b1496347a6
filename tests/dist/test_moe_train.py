"""NLLB-MoE through the trainer on one process (configs/tiny_moe.yaml): it trains with evaluation,
logs the expert load as `moe_*` keys, and its checkpoint exports (`trainer.export`) to an
NLLB-MoE directory stock `transformers` loads, whose loss on the run's eval batches equals the
last logged `eval_loss`.

transformers 5.x's NllbMoe expert combine is broken upstream (tests/unit/test_hf_nllb_moe.py):
the stock model is run with 4.57.6's combine patched in.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.dist.harness import run_distributed
from tests.dist.test_export import ENV, stock_eval_loss
from tests.unit.test_hf_nllb_moe import _combine_4_57

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def train_worker(rank: int, world_size: int, values: dict[str, Any]) -> None:
    from trainer.config.parse import load_config_dict
    from trainer.run.loop import run

    run(load_config_dict(values))


def test_tiny_moe_trains_logs_expert_load_and_exports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = yaml.safe_load((ROOT / "configs" / "tiny_moe.yaml").read_text())
    values.update(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        builtin_size=400,
        max_eval_samples=16,
        generation_max_length=8,
        generation_num_beams=1,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        moe_token_dropout=0.0,
    )
    os.environ.update(ENV)
    run_distributed(train_worker, 1, args=(values,), timeout=200, env=ENV)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3] and [r["step"] for r in evals] == [0, 3]
    for r in train:
        # policy 'all': every real decoder token takes two assignments (target tokens = decoder positions)
        assert r["moe_dec1_tokens_mean"] * 8 == pytest.approx(2 * r["num_tokens"])
        for layer in ("enc1", "dec1"):
            assert r[f"moe_{layer}_tokens_max"] >= r[f"moe_{layer}_tokens_mean"] > 0
            assert 0.0 <= r[f"moe_{layer}_dropped"] < 1.0
            assert r[f"moe_{layer}_aux_loss"] >= 1.0 - 1e-6  # E * sum(me ce) >= 1 (Cauchy-Schwarz, balanced = 1)
        assert r["moe_aux_loss"] == pytest.approx((r["moe_enc1_aux_loss"] + r["moe_dec1_aux_loss"]) / 2)

    from trainer.export import main as export_main

    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(tmp_path / "run" / "checkpoint-3"), "--output", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "nllb-moe"
    from transformers.models.nllb_moe import modeling_nllb_moe

    from trainer.tokenizer.stock_m2m100 import run_layout
    from trainer.tokenizer.vocab import Tokenizer

    monkeypatch.setattr(modeling_nllb_moe.NllbMoeExperts, "forward", _combine_4_57)
    run_tok = Tokenizer.load(tmp_path / "run" / "tokenizer")
    layout = run_layout(run_tok, json.loads((tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_text())["model_config"]["vocab_size"])  # type: ignore[arg-type]
    loss = stock_eval_loss(out, values, layout)  # the export is in the stock M2M100 vocabulary
    assert loss == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)
