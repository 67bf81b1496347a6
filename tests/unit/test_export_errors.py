"""`python -m trainer.export` in one process: a from-scratch checkpoint round trip, and its errors.

The checkpoint is written the way `trainer.checkpoint.save_checkpoint` lays it out
(DCP "model" + "optim", trainer_state.json, COMMITTED), without a process group.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from models.m2m100 import M2M100Translation, Seq2SeqBatch
from trainer.checkpoint.commit import COMMIT_MARKER
from trainer.export import main
from trainer.tokenizer.stock_m2m100 import run_layout
from trainer.tokenizer.vocab import SentencePieceTokenizer, Tokenizer, train_tokenizer

LANGS = ["de", "en"]
TEXTS = [f"{w} number {i} is here and there" for i in range(60) for w in ("hello", "hallo", "welt", "world")]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT/{tokenizer, checkpoint-3} of a tiny model built from scratch."""
    return write_run(tmp_path_factory.mktemp("run"), train_tokenizer(TEXTS, LANGS, 80))


def write_run(out: Path, tok: Tokenizer) -> Path:
    """OUT/{tokenizer, checkpoint-3, reference.pt} of a tiny random model (64 positions) for `tok`."""
    import torch.distributed.checkpoint as dcp

    tok.save(out / "tokenizer")
    config = ModelConfig.from_dict(
        dict(
            vocab_size=tok.vocab_size + 1,
            d_model=16,
            encoder_layers=1,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            **tok.special_ids(),
        )
    )
    torch.manual_seed(0)
    model = M2M100Translation(config)
    params = dict(model.named_parameters())
    optim = {
        k: {"exp_avg": torch.randn_like(p), "exp_avg_sq": torch.rand_like(p), "step": torch.tensor(3.0)}
        for k, p in params.items()
    }
    ckpt = out / "checkpoint-3"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"model": {k: p.detach() for k, p in params.items()}, "optim": optim},
            checkpoint_id=str(ckpt),
            no_dist=True,
        )
    state = {
        "step": 3,
        "mesh": {"pp": 1, "dp": 1, "tp": 1},
        "partition": [5],
        "model_config": config.to_dict(),
    }
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / COMMIT_MARKER).write_text("ok\n")
    torch.save(model.state_dict(), out / "reference.pt")
    return out


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_export_round_trip_logits_equal(run_dir: Path, tmp_path: Path) -> None:
    """A Unigram de/en run: the export is a stock M2M100Tokenizer (a slow tokenizer reading the
    SentencePiece model, so Unigram works too) and the model on its permuted ids."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    out = tmp_path / "hf"
    assert (
        main(["--checkpoint", str(run_dir / "checkpoint-3"), "--output", str(out), "--num_beams", "3"]) == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temp dir left
    config = ModelConfig.from_dict(
        json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())["model_config"]
    )
    ours = M2M100Translation(config).eval()
    ours.load_state_dict(torch.load(run_dir / "reference.pt"))
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out), src_lang="en")
    assert type(tok).__name__ == "M2M100Tokenizer"
    src = tok(["hello world", "number 7"], return_tensors="pt", padding=True)
    de = tok.get_lang_id("de")
    dec = torch.tensor([[2, de, 5, 6], [2, de, 7, 1]])  # export ids
    run_tok = Tokenizer.load(run_dir / "tokenizer")
    assert isinstance(run_tok, SentencePieceTokenizer)
    layout = run_layout(run_tok, config.vocab_size)
    assert layout is not None and layout.map_ids(torch.tensor([run_tok.lang_id("de")])).item() == de
    back = torch.empty(layout.size, dtype=torch.long)
    back[list(layout.new_id)] = torch.arange(len(layout.new_id))  # export ids -> ours
    batch = Seq2SeqBatch(back[src["input_ids"]], src["attention_mask"], back[dec], torch.full_like(dec, -100))
    with torch.no_grad():
        expected = ours(batch)
        got = hf(
            input_ids=src["input_ids"], attention_mask=src["attention_mask"], decoder_input_ids=dec
        ).logits
    torch.testing.assert_close(got[..., list(layout.new_id)], expected, rtol=1e-5, atol=1e-5)
    assert hf.generation_config.num_beams == 3 and hf.generation_config.decoder_start_token_id == 2


def test_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "hf")]) == 2
    assert "is not a directory" in _error_line(capsys)
    assert not (tmp_path / "hf").exists()


def test_incomplete_checkpoint(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "run" / "checkpoint-4"
    shutil.copytree(run_dir / "checkpoint-3", broken)
    (broken / COMMIT_MARKER).unlink()
    assert main(["--checkpoint", str(broken), "--output", str(tmp_path / "hf")]) == 2
    line = _error_line(capsys)
    assert COMMIT_MARKER in line and "incomplete" in line
    assert not (tmp_path / "hf").exists()


def test_no_tokenizer(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "run" / "checkpoint-3"
    shutil.copytree(run_dir / "checkpoint-3", ckpt)
    assert main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")]) == 2
    assert "no tokenizer found" in _error_line(capsys)
    assert (
        main(
            [
                "--checkpoint",
                str(ckpt),
                "--output",
                str(tmp_path / "hf"),
                "--tokenizer",
                str(run_dir / "tokenizer"),
            ]
        )
        == 0
    )


def test_non_empty_output(run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    args = ["--checkpoint", str(run_dir / "checkpoint-3"), "--output", str(out)]
    assert main(args) == 2
    assert "not empty" in _error_line(capsys)
    assert (out / "keep.txt").is_file()
    assert main([*args, "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_mismatched_model_config_writes_nothing(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    state_file = run / "checkpoint-3" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["model_config"]["decoder_layers"] = 3  # a layer the checkpoint does not hold
    state_file.write_text(json.dumps(state))
    assert main(["--checkpoint", str(run / "checkpoint-3"), "--output", str(tmp_path / "hf")]) == 2
    assert "does not fit" in _error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
