"""Resume checks against the checkpoint's run, on hand-made run directories (pure: no processes).

The end-to-end story (a resumed `trainer.train` run; a mismatch leaving output_dir
byte-identical) is tests/dist/test_resume.py.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from parallel.mesh import ParallelDims
from trainer.checkpoint.resume import MAY_CHANGE, MUST_MATCH, find_resume, run_identity
from trainer.config.dims import parallel_dims
from trainer.config.parse import load_config_dict
from trainer.config.schema import SECTIONS, JobConfig
from trainer.errors import ConfigError

BASE = {"dataset_name": "builtin", "language_pairs": ["en-de"], "vocab_size": 1000, "d_model": 64,
        "per_device_train_batch_size": 8, "num_microbatches": 1}  # fmt: skip


def _cfg(out: Path, **kw: Any) -> JobConfig:
    return load_config_dict({**BASE, "output_dir": str(out), "resume_from_checkpoint": "latest", **kw})


def _dims(cfg: JobConfig, world: int) -> ParallelDims:
    return parallel_dims(cfg.parallel, world, local_world_size=world).validate()


def _run_dir(tmp: Path, with_config: bool = True, **kw: Any) -> Path:
    """A run's output_dir with tokenizer/ and a committed checkpoint-2 of a 1-rank mesh."""
    out = tmp / "run"
    (out / "tokenizer").mkdir(parents=True)
    (out / "tokenizer" / "sentencepiece.model").write_bytes(b"spm bytes")
    cfg = _cfg(out, **kw)
    ck = out / "checkpoint-2"
    ck.mkdir()
    state = {
        "step": 2,
        "data": {"global_batch_size": 8},
        "mesh": {"pp": 1, "dp": 1, "tp": 1},
        "model_config": {},
    }
    if with_config:
        state.update(run_identity(cfg, out / "tokenizer"))
    else:  # a checkpoint written before trainer_state.json held the config: config.yaml is read
        cfg.save(out / "config.yaml")
    (ck / "trainer_state.json").write_text(json.dumps(state))
    (ck / "COMMITTED").write_text("ok\n")
    return out


def test_every_config_field_is_classified_once() -> None:
    """A new config field must be decided: may it change on resume or not?"""
    must = [n for names in MUST_MATCH.values() for n in names]
    names = [f.name for cls in SECTIONS for f in fields(cls)]
    assert sorted(must + list(MAY_CHANGE)) == sorted(names)


@pytest.mark.parametrize("with_config", [True, False], ids=["trainer_state", "config.yaml"])
@pytest.mark.parametrize(
    "change,message",
    [
        (
            {"spm_model_type": "unigram"},
            r"spm_model_type='unigram' but the checkpoint's run has 'bpe' \(tokenizer\)",
        ),
        ({"vocab_size": 800}, r"vocab_size=800 but the checkpoint's run has 1000 \(tokenizer\)"),
        ({"tokenizer_name": "/tok"}, r"tokenizer_name='/tok' but the checkpoint's run has None"),
        ({"encoder_layers": 4}, r"encoder_layers=4 but the checkpoint's run has 3 \(model\)"),
        (
            {"language_pairs": ["en-fr"]},
            r"language_pairs=\['en-fr'\] but the checkpoint's run has \['en-de'\]",
        ),
        ({"warmup_steps": 5}, r"warmup_steps=5 but the checkpoint's run has 0 \(lr schedule\)"),
    ],
)
def test_must_match_fields_name_field_old_and_new(
    tmp_path: Path, with_config: bool, change: dict, message: str
) -> None:
    out = _run_dir(tmp_path, with_config)
    cfg = _cfg(out, **change)
    with pytest.raises(ConfigError, match=rf"resume_from_checkpoint=.*checkpoint-2: {message}"):
        find_resume(cfg, _dims(cfg, 1))


