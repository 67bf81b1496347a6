"""Export and use, end to end: stock `transformers` models into 3D training, and 3D checkpoints back out.

One 8-rank gloo run (pp=2, dp=2, tp=2; two optimizer steps, dropout off)
fine-tunes a random-init stock `M2M100ForConditionalGeneration` given as
`model_name_or_path` (one run for both checks: spawning 8 ranks dominates the
cost on a small machine):

(b) import: the step-0 `eval_loss` logged by the trainer equals the stock
    model's loss on the same eval batches, so the weights landed in the right
    pipeline stages and tensor-parallel shards;
(a) export: `python -m trainer.export` on the last (3D, DCP) checkpoint gives a
    directory that `AutoModelForSeq2SeqLM` / `AutoTokenizer` load, whose loss on
    the trainer's eval batches equals the final logged `eval_loss`; `generate`
    runs, and `python -m trainer.translate` maps 2 stdin lines to 2 stdout lines.

tests/unit/test_export_errors.py covers a checkpoint of a model built from
scratch (single process) and the CLI's errors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from tests.dist.harness import run_distributed
from tests.served import Served

if TYPE_CHECKING:
    from trainer.tokenizer.stock_m2m100 import StockLayout

ROOT = Path(__file__).resolve().parents[2]
REL_TOL = 1e-5
MESH = {
    "pipeline_parallel_size": 2,
    "tensor_parallel_size": 2,
    "data_parallel_size": 2,
    "num_microbatches": 2,
}
ENV = {"HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _values(output_dir: Path, **extra: Any) -> dict[str, Any]:
    """configs/tiny.yaml, small and deterministic (dropout off), on the 2x2x2 mesh."""
    values = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    values.update(MESH)
    values.update(
        max_steps=2,
        do_eval=True,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        output_dir=str(output_dir),
        overwrite_output_dir=True,
        disable_tqdm=True,
        report_to="none",
        plots=False,
        builtin_size=400,
        max_eval_samples=16,
        generation_max_length=8,
        generation_num_beams=1,
    )
    values.update(extra)
    return values


def train_worker(rank: int, world_size: int, values: dict[str, Any]) -> None:
    from trainer.config.parse import load_config_dict
    from trainer.run.loop import run

    run(load_config_dict(values))


def _train(values: dict[str, Any]) -> list[dict[str, Any]]:
    os.environ.update(ENV)
    run_distributed(train_worker, 8, args=(values,), timeout=200, env=ENV, collective_timeout=150)
    lines = (Path(values["output_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def _eval_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if "eval_loss" in r]


def stock_eval_loss(
    model_dir: Path, values: dict[str, Any], layout: StockLayout | None = None, our_rows: bool = True
) -> float:
    """Token-weighted mean CE of the stock HF model in `model_dir` over the run's eval batches.

    An export in the stock M2M100 vocabulary (`layout`) is fed the batches' ids mapped to its
    own; `our_rows` scores its logits at the run's ids only (then the loss is the trainer's),
    else over its whole vocabulary, whose new rows (untrained codes, madeup words) add mass.
    """
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForSeq2SeqLM

    from trainer.config.parse import load_config_dict
    from trainer.data.batching import eval_batches
    from trainer.data.sources import load_raw_datasets, run_languages
    from trainer.data.tokenization import tokenize_datasets
    from trainer.tokenizer.vocab import Tokenizer

    cfg = load_config_dict(values)
    tok = Tokenizer.load(Path(values["output_dir"]) / "tokenizer", run_languages(cfg.data))
    data = tokenize_datasets(load_raw_datasets(cfg.data, cfg.training.seed), tok, cfg.data)
    model = AutoModelForSeq2SeqLM.from_pretrained(str(model_dir)).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for batches in eval_batches(data, tok, cfg.training.per_device_eval_batch_size).values():
            for eb in batches:
                b = eb.batch
                ids, dec, labels = b.input_ids, b.decoder_input_ids, b.labels
                if layout is not None:
                    ids, dec = layout.map_ids(ids), layout.map_ids(dec)
                logits = model(input_ids=ids, attention_mask=b.attention_mask, decoder_input_ids=dec).logits
                if layout is not None and our_rows:
                    logits = logits[..., list(layout.new_id)]  # (B, T, V): back in our id order
                elif layout is not None:
                    labels = layout.map_ids(labels)
                total += F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).double(),
                    labels.reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                ).item()
                count += int((b.labels != -100).sum())
    assert count > 0
    return total / count


def _python_m(served: Served, module: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = served.environ(**ENV)
    return subprocess.run(
        served.cmd("-m", module, *args),
        input=stdin,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )


def _stock_model(tmp: Path, values: dict[str, Any]) -> Path:
    """A random-init stock M2M100 (+ the tokenizer the run would train) saved in `tmp`/stock."""
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration

    from trainer.config.parse import load_config_dict
    from trainer.data.sources import load_raw_datasets, run_languages, training_texts
    from trainer.tokenizer.vocab import load_or_train_tokenizer

    cfg = load_config_dict(values)
    raw = load_raw_datasets(cfg.data, cfg.training.seed)
    tok = load_or_train_tokenizer(
        None,
        run_languages(cfg.data),
        training_texts(raw.train),
        cfg.model.vocab_size,
        cfg.data.spm_model_type,
        cfg.data.spm_character_coverage,
        cfg.data.spm_input_sentence_size,
        cfg.training.seed,
    )
    ids = tok.special_ids()
    torch.manual_seed(123)
    config = M2M100Config(
        vocab_size=tok.vocab_size + 3,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=128,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        init_std=0.1,
        pad_token_id=ids["pad_token_id"],
        bos_token_id=ids["bos_token_id"],
        eos_token_id=ids["eos_token_id"],
        decoder_start_token_id=ids["decoder_start_token_id"],
    )
    hf_dir = tmp / "stock"
    M2M100ForConditionalGeneration(config).save_pretrained(str(hf_dir), safe_serialization=True)
    tok.save(hf_dir)
    return hf_dir


@pytest.fixture(scope="module")
def finetuned_3d(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], list[dict[str, Any]], Path]:
    """(run values, metrics rows, stock model dir) of a 2-step 3D fine-tune of a stock HF model."""
    tmp = tmp_path_factory.mktemp("export3d")
    values = _values(tmp / "run")
    hf_dir = _stock_model(tmp, values)
    values["model_name_or_path"] = str(hf_dir)
    return values, _train(values), hf_dir


@pytest.mark.dist
def test_stock_hf_model_loads_into_3d_model(
    finetuned_3d: tuple[dict[str, Any], list[dict[str, Any]], Path],
) -> None:
    values, rows, hf_dir = finetuned_3d
    step0 = [r for r in _eval_rows(rows) if r["step"] == 0]
    assert step0, rows
    trainer_loss = step0[0]["eval_loss"]
    stock_loss = stock_eval_loss(hf_dir, values)
    print(
        f"\nHF import: trainer step-0 eval_loss {trainer_loss:.8f}  stock HF {stock_loss:.8f}  "
        f"rel {abs(stock_loss - trainer_loss) / trainer_loss:.2e}"
    )
    assert stock_loss == pytest.approx(trainer_loss, rel=REL_TOL)


@pytest.mark.dist
def test_export_from_3d_checkpoint_matches_trainer_eval_loss(
    finetuned_3d: tuple[dict[str, Any], list[dict[str, Any]], Path], served: Served, tmp_path: Path
) -> None:
    values, rows, _ = finetuned_3d
    ckpt = Path(values["output_dir"]) / "checkpoint-2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["mesh"] == {"pp": 2, "dp": 2, "tp": 2}

    export_dir = tmp_path / "hf"
    res = _python_m(
        served,
        "trainer.export",
        "--checkpoint",
        str(ckpt),
        "--output",
        str(export_dir),
        "--num_beams",
        "2",
        "--max_length",
        "16",
    )
    assert res.returncode == 0, res.stderr
    for name in ("config.json", "model.safetensors", "generation_config.json", "vocab.json"):
        assert (export_dir / name).is_file(), name
    gen = json.loads((export_dir / "generation_config.json").read_text())
    assert (gen["num_beams"], gen["max_length"], gen["decoder_start_token_id"]) == (2, 16, 2)
    assert gen["renormalize_logits"] is True and gen["bad_words_ids"]  # the stock rows the run never had
    # A fine-tune of a stock model (which records no directions) may know more than its run's: no record.
    assert "trained_language_pairs" not in json.loads((export_dir / "config.json").read_text())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dir left behind"

    evals = _eval_rows(rows)
    trainer_loss = evals[-1]["eval_loss"]
    assert evals[-1]["step"] == 2 and abs(trainer_loss - evals[0]["eval_loss"]) > 1e-4, (
        "training changed nothing"
    )
    from trainer.tokenizer.stock_m2m100 import run_layout
    from trainer.tokenizer.vocab import SentencePieceTokenizer, Tokenizer

    run_tok = Tokenizer.load(Path(values["output_dir"]) / "tokenizer")
    assert isinstance(run_tok, SentencePieceTokenizer)
    layout = run_layout(run_tok, state["model_config"]["vocab_size"])
    assert layout is not None  # en, de, fr: the export is in the stock M2M100 vocabulary
    stock_loss = stock_eval_loss(export_dir, values, layout)
    full_vocab = stock_eval_loss(export_dir, values, layout, our_rows=False)
    print(
        f"\n3D export: trainer eval_loss {trainer_loss:.8f}  stock HF {stock_loss:.8f}  "
        f"rel {abs(stock_loss - trainer_loss) / trainer_loss:.2e}  (over all {layout.size} rows: {full_vocab:.6f})"
    )
    # The new rows take some probability (trainer.tokenizer.stock_m2m100); generation_config.json
    # keeps them out of decoding, so the export decodes as the checkpoint (tests/dist/test_evaluate_3d.py).
    assert full_vocab > stock_loss
    assert stock_loss == pytest.approx(trainer_loss, rel=REL_TOL)

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(export_dir))
    model = AutoModelForSeq2SeqLM.from_pretrained(str(export_dir)).eval()
    de = tok.get_lang_id("de")  # a stock M2M100Tokenizer: en, de, fr are stock M2M100 codes
    tok.src_lang = "en"
    enc = tok(["one hundred", "twenty two"], return_tensors="pt", padding=True)
    generated = model.generate(**enc, forced_bos_token_id=de, max_length=8)
    assert generated.shape[0] == 2 and (generated[:, 1] == de).all()

    res = _python_m(
        served,
        "trainer.translate",
        "--model",
        str(export_dir),
        "--source_lang",
        "en",
        "--target_lang",
        "de",
        "--num_beams",
        "2",
        "--max_length",
        "12",
        stdin="one hundred\ntwenty two\n",
    )
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.splitlines()) == 2, res.stdout
