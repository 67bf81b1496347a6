"""`python -m trainer.export` in one process: a from-scratch checkpoint round trip, and its errors.

The checkpoint is written the way `trainer.checkpoint.save_checkpoint` lays it out
(DCP "model" + "optim", trainer_state.json, COMMITTED), without a process group.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from models.config import ModelConfig
from models.hf_save import EXPORT_DTYPES, parse_shard_size
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


def write_run(
    out: Path, tok: Tokenizer, init_std: float = 0.02, run_config: dict[str, object] | None = None
) -> Path:
    """OUT/{tokenizer, checkpoint-3, reference.pt} of a tiny random model (64 positions) for `tok`,
    its weights drawn with `init_std`; `run_config`: the resolved run config trainer_state.json records."""
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
            init_std=init_std,
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
        **({"config": run_config} if run_config is not None else {}),
    }
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / COMMIT_MARKER).write_text("ok\n")
    torch.save(model.state_dict(), out / "reference.pt")
    return out


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


@pytest.mark.parametrize(
    ("max_shard_size", "dtype", "shards"),
    [("5GB", "fp32", 1), ("16KB", "fp32", 3), ("8KiB", "bf16", 3)],
    ids=["one-file", "sharded", "sharded-bf16"],
)
def test_export_round_trip_logits_equal(
    run_dir: Path, tmp_path: Path, max_shard_size: str, dtype: str, shards: int
) -> None:
    """A Unigram de/en run: the export is a stock M2M100Tokenizer (a slow tokenizer reading the
    SentencePiece model, so Unigram works too) and the model on its permuted ids; in one
    model.safetensors, or (a small --max_shard_size) in several shards with their index, as
    --dtype says. A bf16 export's logits equal our model's with its weights rounded to bf16."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    out = tmp_path / "hf"
    args = ["--checkpoint", str(run_dir / "checkpoint-3"), "--output", str(out), "--num_beams", "3"]
    assert main([*args, "--max_shard_size", max_shard_size, "--dtype", dtype]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temp dir left
    files = sorted(p.name for p in out.glob("*.safetensors"))
    if shards == 1:
        assert files == ["model.safetensors"] and not (out / "model.safetensors.index.json").exists()
    else:
        assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
        assert len(files) >= shards, files
        _check_index(out, files, parse_shard_size(max_shard_size), EXPORT_DTYPES[dtype])
    config = ModelConfig.from_dict(
        json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())["model_config"]
    )
    ours = M2M100Translation(config).eval()
    reference = torch.load(run_dir / "reference.pt")
    ours.load_state_dict({k: v.to(EXPORT_DTYPES[dtype]).float() for k, v in reference.items()})
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config.get("dtype", hf_config.get("torch_dtype")) == str(EXPORT_DTYPES[dtype]).removeprefix(
        "torch."
    )
    # In fp32: loaded as bf16, HF would also compute its sinusoidal positions in bf16.
    hf = AutoModelForSeq2SeqLM.from_pretrained(str(out), dtype=torch.float32).eval()
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