def test_global_batch_must_match_but_the_mesh_may_change(tmp_path: Path) -> None:
    out = _run_dir(tmp_path)
    cfg = _cfg(out, per_device_train_batch_size=4)
    with pytest.raises(
        ConfigError,
        match=r"global batch 4 = per_device_train_batch_size\(4\) x num_microbatches\(1\) x "
        r"gradient_accumulation_steps\(1\) x dp\(1\) but the checkpoint's run has 8 = "
        r"per_device_train_batch_size\(8\) .* x dp\(1\); a different mesh is fine",
    ):
        find_resume(cfg, _dims(cfg, 1))
    # dp=2 x 4 pairs, or 2 micro-batches of 2 pairs x 2 flushes, on tp=2: the same 8 pairs.
    cfg = _cfg(out, per_device_train_batch_size=2, num_microbatches=2, gradient_accumulation_steps=2,
               tensor_parallel_size=2, max_steps=20, logging_steps=5)  # fmt: skip
    point = find_resume(cfg, _dims(cfg, 2))
    assert point is not None and point.step == 2
    assert "max_steps: -1 -> 20" in point.changes and "tensor_parallel_size: 1 -> 2" in point.changes


def test_tokenizer_rewritten_after_the_checkpoint_is_refused(tmp_path: Path) -> None:
    """Was: a resume with other SentencePiece settings retrained and overwrote tokenizer/, so the
    checkpoint's token ids no longer matched it; an overwritten tokenizer/ is now caught."""
    out = _run_dir(tmp_path)
    (out / "tokenizer" / "sentencepiece.model").write_bytes(b"retrained")
    cfg = _cfg(out)
    with pytest.raises(ConfigError, match=r"is not the tokenizer the checkpoint was trained with"):
        find_resume(cfg, _dims(cfg, 1))
    (out / "tokenizer" / "sentencepiece.model").unlink()
    (out / "tokenizer").rmdir()
    with pytest.raises(ConfigError, match=r"the run has no tokenizer/ at"):
        find_resume(cfg, _dims(cfg, 1))


def test_resume_into_another_output_dir(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    other = tmp_path / "other"
    cfg = _cfg(other, resume_from_checkpoint=str(run / "checkpoint-2"))
    point = find_resume(cfg, _dims(cfg, 1))
    assert (
        point is not None
        and point.run_dir == run
        and f"output_dir: {str(run)!r} -> {str(other)!r}" in point.changes
    )
    (other / "tokenizer").mkdir(parents=True)
    (other / "tokenizer" / "sentencepiece.model").write_bytes(b"another run's")
    with pytest.raises(ConfigError, match=r"output_dir='.*other' holds a tokenizer/ different from"):
        find_resume(cfg, _dims(cfg, 1))


def test_max_steps_below_the_checkpoint_step(tmp_path: Path) -> None:
    cfg = _cfg(_run_dir(tmp_path), max_steps=1)
    with pytest.raises(
        ConfigError, match=r"max_steps=1 is below the step of .*checkpoint-2 \(2\); valid: max_steps >= 2"
    ):
        find_resume(cfg, _dims(cfg, 1))


def test_nothing_to_resume(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path / "empty")
    assert find_resume(cfg, _dims(cfg, 1)) is None


def test_epoch_runs_resume_and_hf_fields_may_change(tmp_path: Path) -> None:
    """max_steps=-1 (from num_train_epochs) is resolved after the data is read, so find_resume lets
    it through; the run_translation fields (strategies, best model, epochs) may change."""
    out = _run_dir(tmp_path, max_steps=4)
    cfg = _cfg(out, num_train_epochs=2.0, eval_strategy="epoch", save_strategy="epoch",
               load_best_model_at_end=True)  # fmt: skip
    point = find_resume(cfg, _dims(cfg, 1))
    assert point is not None and "max_steps: 4 -> -1" in point.changes
    assert "load_best_model_at_end: False -> True" in point.changes
    with pytest.raises(ConfigError, match=r"max_steps=1 is below the step of resume_from_checkpoint"):
        find_resume(_cfg(out, max_steps=1), _dims(cfg, 1))
