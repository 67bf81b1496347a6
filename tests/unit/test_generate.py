"""Our KV-cached greedy and beam search equal `transformers`' `generate`, token for token.

Random tiny models (dropout 0) on padded batches: the outputs are repetitive
garbage, but equality is what matters. The EOS embedding row is scaled up so that
EOS wins often enough for EOS handling, length penalty and early stopping to
matter; every sampling/penalty knob of HF's `GenerationConfig` is set explicitly.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn
from transformers import M2M100ForConditionalGeneration

from models.config import ModelConfig
from models.generate import DecoderState, generate
from models.hf import to_hf_config, to_hf_state_dict
from models.m2m100 import M2M100Translation
from tests.unit.test_model_parity import CFG, make_batch

SRC_LENS = (7, 3, 5, 9, 4, 6)
TAGS = (5, 6, 7)


def build(seed: int) -> tuple[M2M100Translation, M2M100ForConditionalGeneration]:
    torch.manual_seed(seed)
    cfg = ModelConfig(**{**CFG, "init_std": 0.3})  # type: ignore[arg-type]
    ours = M2M100Translation(cfg).eval()
    shared = cast(nn.Embedding, ours.shared)
    with torch.no_grad():
        shared.weight[cfg.eos_token_id] *= 3.0  # make EOS a frequent winner
    hf = M2M100ForConditionalGeneration(to_hf_config(cfg)).eval()
    hf.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.config), strict=False)
    return ours, hf


def source(cfg: ModelConfig, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `tokens </s>` sources of mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(SRC_LENS), max(SRC_LENS)), cfg.pad_token_id)
    for i, n in enumerate(SRC_LENS):
        ids[i, :n] = torch.randint(4, cfg.vocab_size, (n,), generator=g)
        ids[i, n - 1] = cfg.eos_token_id
    return ids, (ids != cfg.pad_token_id).long()


def hf_generate(hf: Any, ids: torch.Tensor, mask: torch.Tensor, **kw: Any) -> torch.Tensor:
    """HF generate with every default that could differ from ours pinned."""
    kw = {"do_sample": False, "no_repeat_ngram_size": 0, "min_length": 0, "repetition_penalty": 1.0,
          "num_return_sequences": 1, **kw}  # fmt: skip
    with torch.no_grad():
        return hf.generate(input_ids=ids, attention_mask=mask, **kw)


@pytest.fixture(scope="module", params=[0, 1, 2, 3])
def models(request: pytest.FixtureRequest) -> tuple[M2M100Translation, M2M100ForConditionalGeneration, int]:
    return (*build(request.param), request.param)


def test_incremental_logits_equal_full_forward(models) -> None:
    """The KV-cache path (one token per step, positions offset by the cache length) = teacher forcing."""
    ours, _, seed = models
    batch = make_batch(ours.config, seed)
    with torch.no_grad():
        full = ours(batch)  # (B, T, V)
        state = DecoderState(ours, ours.encode(batch), batch.attention_mask.bool())
        steps = [
            state.step(batch.decoder_input_ids[:, t : t + 1]) for t in range(batch.decoder_input_ids.shape[1])
        ]
    # Padded decoder positions differ (no decoder mask in generation), so compare real tokens only.
    real = batch.decoder_input_ids != ours.config.pad_token_id
    err = (torch.stack(steps, dim=1) - full)[real].abs().max().item()
    assert err <= 1e-5, err


def test_greedy_equals_transformers(models) -> None:
    ours, hf, seed = models
    ids, mask = source(ours.config, seed)
    for max_length in (2, 12, 20):
        got = generate(ours, ids, mask, forced_bos_token_id=5, num_beams=1, max_length=max_length)
        want = hf_generate(hf, ids, mask, forced_bos_token_id=5, num_beams=1, max_length=max_length)
        assert torch.equal(got, want), (max_length, got, want)
    assert (got[:, 0] == ours.config.decoder_start_token_id).all() and (got[:, 1] == 5).all()


@pytest.mark.parametrize("num_beams", [2, 4])
@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5, 2.0])
def test_beam_search_equals_transformers(models, num_beams, early_stopping, length_penalty) -> None:
    ours, hf, seed = models
    ids, mask = source(ours.config, seed)
    kw = dict(
        num_beams=num_beams, max_length=16, length_penalty=length_penalty, early_stopping=early_stopping
    )
    got = generate(ours, ids, mask, forced_bos_token_id=6, **kw)
    want = hf_generate(hf, ids, mask, forced_bos_token_id=6, **kw)
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_per_row_target_language_equals_one_language_runs(models, num_beams) -> None:
    """One batch mixing target tags = HF run once per tag on the same padded batch."""
    ours, hf, seed = models
    ids, mask = source(ours.config, seed)
    row_tags = torch.tensor([TAGS[i % len(TAGS)] for i in range(len(SRC_LENS))])
    got = generate(ours, ids, mask, forced_bos_token_id=row_tags, num_beams=num_beams, max_length=14)
    pad = ours.config.pad_token_id
    for tag in TAGS:
        want = hf_generate(hf, ids, mask, forced_bos_token_id=tag, num_beams=num_beams, max_length=14)
        for i in torch.nonzero(row_tags == tag).flatten().tolist():
            # Output widths differ (padding to the longest row), so compare unpadded rows.
            assert torch.equal(got[i][got[i] != pad], want[i][want[i] != pad]), (tag, i)


def test_bad_arguments_named() -> None:
    ours, _ = build(0)
    ids, mask = source(ours.config, 0)
    with pytest.raises(ValueError, match="num_beams=0"):
        generate(ours, ids, mask, forced_bos_token_id=5, num_beams=0)
    with pytest.raises(ValueError, match="has 2 entries; expected one per row \\(6\\)"):
        generate(ours, ids, mask, forced_bos_token_id=[5, 6])
