"""Parity ladder, rung 2: our single-device model equals `transformers`' M2M100.

Same weights, same padded inputs: logits within 1e-5 (fp32) and the same loss;
weights survive import -> export -> import unchanged.
"""

from __future__ import annotations

import pytest
import torch
from transformers import M2M100ForConditionalGeneration

from models.config import ModelConfig
from models.hf import (
    load_hf_weights,
    load_into,
    read_hf_config,
    to_hf_config,
    to_hf_state_dict,
)
from models.hf_save import save_hf_model
from models.m2m100 import IGNORE_INDEX, M2M100Translation, Seq2SeqBatch

CFG = dict(
    vocab_size=97,
    d_model=32,
    encoder_layers=2,
    decoder_layers=3,
    encoder_attention_heads=4,
    decoder_attention_heads=2,
    encoder_ffn_dim=64,
    decoder_ffn_dim=48,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    max_position_embeddings=64,
)


def make_batch(cfg: ModelConfig, seed: int = 0) -> Seq2SeqBatch:
    g = torch.Generator().manual_seed(seed)
    src_lens, tgt_lens = [7, 3, 5], [4, 6, 2]
    b, s, t = len(src_lens), max(src_lens), max(tgt_lens)
    src = torch.full((b, s), cfg.pad_token_id)
    lab = torch.full((b, t), IGNORE_INDEX)
    for i, (sl, tl) in enumerate(zip(src_lens, tgt_lens)):
        src[i, :sl] = torch.randint(4, cfg.vocab_size, (sl,), generator=g)
        src[i, sl - 1] = cfg.eos_token_id
        lab[i, :tl] = torch.randint(4, cfg.vocab_size, (tl,), generator=g)
        lab[i, tl - 1] = cfg.eos_token_id
    dec = torch.full_like(lab, cfg.pad_token_id)
    dec[:, 0] = cfg.decoder_start_token_id
    dec[:, 1:] = lab[:, :-1].masked_fill(lab[:, :-1] == IGNORE_INDEX, cfg.pad_token_id)
    return Seq2SeqBatch(src, (src != cfg.pad_token_id).long(), dec, lab)


@pytest.fixture(scope="module")
def pair() -> tuple[M2M100Translation, M2M100ForConditionalGeneration]:
    torch.manual_seed(0)
    cfg = ModelConfig(**CFG)
    ours = M2M100Translation(cfg).eval()
    hf = M2M100ForConditionalGeneration(to_hf_config(cfg)).eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.config), strict=False)
    assert not unexpected and all("embed_tokens" in k or "embed_positions" in k for k in missing), missing
    return ours, hf


def test_logits_and_loss_match_transformers(pair) -> None:
    ours, hf = pair
    batch = make_batch(ours.config)
    with torch.no_grad():
        logits = ours(batch)
        ref = hf(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            decoder_input_ids=batch.decoder_input_ids,
            labels=batch.labels,
        )
    err = (logits - ref.logits).abs().max().item()
    assert err <= 1e-5, f"max abs logit error {err}"
    loss_sum, n = ours.loss(batch)
    assert abs(loss_sum.item() / n - ref.loss.item()) <= 1e-5


def test_gradients_match_transformers(pair) -> None:
    ours, hf = pair
    batch = make_batch(ours.config, seed=1)
    ours.zero_grad()
    hf.zero_grad()
    loss_sum, n = ours.loss(batch)
    (loss_sum / n).backward()
    hf(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        decoder_input_ids=batch.decoder_input_ids,
        labels=batch.labels,
    ).loss.backward()
    hf_params = dict(hf.named_parameters())
    ours_grads = to_hf_state_dict({n: p.grad for n, p in ours.named_parameters()}, ours.config)
    for name, grad in ours_grads.items():
        ref = hf_params[name].grad if name != "lm_head.weight" else hf_params["model.shared.weight"].grad
        assert torch.allclose(grad, ref, atol=1e-6, rtol=1e-4), name


def test_export_import_roundtrip(tmp_path, pair) -> None:
    ours, _ = pair
    save_hf_model(ours.state_dict(), ours.config, tmp_path / "hf")
    cfg = read_hf_config(tmp_path / "hf")
    assert cfg == ours.config
    back = M2M100Translation(cfg)
    load_into(back, load_hf_weights(tmp_path / "hf"))
    for k, v in ours.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    stock = M2M100ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    batch = make_batch(cfg, seed=2)
    with torch.no_grad():
        err = (
            (
                stock(
                    input_ids=batch.input_ids,
                    attention_mask=batch.attention_mask,
                    decoder_input_ids=batch.decoder_input_ids,
                ).logits
                - ours(batch)
            )
            .abs()
            .max()
            .item()
        )
    assert err <= 1e-5


def test_blocks_compose_to_forward(pair) -> None:
    ours, _ = pair
    batch = make_batch(ours.config, seed=3)
    with torch.no_grad():
        full = ours(batch)
        state: dict = {}
        for spec in ours.blocks:
            state = ours.run_block(spec, state, batch)
    assert torch.equal(state["logits"], full)


def test_bad_heads_named() -> None:
    with pytest.raises(ValueError, match="d_model=30 is not divisible by encoder_attention_heads=4"):
        ModelConfig(**{**CFG, "d_model": 30})