def test_export_holds_one_output_shard_at_a_time(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: the streaming export kept the previous shard alive while reading the next (the
    361M export peaked at 0.73x its fp32 bytes with 300MB shards). Now no tensor of a written
    shard is alive when the checkpoint is read again, and each shard is read a batch of
    `READ_BATCH_BYTES` at a time (bf16: the fp32 reads never add up to a second shard)."""
    import weakref

    import safetensors.torch

    from trainer.checkpoint import hf_export

    written: list[weakref.ref[torch.Tensor]] = []  # every tensor of the shards written so far
    alive_at_read: list[int] = []
    save, read = safetensors.torch.save_file, hf_export.read_model_tensors

    def recording_save(tensors: dict[str, torch.Tensor], *args: object, **kwargs: object) -> None:
        save(tensors, *args, **kwargs)  # type: ignore[arg-type]
        written.extend(weakref.ref(t) for t in tensors.values())

    def checked_read(*args: object) -> dict[str, torch.Tensor]:
        alive_at_read.append(sum(r() is not None for r in written))
        return read(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(safetensors.torch, "save_file", recording_save)
    monkeypatch.setattr(hf_export, "read_model_tensors", checked_read)
    monkeypatch.setattr(hf_export, "READ_BATCH_BYTES", 4096)
    out = tmp_path / "hf"
    args = ["--checkpoint", str(run_dir / "checkpoint-3"), "--output", str(out)]
    assert main([*args, "--max_shard_size", "8KiB", "--dtype", "bf16"]) == 0
    shards = len(list(out.glob("*.safetensors")))
    assert shards >= 3 and len(alive_at_read) > shards, (shards, alive_at_read)
    assert written and alive_at_read == [0] * len(alive_at_read), alive_at_read


def test_export_and_translate_report_progress(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 30: both printed one line at the end. Now export says what it reads and writes and
    shows a bar over the bytes converted (with the shard), translate a bar over the lines; on
    stderr, so translate's stdout holds only the translations."""
    import io
    import logging

    from trainer import translate

    caplog.set_level(logging.INFO)
    out = tmp_path / "hf"
    args = ["--checkpoint", str(run_dir / "checkpoint-3"), "--output", str(out), "--max_shard_size", "8KiB"]
    assert main(args) == 0
    err = capsys.readouterr().err
    shards = len(list(out.glob("*.safetensors")))
    assert re.search(rf"export: 100%\|\S+\| [\d.]+k/[\d.]+k .*shard={shards}/{shards}\]", err), err[-2000:]
    said = [r.getMessage() for r in caplog.records if r.name == "trainer.export"]
    assert said[0] == f"reading {run_dir / 'checkpoint-3'} -> {out}", said
    assert re.fullmatch(rf"\d+ tensors, [\d.]+kB as float32, in {shards} shard\(s\)", said[1]), said
    stdout = io.StringIO()
    lines = "hello world\nnumber 7\nwelt\n"
    argv = ["--model", str(out), "--source_lang", "en", "--target_lang", "de", "--num_beams", "1",
            "--max_length", "6", "--batch_size", "2", "--device", "cpu"]  # fmt: skip
    assert translate.main(argv, stdin=io.StringIO(lines), stdout=stdout) == 0
    assert len(stdout.getvalue().splitlines()) == 3
    err = capsys.readouterr().err
    assert re.search(r"translate: 100%\|\S+\| 3/3 ", err), err[-2000:]
    said = [r.getMessage() for r in caplog.records if r.name == "trainer.translate"]
    assert said == ["3 lines en -> de, 1 beam(s), batches of 2, on cpu"], said


def _check_index(out: Path, files: list[str], max_bytes: int, dtype: torch.dtype) -> None:
    """The index maps every stored key to the shard that holds it; each shard keeps to the limit
    (a single tensor larger than it may not), and total_size is the tensors' bytes."""
    from safetensors import safe_open

    index = json.loads((out / "model.safetensors.index.json").read_text())
    found: dict[str, str] = {}
    total = 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            sizes = []
            for key in f.keys():
                t = f.get_tensor(key)
                assert t.dtype == dtype, (key, t.dtype)
                sizes.append(t.numel() * t.element_size())
                found[key] = name
        assert sum(sizes) <= max_bytes or len(sizes) == 1, (name, sizes)
        total += sum(sizes)
    assert index["weight_map"] == found and index["metadata"]["total_size"] == total
    assert "lm_head.weight" not in found and "model.shared.weight" in found  # tied copies: HF's key set


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--max_shard_size", "5XB", "'5XB' is not a size; valid: a positive number of bytes"),
        ("--max_shard_size", "0", "'0' is not a size"),
        ("--dtype", "float8", "--dtype 'float8' is not supported; valid: fp32, bf16, fp16"),
    ],
)
def test_bad_export_option(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, value: str, expected: str
) -> None:
    args = ["--checkpoint", str(run_dir / "checkpoint-3"), "--output", str(tmp_path / "hf")]
    assert main([*args, flag, value]) == 2
    line = _error_line(capsys)
    assert expected in line and flag in line, line
    assert not (tmp_path / "hf").exists()


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


