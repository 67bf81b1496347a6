"""LayerDrop: one keyed draw per step, skipped layers are the identity in training only,
and the probabilities travel with HF configs (published M2M100 configs set 0.05)."""

import pytest
import torch

from models.config import ModelConfig
from models.hf import from_hf_config, to_hf_config
from models.m2m100 import M2M100Translation, Seq2SeqBatch, layerdrop_skips

CFG = ModelConfig(
    vocab_size=50, d_model=16, encoder_layers=3, decoder_layers=3, encoder_ffn_dim=32, decoder_ffn_dim=32,
    dropout=0.0, attention_dropout=0.0, encoder_layerdrop=0.3, decoder_layerdrop=0.6,
)  # fmt: skip


def test_draw_is_keyed_by_seed_and_step_and_follows_the_probabilities():
    assert layerdrop_skips(CFG, 1, 7) == layerdrop_skips(CFG, 1, 7)
    draws = [layerdrop_skips(CFG, 1, s) for s in range(2000)]
    assert len({frozenset(d) for d in draws}) > 10
    enc = sum(sum(n.startswith("encoder.") for n in d) for d in draws) / (3 * 2000)
    dec = sum(sum(n.startswith("decoder.") for n in d) for d in draws) / (3 * 2000)
    assert abs(enc - 0.3) < 0.03 and abs(dec - 0.6) < 0.03, (enc, dec)
    off = ModelConfig(vocab_size=50, d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32)
    assert layerdrop_skips(off, 1, 7) == frozenset()


def _batch() -> Seq2SeqBatch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 50, (2, 5), generator=g)
    return Seq2SeqBatch(input_ids=ids, attention_mask=torch.ones_like(ids), decoder_input_ids=ids, labels=ids)


def test_a_skipped_layer_is_the_identity_in_training_and_runs_in_eval():
    model = M2M100Translation(CFG, seed=0)
    pruned = M2M100Translation(CFG, seed=0)
    batch = _batch()
    skip = frozenset({"encoder.layers.1", "decoder.layers.0", "decoder.layers.2"})
    model.train()
    model.skip_layers = skip
    out = model(batch)
    # The same network without those layers: run the kept blocks only.
    kept = [b for b in pruned.blocks if b.name not in skip]
    pruned.train()
    assert torch.equal(out, pruned.run_blocks({}, batch, kept)["logits"])
    out.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads["encoder.layers.1.fc1.weight"] is None and grads["encoder.layers.0.fc1.weight"] is not None
    model.eval()
    assert not torch.equal(model(batch), out)  # evaluation never drops layers


def test_probabilities_round_trip_through_hf_configs_and_are_validated():
    hf = to_hf_config(CFG)
    assert (hf.encoder_layerdrop, hf.decoder_layerdrop) == (0.3, 0.6)
    assert from_hf_config(hf.to_dict()).decoder_layerdrop == 0.6
    with pytest.raises(ValueError, match=r"encoder_layerdrop=1.0 must be in \[0, 1\)"):
        ModelConfig(vocab_size=50, d_model=16, encoder_layerdrop=1.0)
