"""NLLB-MoE against `transformers`' NllbMoeForConditionalGeneration: eval logits at 1e-5 (fp32),
greedy and beam `generate` tokens, and the HF directory round trip (sharded safetensors read
slice by slice, an expert range alone, exported back and loaded by stock transformers).

The upstream bug this works around: transformers 5.x's `NllbMoeExperts.forward` one-hots the
router's `top_1_mask`, which is already one-hot (E, 2, N after its permute), so each expert is
run on the wrong tokens and only top-1 assignments are combined: against a per-token top-2
reference its output is off by O(1) (`test_transformers5_expert_combine_is_broken` pins it).
transformers 4.57.6's `NllbMoeSparseMLP.forward` (router_mask = router_probs.bool(), each
expert on its routed tokens, combined by router_probs) is right. So the reference here is
transformers 5 with only that combine replaced by a port of 4.57.6's (`_combine_4_57`), and,
when `HF4_PYTHON` names a Python with transformers 4.57 (`scripts/check_hf_nllb_moe.py`),
transformers 4.57.6 itself, unpatched.

What we match and what we do not: transformers' encoder sparse layers keep padding out of
routing (the 4-D mask's last query row), as we do. Its decoder sparse layers are given the
causal mask as `padding_mask`, whose last row masks nothing without a `decoder_attention_mask`,
so decoder padding is routed there; we keep decoder padding out (fairseq's `use_moe_pad_mask`).
With the evaluation capacity of 1.0 nothing is dropped, so a pad position only changes its own
output: logits are compared on the positions that carry a label.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration
from transformers.models.nllb_moe import modeling_nllb_moe

from models.generate import generate
from models.hf import load_hf_into, read_hf_config, read_hf_slices
from models.hf_save import save_hf_model
from models.init import LocalSlice
from models.m2m100 import IGNORE_INDEX, M2M100Translation, Seq2SeqBatch

ROOT = Path(__file__).resolve().parents[2]
HF_CFG = dict(
    vocab_size=97,
    d_model=32,
    encoder_layers=4,
    decoder_layers=4,
    encoder_attention_heads=4,
    decoder_attention_heads=2,
    encoder_ffn_dim=48,
    decoder_ffn_dim=40,
    num_experts=8,
    encoder_sparse_step=2,
    decoder_sparse_step=2,
    moe_token_dropout=0.2,
    max_position_embeddings=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    encoder_layerdrop=0.0,
    decoder_layerdrop=0.0,
)


def _combine_4_57(self, hidden_states, router_mask, router_probs):  # noqa: ANN001, ANN202
    """transformers 4.57.6's combine (`NllbMoeSparseMLP.forward`) in 5.x's `NllbMoeExperts.forward`
    signature: every expert on the tokens whose combine weight is non-zero, weighted by it."""
    out = torch.zeros_like(hidden_states)
    routed = router_probs.bool()  # (N, E)
    for idx in range(self.num_experts):
        tokens = routed[:, idx]
        y = self[f"expert_{idx}"](hidden_states[tokens])
        if self.moe_token_dropout > 0:
            y = self.token_dropout(y) if self.training else y * (1 - self.moe_token_dropout)
        out[tokens] += router_probs[tokens, idx, None] * y.to(out.dtype)
    return out


@pytest.fixture
def fixed_combine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modeling_nllb_moe.NllbMoeExperts, "forward", _combine_4_57)


def make_hf(**overrides: object) -> NllbMoeForConditionalGeneration:
    torch.manual_seed(0)
    hf = NllbMoeForConditionalGeneration(NllbMoeConfig(**{**HF_CFG, **overrides})).eval()
    with torch.no_grad():  # sharper routers than init_std's, so the choices are not near-ties
        for name, p in hf.named_parameters():
            if "router" in name:
                p.normal_(0.0, 0.5)
            elif "experts" in name and name.endswith("bias"):
                p.normal_(0.0, 0.05)
    return hf


def make_batch(vocab: int, tgt_lens: list[int], seed: int = 0) -> Seq2SeqBatch:
    g = torch.Generator().manual_seed(seed)
    src_lens = [9, 4, 7][: len(tgt_lens)]
    b, s, t = len(src_lens), max(src_lens), max(tgt_lens)
    src = torch.full((b, s), 1)
    lab = torch.full((b, t), IGNORE_INDEX)
    for i, (sl, tl) in enumerate(zip(src_lens, tgt_lens)):
        src[i, :sl] = torch.randint(4, vocab, (sl,), generator=g)
        src[i, sl - 1] = 2
        lab[i, :tl] = torch.randint(4, vocab, (tl,), generator=g)
        lab[i, tl - 1] = 2
    dec = torch.full_like(lab, 1)
    dec[:, 0] = 2
    dec[:, 1:] = lab[:, :-1].masked_fill(lab[:, :-1] == IGNORE_INDEX, 1)
    return Seq2SeqBatch(src, (src != 1).long(), dec, lab)


def load_ours(path: Path) -> M2M100Translation:
    cfg = read_hf_config(path)
    with torch.device("meta"):
        model = M2M100Translation(cfg)
    model.to_empty(device="cpu")
    model.reset_buffers()
    load_hf_into(model, path)
    return model.eval()


def hf_logits(hf: NllbMoeForConditionalGeneration, batch: Seq2SeqBatch) -> torch.Tensor:
    with torch.no_grad():
        return hf(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            decoder_input_ids=batch.decoder_input_ids,
        ).logits


def test_transformers5_expert_combine_is_broken() -> None:
    """The upstream bug: a tiny NllbMoeSparseMLP in eval, against a per-token top-2 reference."""
    mlp = make_hf().model.encoder.layers[1].ffn
    x = torch.randn(2, 5, HF_CFG["d_model"])
    with torch.no_grad():
        got = mlp(x).reshape(-1, x.shape[-1])
        _, probs, _ = mlp.router(x.reshape(-1, x.shape[-1]))
        ref = _combine_4_57(mlp.experts, x.reshape(-1, x.shape[-1]), None, probs)
    assert (got - ref).abs().max() > 0.01


@pytest.mark.parametrize(
    "overrides",
    [{}, {"router_bias": True, "normalize_router_prob_before_dropping": True}],
)
def test_eval_logits_match_transformers(fixed_combine, tmp_path: Path, overrides: dict) -> None:
    hf = make_hf(**overrides)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()  # sharded, as NLLB-MoE-54B is
    ours = load_ours(tmp_path)
    batch = make_batch(HF_CFG["vocab_size"], [5, 8, 3])
    with torch.no_grad():
        logits = ours(batch)
    ref = hf_logits(hf, batch)
    real = batch.labels != IGNORE_INDEX
    err = (logits - ref)[real].abs().max().item()
    assert err <= 1e-5, f"max abs logit error {err}"


@pytest.mark.parametrize("prioritized", [False, True])
def test_eval_capacity_drops_match_transformers(fixed_combine, tmp_path: Path, prioritized: bool) -> None:
    """An evaluation capacity below 1 drops assignments; no decoder padding, so both route the
    same tokens (see the module docstring)."""
    hf = make_hf(moe_eval_capacity_token_fraction=0.15, batch_prioritized_routing=prioritized)
    hf.save_pretrained(tmp_path)
    ours = load_ours(tmp_path)
    batch = make_batch(HF_CFG["vocab_size"], [6, 6, 6], seed=1)
    flat = batch.input_ids.numel()
    layer = ours.encoder.layers["1"]
    capacity = layer.ffn.capacity(flat)
    assert capacity is not None and capacity < flat
    with torch.no_grad():
        logits = ours(batch)
    err = (logits - hf_logits(hf, batch)).abs().max().item()
    assert err <= 1e-5, f"max abs logit error {err}"


def test_generate_matches_transformers(fixed_combine, tmp_path: Path) -> None:
    hf = make_hf()
    hf.save_pretrained(tmp_path)
    ours = load_ours(tmp_path)
    batch = make_batch(HF_CFG["vocab_size"], [3, 3, 3], seed=2)
    for beams in (1, 3):
        with torch.no_grad():
            ref = hf.generate(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                forced_bos_token_id=7,
                num_beams=beams,
                max_length=10,
                do_sample=False,
            )
            got = generate(ours, batch.input_ids, batch.attention_mask, 7, num_beams=beams, max_length=10)
        assert got.tolist() == ref.tolist(), f"num_beams={beams}"


def test_expert_range_reads_only_those_experts(tmp_path: Path) -> None:
    hf = make_hf()
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    name = "decoder.layers.3.ffn.experts.fc1_weight"
    full = (8, HF_CFG["decoder_ffn_dim"], HF_CFG["d_model"])
    ((_, part),) = read_hf_slices(tmp_path, {name: LocalSlice(full, 0, 2, 3, 3)})
    ref = torch.stack([hf.model.decoder.layers[3].ffn.experts[f"expert_{e}"].fc1.weight for e in (2, 3, 4)])
    assert torch.equal(part, ref.detach())
    tp = LocalSlice(full, 1, 8, 16, 16)  # a tp slice of every expert
    ((_, cols),) = read_hf_slices(tmp_path, {name: tp})
    all_experts = torch.stack(
        [hf.model.decoder.layers[3].ffn.experts[f"expert_{e}"].fc1.weight for e in range(8)]
    )
    assert torch.equal(cols, all_experts[:, 8:24].detach())


def test_export_round_trip_loads_in_transformers(fixed_combine, tmp_path: Path) -> None:
    hf = make_hf()
    hf.save_pretrained(tmp_path / "in")
    ours = load_ours(tmp_path / "in")
    save_hf_model(ours.state_dict(), ours.config, tmp_path / "out", max_shard_size="100KB")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "nllb-moe"
    assert read_hf_config(tmp_path / "out") == ours.config
    stock = NllbMoeForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    ref = dict(hf.state_dict())
    for k, v in stock.state_dict().items():
        assert torch.equal(v, ref[k]), k
    batch = make_batch(HF_CFG["vocab_size"], [4, 7, 2], seed=3)
    with torch.no_grad():
        logits = ours(batch)
    real = batch.labels != IGNORE_INDEX
    assert (logits - hf_logits(stock, batch))[real].abs().max().item() <= 1e-5


def test_logits_and_generate_match_transformers_4(tmp_path: Path) -> None:
    """transformers 4.57.6 itself (no patch), in the Python `HF4_PYTHON` names: build the venv with
    python -m venv V && V/bin/pip install torch transformers==4.57.6 sentencepiece safetensors."""
    python = os.environ.get("HF4_PYTHON")
    if not python:
        pytest.skip("HF4_PYTHON is not set: no Python with transformers 4.57 to compare with")
    make_hf().save_pretrained(tmp_path / "model", max_shard_size="100KB")
    ours = load_ours(tmp_path / "model")
    batch = make_batch(HF_CFG["vocab_size"], [5, 8, 3], seed=4)
    request = {
        "input_ids": batch.input_ids.tolist(),
        "attention_mask": batch.attention_mask.tolist(),
        "decoder_input_ids": batch.decoder_input_ids.tolist(),
        "forced_bos_token_id": 7,
        "max_length": 10,
        "beams": [1, 3],
    }
    (tmp_path / "request.json").write_text(json.dumps(request))
    res = subprocess.run(
        [python, str(ROOT / "scripts" / "check_hf_nllb_moe.py"), str(tmp_path / "model"), str(tmp_path / "request.json")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert out["transformers"].startswith("4.")
    with torch.no_grad():
        logits = ours(batch)
    real = batch.labels != IGNORE_INDEX
    assert (logits - torch.tensor(out["logits"]))[real].abs().max().item() <= 1e-5
    for beams, ref in zip(request["beams"], out["generated"]):
        got = generate(ours, batch.input_ids, batch.attention_mask, 7, num_beams=beams, max_length=10)
        assert got.tolist() == ref, f"num_beams={beams}"


def test_translate_cli_matches_transformers_generate(fixed_combine, tmp_path: Path, multi30k: Path) -> None:
    """`trainer.translate --model DIR` on a directory `NllbMoeForConditionalGeneration.save_pretrained`
    wrote (with a stock NllbTokenizer): the same greedy and beam translations as its `generate`."""
    import io

    from transformers import AutoTokenizer

    from tests.corpus_data import read_lines
    from tests.unit.test_hf_tokenizer import stock_nllb
    from trainer.eval.hf_translate import TranslateArguments
    from trainer.eval.hf_translate import run as translate_run

    text = {lang: read_lines(multi30k, "train", lang, 200) for lang in ("en", "de")}
    tok_dir = stock_nllb(text["en"] + text["de"], tmp_path / "tok")
    hf_tok = AutoTokenizer.from_pretrained(str(tok_dir), src_lang="eng_Latn")
    hf = make_hf(vocab_size=len(hf_tok))
    hf.save_pretrained(tmp_path / "model", max_shard_size="100KB")
    hf_tok.save_pretrained(str(tmp_path / "model"))
    lines = text["en"][:3]
    tag = hf_tok.convert_tokens_to_ids("deu_Latn")
    for beams in (1, 3):
        out = io.StringIO()
        args = TranslateArguments(
            model=str(tmp_path / "model"), source_lang="eng_Latn", target_lang="deu_Latn",
            num_beams=beams, max_length=12, device="cpu",
        )  # fmt: skip
        translate_run(args, io.StringIO("\n".join(lines) + "\n"), out)
        expected = []
        for line in lines:
            enc = hf_tok(line, return_tensors="pt")
            with torch.no_grad():
                ids = hf.generate(
                    **enc, forced_bos_token_id=tag, num_beams=beams, max_length=12, do_sample=False
                )
            expected.append(hf_tok.decode(ids[0], skip_special_tokens=True))
        assert out.getvalue().splitlines() == expected, f"num_beams={beams}"
        assert all(expected), expected  # real translations, not empty lines


@pytest.mark.parametrize("per_expert", [False, True])
def test_export_reads_stacked_or_per_expert_checkpoint_entries(tmp_path: Path, per_expert: bool) -> None:
    """A DCP checkpoint holding the experts stacked (one process) or one entry per expert under
    its transformers name (expert parallelism's, resharding across ep) exports the same weights."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from models.hf import load_hf_weights
    from models.hf_save import write_hf_config
    from models.moe import expert_param_name, is_expert_param
    from trainer.checkpoint.hf_export import export_weights, load_full_state

    cfg = read_hf_config(_saved(make_hf(), tmp_path / "hf"))
    model = M2M100Translation(cfg, seed=1)
    entries: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if per_expert and is_expert_param(name):
            entries.update((expert_param_name(name, e), p.detach()[e].clone()) for e in range(p.shape[0]))
        else:
            entries[name] = p.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": entries}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    (tmp_path / "ckpt" / "trainer_state.json").write_text(json.dumps({"model_config": cfg.to_dict()}))
    state = load_full_state(tmp_path / "ckpt")
    assert state.keys() == model.state_dict().keys()
    write_hf_config(cfg, tmp_path / "out")
    export_weights(tmp_path / "ckpt", cfg, tmp_path / "out", torch.float32, 10**6, None)
    back = load_hf_weights(tmp_path / "out")
    for name, value in model.state_dict().items():
        assert torch.equal(state[name], value) and torch.equal(back[name], value), name


def _saved(hf: NllbMoeForConditionalGeneration, path: Path) -> Path:
    hf.save_pretrained(path)
    return path


@pytest.mark.parametrize("num_experts", [0, 1])
def test_nllb_moe_config_without_two_experts_is_one_line_naming_the_field(num_experts: int) -> None:
    from models.errors import CheckpointMismatchError
    from models.hf import from_hf_config

    with pytest.raises(CheckpointMismatchError, match=rf"^num_experts={num_experts} .*valid: >= 2"):
        from_hf_config({**HF_CFG, "model_type": "nllb-moe", "num_experts": num_experts})
