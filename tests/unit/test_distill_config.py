"""Word-level distillation's options and checks before anything runs (`trainer.run.distill`, preflight).

A teacher and a student must share the vocabulary and the tags: the KL term compares the two
distributions id by id. A mismatch is one line naming both tokenizers, raised by
`validate_early` before output_dir exists; so are the options that do nothing without a teacher.
A new student takes the teacher's tokenizer (a tokenizer trained on the data could never match),
and a dense student may spread an NLLB-MoE teacher's experts over ep.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from models.config import ModelConfig
from models.hf_save import write_hf_config
from parallel.errors import ParallelConfigError
from trainer.config.parse import parse_config
from trainer.errors import ConfigError, TokenizerError
from trainer.run.distill import student_tokenizer_dir
from trainer.run.preflight import idle_option_warnings, validate_early
from trainer.tokenizer.vocab import train_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")
LANGS = ["de", "en"]
SYLLABLES = "ka to mi re su no ha ri be la do fu ge zu".split()


def _texts(seed: int) -> list[str]:
    """Sentences of made-up words, different for another seed."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(300)]
    return [" ".join(rng.choice(words) for _ in range(10)) for _ in range(600)]


def _teacher(path: Path, seed: int, vocab: int, **arch: int) -> Path:
    """A teacher directory: config.json and a tokenizer's HF files (the checks read no weights)."""
    tok = train_tokenizer(_texts(seed), LANGS, vocab, seed=0)
    sizes = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64)  # fmt: skip
    write_hf_config(ModelConfig(vocab_size=tok.vocab_size, **{**sizes, **arch}, **tok.special_ids()), path)  # type: ignore[arg-type]
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("teachers")
    return {
        "teacher": _teacher(root / "teacher", 0, 100),
        "other": _teacher(root / "other", 1, 100),  # same size, other pieces
        "smaller": _teacher(root / "smaller", 0, 90),
        "moe": _teacher(root / "moe", 0, 100, num_experts=4, encoder_sparse_step=2, decoder_sparse_step=2),
    }


def _config(tmp_path: Path, **values: object):  # type: ignore[no-untyped-def]
    flags = [x for k, v in values.items() for x in (f"--{k}", str(v))]
    out = ["--output_dir", str(tmp_path / "out")]
    return parse_config(["--config", TINY, "--language_pairs", "en-de", "de-en", *out, *flags])


@pytest.mark.parametrize(
    "student,says",
    [("other", "is '"), ("smaller", "90 vs 100 ids")],
    ids=["other-pieces", "other-size"],
)
def test_a_vocabulary_mismatch_is_refused_naming_both_tokenizers(dirs, tmp_path, student, says) -> None:
    cfg = _config(tmp_path, teacher_model_name_or_path=dirs["teacher"], tokenizer_name=dirs[student])
    with pytest.raises(TokenizerError) as info:
        validate_early(cfg, world=1)
    msg = str(info.value)
    assert "\n" not in msg and str(dirs[student]) in msg and str(dirs["teacher"]) in msg and says in msg, msg
    assert not (tmp_path / "out").exists()


def test_a_new_student_takes_the_teachers_tokenizer(dirs, tmp_path) -> None:
    cfg = _config(tmp_path, teacher_model_name_or_path=dirs["teacher"])
    assert student_tokenizer_dir(cfg) == dirs["teacher"]
    assert validate_early(cfg, world=1).world_size == 1
    cfg = _config(tmp_path, teacher_model_name_or_path=dirs["teacher"], tokenizer_name=dirs["teacher"])
    assert validate_early(cfg, world=1).world_size == 1


def test_distillation_options_need_a_teacher(dirs, tmp_path) -> None:
    for name, value in (("distillation_alpha", 0.3), ("distillation_temperature", 2.0)):
        with pytest.raises(ConfigError, match=f"{name}=.* does nothing without teacher_model_name_or_path"):
            validate_early(_config(tmp_path, **{name: value}), world=1)
    for name, value in (("distillation_alpha", 1.5), ("distillation_temperature", 0.0)):
        with pytest.raises(ConfigError, match=name):
            _config(tmp_path, **{name: value})
    cfg = _config(tmp_path, teacher_model_name_or_path=dirs["teacher"], distillation_alpha=0.0)
    assert any("distillation_alpha=0" in line for line in idle_option_warnings(cfg))


def test_a_teacher_that_is_neither_a_model_nor_a_checkpoint(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="teacher_model_name_or_path=.* neither an HF model directory"):
        validate_early(_config(tmp_path, teacher_model_name_or_path=tmp_path / "empty"), world=1)


def test_ep_spreads_an_moe_teachers_experts_over_a_dense_students_replicas(dirs, tmp_path) -> None:
    mesh = dict(data_parallel_size=2, expert_parallel_size=2)
    cfg = _config(tmp_path, teacher_model_name_or_path=dirs["moe"], **mesh)
    assert validate_early(cfg, world=2).ep == 2
    with pytest.raises(ParallelConfigError, match="expert_parallel_size=2 needs a sparse"):
        validate_early(_config(tmp_path, teacher_model_name_or_path=dirs["teacher"], **mesh), world=2)
    with pytest.raises(ParallelConfigError, match="tensor_parallel_size=3"):
        validate_early(_config(tmp_path, teacher_model_name_or_path=dirs["teacher"], tensor_parallel_size=3,
                               d_model=48, encoder_attention_heads=3, decoder_attention_heads=3,
                               encoder_ffn_dim=96, decoder_ffn_dim=96), world=3)  # fmt: skip


def test_an_unfinished_checkpoint_is_no_teacher(tmp_path) -> None:
    ckpt = tmp_path / "run" / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    with pytest.raises(ConfigError, match="teacher_model_name_or_path=.* has no COMMITTED marker"):
        validate_early(_config(tmp_path, teacher_model_name_or_path=ckpt), world=1)
