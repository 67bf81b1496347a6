"""A pretrained model keeps its vocabulary (`trainer.config.pretrained`).

Regressions (issue 23):
- fine-tuning from a Hugging Face model directory with weights and config only exited 0: a new
  SentencePiece tokenizer was trained on the data and the pretrained embeddings were trained
  against its unrelated ids. Now the directory needs `tokenizer_name`, or one line says so;
- a tokenizer whose ids do not fit the model's embedding was accepted when smaller;
- `model_name_or_path` took only a local directory: a hub name with a populated cache
  (HF_HUB_OFFLINE=1) failed. It resolves through huggingface_hub's cache now.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from models.config import ModelConfig
from models.hf_save import save_hf_model
from models.m2m100 import M2M100Translation
from tests.corpus_data import read_lines
from tests.served import Served
from trainer.config.parse import parse_config
from trainer.config.pretrained import check_tokenizer_fits, pretrained_sources
from trainer.errors import ConfigError, TokenizerError
from trainer.run.preflight import validate_early
from trainer.tokenizer.vocab import Tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
LANGS = ["de", "en"]
REPO = "polyglot-test/tiny-m2m100"  # a hub name, present only in the cache the tests write
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _model_dir(path: Path, vocab_size: int) -> Path:
    """A tiny M2M100 directory as `save_pretrained` writes it: config.json and safetensors only."""
    mc = ModelConfig(vocab_size=vocab_size, d_model=16, encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                     decoder_ffn_dim=32)  # fmt: skip
    save_hf_model(M2M100Translation(mc).state_dict(), mc, path)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory, multi30k: Path) -> Path:
    texts = [line.strip() for lang in LANGS for line in read_lines(multi30k, "train", lang, 300)]
    path = tmp_path_factory.mktemp("tok")
    train_tokenizer(texts, LANGS, 200, seed=0).save(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.load(tok_dir, LANGS)


def _config(**values: str):  # type: ignore[no-untyped-def]
    flags = [x for k, v in values.items() for x in (f"--{k}", v)]
    return parse_config(["--config", TINY, "--language_pairs", "en-de", "de-en", *flags])


def test_model_dir_without_tokenizer_files_needs_tokenizer_name(
    tok: Tokenizer, tok_dir: Path, tmp_path: Path
) -> None:
    bare = _model_dir(tmp_path / "bare", tok.vocab_size)
    with pytest.raises(ConfigError) as info:
        validate_early(_config(model_name_or_path=str(bare)), world=1)
    msg = str(info.value)
    assert "\n" not in msg and "holds no tokenizer files" in msg and "set tokenizer_name" in msg, msg
    cfg = _config(model_name_or_path=str(bare), tokenizer_name=str(tok_dir))
    assert validate_early(cfg, world=1).world_size == 1
    assert pretrained_sources(str(bare), str(tok_dir)).tokenizer == tok_dir
    shutil.copytree(tok_dir, bare, dirs_exist_ok=True)  # the model's own tokenizer: used as it is
    assert pretrained_sources(str(bare), None).tokenizer == bare


def test_tokenizer_must_fit_the_pretrained_embedding(tok: Tokenizer, tmp_path: Path) -> None:
    n = tok.vocab_size
    check_tokenizer_fits(tok, _model_dir(tmp_path / "same", n), "tok", LANGS)
    check_tokenizer_fits(tok, _model_dir(tmp_path / "padded", n + 6), "tok", LANGS)  # padded rows: fine
    for rows in (n - 1, n + 200):  # ids past the rows; most rows another tokenizer's
        with pytest.raises(TokenizerError) as info:
            check_tokenizer_fits(tok, _model_dir(tmp_path / f"rows{rows}", rows), "tok", LANGS)
        msg = str(info.value)
        assert "\n" not in msg and f"has {n} ids" in msg and f"has {rows} rows" in msg, msg
    other = _model_dir(tmp_path / "pad0", n)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "pad_token_id": 0, "bos_token_id": 1}))
    with pytest.raises(TokenizerError, match="has pad id 1 but the model .* was trained with 0"):
        check_tokenizer_fits(tok, other, "tok", LANGS)


def _hub_cache(cache: Path, files: list[Path]) -> Path:
    """huggingface_hub's cache layout for REPO at COMMIT (refs/main -> snapshots/COMMIT/...)."""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for src in files:
        for f in src.iterdir():
            shutil.copy(f, snapshot / f.name)
    return snapshot


def test_hub_name_resolves_through_the_cache_offline(
    tok: Tokenizer, tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import constants

    model = _model_dir(tmp_path / "model", tok.vocab_size)
    snapshot = _hub_cache(tmp_path / "hub", [model, tok_dir])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    sources = pretrained_sources(REPO, REPO)
    assert sources.model == sources.tokenizer and sources.model.resolve() == snapshot.resolve()
    assert validate_early(_config(model_name_or_path=REPO), world=1).world_size == 1
    with pytest.raises(ConfigError) as info:
        pretrained_sources("polyglot-test/not-cached", None)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(
        "model_name_or_path='polyglot-test/not-cached' is not a directory"
    )
    assert "hf download polyglot-test/not-cached" in msg


@pytest.mark.slow
def test_fine_tune_from_a_hub_name_in_the_offline_cache(
    served: Served, tok: Tokenizer, tok_dir: Path, tmp_path: Path
) -> None:
    """`python -m trainer.train --model_name_or_path org/name` with HF_HUB_OFFLINE=1 and the model in
    HF_HUB_CACHE: trains from the cached weights with the cached tokenizer's ids (one process)."""
    # The session's served Python reads HF_HUB_CACHE (offline): the model goes into that cache.
    hub = Path(served.env["HF_HUB_CACHE"])
    snapshot = _hub_cache(hub, [_model_dir(tmp_path / "model", tok.vocab_size), tok_dir])
    out = tmp_path / "out"
    env = served.environ()
    cmd = [served.python, "-m", "trainer.train", "--config", TINY, "--output_dir", str(out),
           "--model_name_or_path", REPO, "--language_pairs", "en-de", "--max_steps", "2", "--do_eval", "false",
           "--builtin_size", "200", "--max_source_length", "24", "--max_target_length", "24"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    run_tok = Tokenizer.load(out / "tokenizer", LANGS)
    assert run_tok.vocab_size == tok.vocab_size and run_tok.lang_id("de") == tok.lang_id("de")
    assert json.loads((out / "model_config.json").read_text())["d_model"] == 16  # the cached model's
    assert snapshot.is_dir()
