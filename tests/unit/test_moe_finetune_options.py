"""NLLB-MoE routing options over a pretrained model (`ModelArguments.apply_session`).

Regression (issue 30): fine-tuning an NLLB-MoE directory (`model_name_or_path`) with
`second_expert_policy`, `batch_prioritized_routing`, `normalize_router_prob_before_dropping` or
`moe_eval_capacity_token_fraction` changed nothing and said nothing: only the dropouts, LayerDrop,
EOM and the aux loss weight were applied over the checkpoint's config. They are routing, not
weights: a run's value now reaches the built model; left out, the checkpoint's stays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from models.config import ModelConfig
from models.hf import load_hf_into
from models.hf_save import save_hf_model
from models.m2m100 import IGNORE_INDEX, M2M100Translation, Seq2SeqBatch
from trainer.config.parse import load_config_dict
from trainer.errors import ConfigError
from trainer.run.preflight import validate_early
from trainer.run.setup import model_config_for

ROUTING = {
    "second_expert_policy": "random",
    "batch_prioritized_routing": True,
    "normalize_router_prob_before_dropping": True,
    "moe_eval_capacity_token_fraction": 0.25,
}


def _pretrained(path: Path, **arch: Any) -> Path:
    """A tiny model directory as `save_pretrained` writes it, with a tokenizer file beside it."""
    mc = ModelConfig(vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
                     attention_dropout=0.0, **arch)  # fmt: skip
    torch.manual_seed(0)
    model = M2M100Translation(mc)
    with torch.no_grad():  # routers sharper than init_std's, so the choices are not near-ties
        for name, p in model.named_parameters():
            if "router" in name:
                p.normal_(0.0, 0.5)
    save_hf_model(model.state_dict(), mc, path)
    (path / "tokenizer_config.json").write_text("{}")  # what makes it a directory with a tokenizer
    return path


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _pretrained(tmp_path_factory.mktemp("nllb_moe"), num_experts=4, encoder_sparse_step=1,
                       decoder_sparse_step=1, moe_token_dropout=0.0)  # fmt: skip


def _run_config(model_dir: Path, **values: Any) -> Any:
    base = {"dataset_name": "builtin", "language_pairs": ["en-de"], "model_name_or_path": str(model_dir)}
    return load_config_dict({**base, **values})


def _eval_logits(mc: ModelConfig, model_dir: Path) -> torch.Tensor:
    """Eval-mode logits of the model built from `mc` with the directory's weights."""
    with torch.device("meta"):
        model = M2M100Translation(mc)
    model.to_empty(device="cpu")
    model.reset_buffers()
    load_hf_into(model, model_dir)
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, mc.vocab_size, (3, 11), generator=g)
    labels = torch.randint(4, mc.vocab_size, (3, 7), generator=g)
    dec = torch.cat([torch.full((3, 1), mc.decoder_start_token_id), labels[:, :-1]], dim=1)
    batch = Seq2SeqBatch(src, torch.ones_like(src), dec, labels)
    with torch.no_grad():
        logits = model.eval()(batch)
    assert (labels != IGNORE_INDEX).all()
    return logits


def test_routing_options_reach_the_model_built_from_a_pretrained_moe(moe_dir: Path) -> None:
    checkpoint = model_config_for(_run_config(moe_dir), tok=None)  # type: ignore[arg-type]
    assert (checkpoint.second_expert_policy, checkpoint.moe_eval_capacity_token_fraction) == ("all", 1.0)
    cfg = _run_config(moe_dir, **ROUTING)
    validate_early(cfg, world=1)  # a pretrained NLLB-MoE takes them
    mc = model_config_for(cfg, tok=None)  # type: ignore[arg-type]
    assert {k: getattr(mc, k) for k in ROUTING} == ROUTING
    with torch.device("meta"):
        model = M2M100Translation(mc)
    for ffn in model.sparse_ffns().values():
        r = ffn.router
        assert (r.policy, r.batch_prioritized, r.normalize_before_dropping) == ("random", True, True)
        assert ffn.settings.eval_capacity_fraction == 0.25


@pytest.mark.parametrize(
    "option", [{"second_expert_policy": "random"}, {"moe_eval_capacity_token_fraction": 0.2}]
)
def test_a_routing_option_changes_the_pretrained_model_s_routing(
    moe_dir: Path, option: dict[str, Any]
) -> None:
    """Same weights, the run's routing: the evaluation logits move (random drops second experts,
    a capacity of a fifth of the tokens drops assignments)."""
    as_saved = _eval_logits(model_config_for(_run_config(moe_dir), tok=None), moe_dir)  # type: ignore[arg-type]
    again = _eval_logits(model_config_for(_run_config(moe_dir), tok=None), moe_dir)  # type: ignore[arg-type]
    routed = _eval_logits(model_config_for(_run_config(moe_dir, **option), tok=None), moe_dir)  # type: ignore[arg-type]
    assert torch.equal(as_saved, again)
    assert (routed - as_saved).abs().max().item() > 1e-3


def test_left_out_the_checkpoint_s_routing_stays(tmp_path: Path) -> None:
    sampled = _pretrained(tmp_path / "m", num_experts=4, encoder_sparse_step=2, decoder_sparse_step=2,
                          second_expert_policy="sampling", batch_prioritized_routing=True)  # fmt: skip
    mc = model_config_for(_run_config(sampled), tok=None)  # type: ignore[arg-type]
    assert (mc.second_expert_policy, mc.batch_prioritized_routing) == ("sampling", True)
    mc = model_config_for(_run_config(sampled, batch_prioritized_routing=False), tok=None)  # type: ignore[arg-type]
    assert (mc.second_expert_policy, mc.batch_prioritized_routing) == ("sampling", False)


@pytest.mark.parametrize("name", list(ROUTING))
def test_a_dense_model_refuses_routing_options(tmp_path: Path, name: str) -> None:
    dense = _pretrained(tmp_path / "dense")
    with pytest.raises(ConfigError, match=rf"^{name}={ROUTING[name]} applies to NLLB-MoE models only"):
        validate_early(_run_config(dense, **{name: ROUTING[name]}), world=1)
    with pytest.raises(ConfigError, match=rf"^{name}={ROUTING[name]} applies to NLLB-MoE models only"):
        validate_early(load_config_dict({"dataset_name": "builtin", name: ROUTING[name]}), world=1)