def test_vocab_padding_rows_are_cut(run_dir: Path, tmp_path: Path) -> None:
    """A checkpoint whose shared embedding carries padding rows past vocab_size (a tp-padded
    vocabulary) exports the same files as one without them."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    padded = tmp_path / "run"
    shutil.copytree(run_dir, padded)
    ckpt = padded / "checkpoint-3"
    for f in ckpt.glob("*distcp"):
        f.unlink()
    (ckpt / ".metadata").unlink()
    state = torch.load(run_dir / "reference.pt")
    state["shared.weight"] = torch.cat(
        [state["shared.weight"], torch.full((3, state["shared.weight"].shape[1]), 9.0)]
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state}, checkpoint_id=str(ckpt), no_dist=True)
    outs = []
    for name, run in (("plain", run_dir), ("padded", padded)):
        outs.append(tmp_path / name)
        assert main(["--checkpoint", str(run / "checkpoint-3"), "--output", str(outs[-1])]) == 0
    plain, cut = (load_file(str(o / "model.safetensors")) for o in outs)
    assert plain.keys() == cut.keys() and all(torch.equal(plain[k], cut[k]) for k in plain)


def test_a_run_directory_names_its_latest_complete_checkpoint(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36: `trainer.export --checkpoint outputs/demo` (the run directory) said "no COMMITTED marker
    ... complete ones beside it: []"; `trainer.translate --model outputs/demo/checkpoint-400` failed with a
    cut-off AutoTokenizer message. Each now names what to pass, in one line."""
    from trainer import evaluate, translate

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    shutil.copytree(run / "checkpoint-3", run / "checkpoint-1")
    (run / "checkpoint-5").mkdir()  # a save that did not finish: never the one to pass
    latest = run / "checkpoint-3"
    assert main(["--checkpoint", str(run), "--output", str(tmp_path / "hf")]) == 2
    assert _error_line(capsys) == (
        f"trainer.export: error: --checkpoint '{run}' is a run directory, not a checkpoint; its latest "
        f"complete checkpoint is {latest} (complete: checkpoint-1, checkpoint-3): pass --checkpoint {latest}"
    )
    data = tmp_path / "data"
    data.mkdir()
    for lang in LANGS:
        (data / f"{lang}.txt").write_text("hello\n")
    flores = ["--data_dir", str(data), "--file_pattern", "{lang}.txt", "--directions", "en-de"]
    assert evaluate.main(["--model", str(run), *flores]) == 2
    assert _error_line(capsys).startswith(
        f"trainer.evaluate: error: --model '{run}' is a run directory, not a"
    )
    hf = run / "hf_export"
    for model, what in (
        (latest, "a training checkpoint"),
        (run, f"a run directory; its latest complete checkpoint is {latest}"),
    ):
        assert translate.main(["--model", str(model), "--source_lang", "en", "--target_lang", "de"]) == 2
        assert _error_line(capsys) == (
            f"trainer.translate: error: --model '{model}' is {what}, not a Hugging Face directory: export it "
            f"first: python -m trainer.export --checkpoint {latest} --output {hf}, then --model {hf} (or score "
            f"it as it is: python -m trainer.evaluate --model {latest} ...)"
        )
    for step in (1, 3):
        (run / f"checkpoint-{step}" / COMMIT_MARKER).unlink()
    assert main(["--checkpoint", str(run), "--output", str(tmp_path / "hf")]) == 2
    assert "is a run directory with no complete checkpoint" in _error_line(capsys)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("tool", "args", "message"),
    [
        ("export", ["--checkpoint", "c"], "the following arguments are required: --output"),
        ("export", ["--checkpoint", "c", "--output", "o", "--num_beams", "four"], "num_beams='four' is not an integer"),
        ("export", ["--checkpoint", "c", "--output", "o", "--num_beam", "4"],
         "unknown flag(s) ['--num_beam'] (num_beam: did you mean num_beams?); see --help for valid flags"),
        ("translate", ["--model", "m", "--source_lang", "en", "--target_lang", "de", "--batch_size", "1.5"],
         "batch_size='1.5' is not an integer"),
        ("evaluate", ["--model", "m", "--data_dir", "d", "--languages", "en", "de", "--num_beams", "x"],
         "num_beams='x' is not an integer"),
    ],
)  # fmt: skip
def test_a_bad_flag_is_one_line_not_a_usage_block(
    tool: str, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 36: export, translate and evaluate printed argparse's usage block (and `python -m
    trainer.plan` too: tests/unit/test_plan.py) for a bad value, where trainer.train says one line."""
    import importlib

    assert importlib.import_module(f"trainer.{tool}").main(args) == 2
    assert _error_line(capsys) == f"trainer.{tool}: error: {message}"
