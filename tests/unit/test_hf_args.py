"""run_translation / Seq2SeqTrainingArguments names with the HF Trainer's meaning (pure: no processes).

Regression: a run_translation config was rejected (`do_train`, `eval_strategy`, `forced_bos_token`,
`fp16: false`, `num_train_epochs`, `predict_with_generate`, `source_prefix`), and an HF name we spell
differently (`evaluation_strategy`, `gradient_checkpointing`) failed as a bare "unknown key".
The decisions (`trainer.strategies`) are checked here on numbers; tests/dist/test_run_translation_style.py
runs them end to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer.checkpoint.dcp import rotation_victims
from trainer.config.data_args import DataArguments
from trainer.config.parse import load_config_dict, parse_config
from trainer.config.training_args import TrainingArguments
from trainer.errors import ConfigError
from trainer.run.strategies import BestModel, check_metric_name, interval_due, resolve_max_steps

ROOT = Path(__file__).resolve().parents[2]
STYLE = str(ROOT / "configs/run_translation_style.yaml")
TINY = str(ROOT / "configs/tiny.yaml")


def test_run_translation_style_config_parses_with_hf_defaults() -> None:
    cfg = parse_config(["--config", STYLE])
    t = cfg.training
    assert (t.max_steps, t.num_train_epochs, t.eval_strategy, t.save_strategy) == (-1, 10.0, "epoch", "epoch")
    assert (
        t.metric_for_best_model == "eval_loss" and t.greater_is_better is False and t.load_best_model_at_end
    )
    assert cfg.data.test_file and Path(ROOT / cfg.data.test_file).is_file()
    assert all((ROOT / getattr(cfg.data, f)).is_file() for f in ("train_file", "validation_file"))


def test_max_steps_overrides_epochs_as_in_hf() -> None:
    assert resolve_max_steps(TrainingArguments(max_steps=7, num_train_epochs=100), 10) == 7
    assert resolve_max_steps(TrainingArguments(num_train_epochs=3), 10) == 30
    assert resolve_max_steps(TrainingArguments(num_train_epochs=0.25), 10) == 3  # ceil of 2.5
    assert resolve_max_steps(TrainingArguments(num_train_epochs=0.01), 10) == 1
    with pytest.raises(ConfigError, match=r"max_steps=0 must be >= 1, or -1 to train num_train_epochs"):
        TrainingArguments(max_steps=0)
    with pytest.raises(ConfigError, match=r"num_train_epochs=0 must be > 0"):
        TrainingArguments(num_train_epochs=0)


def test_interval_strategies() -> None:
    due = [s for s in range(1, 13) if interval_due("steps", 4, s, 5)]
    assert due == [4, 8, 12]
    assert [s for s in range(1, 13) if interval_due("epoch", 4, s, 5)] == [5, 10]
    assert not any(interval_due("no", 1, s, 1) for s in range(1, 5))
    assert not any(interval_due("steps", 0, s, 1) for s in range(1, 5))  # 0: only at the end
    with pytest.raises(ConfigError, match=r"eval_strategy='sometimes' is not valid; choose one of"):
        TrainingArguments(eval_strategy="sometimes")


def test_best_metric_defaults_follow_hf() -> None:
    a = TrainingArguments(load_best_model_at_end=True, eval_steps=2, save_steps=4)
    assert (a.metric_for_best_model, a.greater_is_better) == ("eval_loss", False)
    b = TrainingArguments(early_stopping_patience=2, eval_steps=2, metric_for_best_model="bleu")
    assert (b.metric_for_best_model, b.greater_is_better) == ("eval_bleu", True)
    c = TrainingArguments(early_stopping_patience=2, eval_steps=2, metric_for_best_model="bleu",
                          greater_is_better=False)  # fmt: skip
    assert c.greater_is_better is False


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"eval_steps": 2, "save_steps": 3}, r"save_steps to be a multiple of eval_steps, got save_steps=3"),
        ({"eval_strategy": "epoch", "save_strategy": "steps"}, r"needs save_strategy == eval_strategy"),
        ({"eval_strategy": "no"}, r"load_best_model_at_end needs evaluations during training"),
        ({"eval_steps": 0}, r"eval_strategy='steps', eval_steps=0"),
    ],
)
def test_best_model_needs_matching_strategies(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainingArguments(load_best_model_at_end=True, **kw)  # type: ignore[arg-type]


def test_best_model_and_early_stopping_follow_hf_callback() -> None:
    """Best moves on any strict improvement; patience counts evaluations not better by > threshold."""
    best = BestModel("eval_loss", greater_is_better=False)
    losses = [5.0, 4.0, 3.95, 3.96, 3.5]
    improved, counters = [], []
    for step, loss in enumerate(losses, start=1):
        improved.append(best.update(step, {"eval_loss": loss}, threshold=0.1))
        counters.append(best.patience_counter)
    assert improved == [True, True, True, False, True]
    assert counters == [0, 0, 1, 2, 0]  # 3.95 beats 4.0 but by less than the threshold
    assert best.best_metric == 3.5 and best.best_step == 5
    assert not best.should_stop(3) and not best.should_stop(None)
    best.update(6, {"eval_loss": 3.6})
    best.update(7, {"eval_loss": 3.6})
    assert best.should_stop(2)
    bleu = BestModel("eval_bleu", greater_is_better=True)
    assert bleu.update(1, {"eval_bleu": 1.0}) and not bleu.update(2, {"eval_bleu": 0.5})
    with pytest.raises(ConfigError, match=r"metric_for_best_model='eval_bleu' is not an evaluation metric"):
        BestModel("eval_bleu", True).update(1, {"eval_loss": 1.0})


def test_best_checkpoint_recorded_and_restored() -> None:
    best = BestModel("eval_loss", False)
    best.update(4, {"eval_loss": 2.0})
    best.saved(4, "out/checkpoint-4")
    best.update(8, {"eval_loss": 3.0})
    best.saved(8, "out/checkpoint-8")
    assert best.best_model_checkpoint == "out/checkpoint-4" and best.patience_counter == 1
    again = BestModel("eval_loss", False)
    again.load_state_dict({"best_model": best.state_dict()})
    assert again == best
    other = BestModel("eval_bleu", True)  # a changed metric restarts the record
    other.load_state_dict({"best_model": best.state_dict()})
    assert other.best_metric is None


def test_rotation_keeps_the_best_checkpoint() -> None:
    ckpts = [Path(f"o/checkpoint-{s}") for s in (2, 4, 6, 8)]
    assert rotation_victims(ckpts, 2) == ckpts[:2]
    assert rotation_victims(ckpts, 2, keep=ckpts[0]) == ckpts[1:3]  # best + newest
    assert rotation_victims(ckpts, 1, keep=ckpts[1]) == [ckpts[0], ckpts[2]]  # limit 1: best and last
    assert rotation_victims(ckpts, 3, keep=ckpts[3]) == ckpts[:1]


@pytest.mark.parametrize(
    "key,hint",
    [
        ("evaluation_strategy", r"use eval_strategy"),
        ("per_gpu_train_batch_size", r"use per_device_train_batch_size"),
        ("gradient_checkpointing", r"use activation_checkpointing"),
        ("deepspeed", r"use the parallel fields"),
        ("lr_scheduler_kwargs", r"use lr_scheduler_type"),
        ("fp16_opt_level", r"use fp16 \(fp16 working weights over fp32 masters: no apex opt levels\)"),
    ],
)
def test_known_hf_name_fails_with_a_hint(tmp_path: Path, key: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown flag\(s\) \['--{key}'\] \({key}: {hint}"):
        parse_config(["--config", TINY, f"--{key}", "1"])
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: 1\nmax_steps: 2\n")
    with pytest.raises(ConfigError, match=rf"unknown config key\(s\) \['{key}'\] \({key}: {hint}"):
        parse_config(["--config", str(path)])
    with pytest.raises(ConfigError, match=hint):
        load_config_dict({key: 1})


def test_refused_hf_values_say_what_to_use() -> None:
    assert TrainingArguments(fp16=True).fp16  # fp16 with dynamic loss scaling (tests/dist/test_fp16.py)
    with pytest.raises(ConfigError, match=r"^fp16=True and bf16=True together: choose one precision"):
        TrainingArguments(fp16=True, bf16=True)
    assert TrainingArguments(bf16=True, bf16_full_eval=True).bf16_full_eval  # the HF names, taken
    with pytest.raises(ConfigError, match=r"^fp16_full_eval=True and bf16_full_eval=True together"):
        TrainingArguments(fp16_full_eval=True, bf16_full_eval=True)
    with pytest.raises(ConfigError, match=r"predict_with_generate=False is not supported"):
        TrainingArguments(predict_with_generate=False)
    with pytest.raises(ConfigError, match=r"source_prefix='translate English to German: ': a T5 task prefix"):
        DataArguments(source_prefix="translate English to German: ")
    assert DataArguments(source_prefix="").source_prefix == ""
    with pytest.raises(ConfigError, match=r"preprocessing_num_workers=0 must be >= 1 or null"):
        DataArguments(preprocessing_num_workers=0)


def test_forced_bos_token_must_be_the_target() -> None:
    assert DataArguments(source_lang="en", target_lang="de", forced_bos_token="__de__").forced_bos_token
    assert DataArguments(language_pairs=["en-de", "fr-de"], forced_bos_token="de").forced_bos_token
    with pytest.raises(
        ConfigError, match=r"forced_bos_token='fr' conflicts with the run's target language\(s\) \['de'\]"
    ):
        DataArguments(source_lang="en", target_lang="de", forced_bos_token="fr")
    with pytest.raises(ConfigError, match=r"target language\(s\) \['de', 'en'\]"):
        DataArguments(language_pairs=["en-de", "de-en"], forced_bos_token="de")


def test_do_predict_needs_an_existing_test_file() -> None:
    from trainer.run.preflight import check_predict_args

    with pytest.raises(ConfigError, match=r"do_predict=True needs test_file .* or a dataset_name"):
        check_predict_args(parse_config(["--config", TINY, "--dataset_name", "null", "--train_file",
                                         "x.jsonl", "--do_predict", "true"]))  # fmt: skip
    check_predict_args(parse_config(["--config", TINY, "--do_predict", "true"]))  # builtin: its test split
    cfg = parse_config(["--config", TINY, "--dataset_name", "null", "--train_file", "x.jsonl",
                        "--do_predict", "true", "--test_file", "/nonexistent/test.jsonl"])  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"test_file='/nonexistent/test\.jsonl': '/nonexistent/test\.jsonl' does not"
    ):
        check_predict_args(cfg)


def test_metric_for_best_model_is_checked_against_the_run() -> None:
    check_metric_name("eval_bleu_en-de", ["en-de", "de-en"])
    check_metric_name(None, ["en-de"])
    with pytest.raises(
        ConfigError, match=r"metric_for_best_model='eval_bleu_en-fr' is not an evaluation metric"
    ):
        check_metric_name("eval_bleu_en-fr", ["en-de"])
    with pytest.raises(
        ConfigError, match=r"'eval_accuracy' is not an evaluation metric of this run; choose from"
    ):
        check_metric_name(
            TrainingArguments(metric_for_best_model="accuracy").metric_for_best_model, ["en-de"]
        )


def test_predictions_are_written_per_direction(tmp_path: Path) -> None:
    from trainer.eval.predict import write_predictions

    write_predictions(tmp_path, {"en-de": ["a", "b\nc"], "de-en": ["x"]}, {"predict_bleu": 1.0})
    assert (tmp_path / "predictions_en-de.txt").read_text() == "a\nb c\n"  # one line per hypothesis
    assert (tmp_path / "predictions_de-en.txt").read_text() == "x\n"
    assert not (tmp_path / "generated_predictions.txt").exists()  # HF's name only for one direction
    assert (tmp_path / "predict_results.json").read_text().startswith("{")


# --- issue 30: the flags' spellings and values (trainer/config/flags.py) ----------------------------


def _texts(value: object) -> list[str]:
    """A parsed value as the command line writes it."""
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, list) and value:
        return [str(x) for x in value]
    return ["null" if value in (None, []) else str(value)]


def test_every_field_takes_both_spellings_and_the_equals_form() -> None:
    """Regression: `--max-steps 5`, the form `--help` prints beside `--max_steps`, was refused as
    "unknown flag(s) ['--max-steps']", and `--no-do-eval` / `--no_do_eval` (also printed) too."""
    from dataclasses import fields

    from trainer.config.flags import build_parser, options
    from trainer.config.parse import DESCRIPTION, USAGE
    from trainer.config.schema import SECTIONS

    spelled = options(build_parser(SECTIONS, USAGE, DESCRIPTION))
    base = parse_config(["--config", TINY]).to_dict()
    names = [f.name for cls in SECTIONS for f in fields(cls)]
    for name in names:
        assert spelled[f"--{name}"] == spelled[f"--{name.replace('_', '-')}"] == name
    for dashes in (False, True):
        for equals in (False, True):  # every field in one command line, each as the file has it
            argv = ["--config", TINY]
            for name in names:
                flag, words = "--" + (name.replace("_", "-") if dashes else name), _texts(base[name])
                argv += [f"{flag}={words[0]}"] if equals and len(words) == 1 else [flag, *words]
            got = parse_config(argv).to_dict()
            assert got == base, (dashes, equals, {k: v for k, v in got.items() if v != base[k]})


@pytest.mark.parametrize(
    "args,field,value",
    [
        (["--max-steps", "5"], "max_steps", 5),
        (["--max-steps=5"], "max_steps", 5),
        (["--learning-rate", "2e-4"], "learning_rate", 2e-4),
        (["--no-do-eval"], "do_eval", False),
        (["--no_do_eval"], "do_eval", False),
        (["--do-eval", "false"], "do_eval", False),
        (["--bf16"], "bf16", True),
        (["--batch-prioritized-routing"], "batch_prioritized_routing", True),  # bool | None: bare = true
        (["--greater-is-better"], "greater_is_better", True),
        (["--language-pairs", "en-de", "de-en"], "language_pairs", ["en-de", "de-en"]),
        (["--dataset-name", "null", "--train-file", "x.jsonl"], "dataset_name", None),
        (["--max-eval-samples=null"], "max_eval_samples", None),
        # null on a field that cannot be None unsets the file's value: the default (was: a TypeError traceback)
        (["--max_steps", "null"], "max_steps", -1),
        (["--max-steps=null"], "max_steps", -1),
    ],
)
def test_dashed_and_equals_flags_override_the_file(args: list[str], field: str, value: object) -> None:
    assert parse_config(["--config", TINY, *args]).to_dict()[field] == value


def test_config_takes_the_equals_form() -> None:
    """Regression: `--config=configs/tiny.yaml` was refused as "unknown flag(s) ['--config']"."""
    assert parse_config([f"--config={TINY}"]).to_dict() == parse_config(["--config", TINY]).to_dict()
    assert parse_config([f"--config={TINY}", "--max-steps", "3"]).training.max_steps == 3
    with pytest.raises(ConfigError, match=r"^--config given 2 times"):
        parse_config([f"--config={TINY}", "--config", TINY])
    with pytest.raises(ConfigError, match=r"^--config needs a file path"):
        parse_config(["--config="])


@pytest.mark.parametrize(
    "args,message",
    [
        # was: argparse's usage block and "train.py: error: argument --max_steps/--max-steps: invalid int value"
        (["--max_steps", "1e3"], r"^max_steps='1e3' is not an integer; write 1000$"),
        (["--max-steps=2.5"], r"^max_steps='2\.5' is not an integer$"),
        (["--learning_rate", "fast"], r"^learning_rate='fast' is not a number$"),
        (["--bf16", "maybe"], r"^bf16='maybe' is not a boolean \(true/false, yes/no, 1/0\)$"),
        (["--save_total_limit", "all"], r"^save_total_limit='all' is not an integer$"),
        (["--max_steps"], r"^--max_steps: expected one argument$"),
        (
            ["--per-gpu-train-batch-size", "4"],
            r"\(per-gpu-train-batch-size: use per_device_train_batch_size\)",
        ),
    ],
)
def test_a_bad_flag_value_is_one_config_error_naming_it(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(["--config", TINY, *args])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "line,message",
    [
        ("max_steps: 2.5", r"max_steps=2\.5 is not an integer$"),  # was: accepted, trained 3 steps
        ("max_steps: 1e3", r"^max_steps='1e3' is not an integer; write 1000$"),  # YAML 1.1: a string
        ("bf16: 1", r"bf16=1 is not a boolean"),
        ("source_lang: no", r"source_lang=False is not a string \(YAML reads yes/no/on/off as booleans"),
        ("max-steps: 5", r"unknown config key\(s\) \['max-steps'\] \(max-steps: write max_steps\)"),
    ],
)
def test_a_bad_file_value_is_one_config_error_naming_it(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(Path(TINY).read_text() + line + "\n")
    with pytest.raises(ConfigError, match=message):
        parse_config(["--config", str(path)])


def test_file_values_of_a_compatible_type_are_taken(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(Path(TINY).read_text() + "learning_rate: 1\ndataset_config_name: 2014\nmax_steps: null\n")
    cfg = parse_config(["--config", str(path)])
    assert (cfg.training.learning_rate, cfg.data.dataset_config_name, cfg.training.max_steps) == (
        1.0,
        "2014",
        -1,
    )


@pytest.mark.parametrize(
    "given,resolved",
    [("True", "true"), ("true", "true"), ("yes", "true"), ("latest", "latest"),
     ("False", None), ("false", None), ("runs/x/checkpoint-4", "runs/x/checkpoint-4")],
)  # fmt: skip
def test_resume_from_checkpoint_takes_the_hf_bool(tmp_path: Path, given: str, resolved: str | None) -> None:
    """Regression: `--resume_from_checkpoint True` (the HF Trainer's bool: the last checkpoint in
    output_dir) failed "resume_from_checkpoint='True' is not a directory"; in YAML (`true`) a TypeError
    traceback. True means the newest checkpoint (kept apart from 'latest': it must exist), False no resume."""
    cfg = parse_config(["--config", TINY, "--resume_from_checkpoint", given])
    assert cfg.training.resume_from_checkpoint == resolved
    word = given.lower() if given.lower() in ("true", "false", "yes") else repr(given)
    path = tmp_path / "c.yaml"
    path.write_text(Path(TINY).read_text() + f"resume_from_checkpoint: {word}\n")
    assert parse_config(["--config", str(path)]).training.resume_from_checkpoint == resolved
    assert load_config_dict({"resume_from_checkpoint": given}).training.resume_from_checkpoint == resolved


def test_resume_true_resumes_from_the_newest_checkpoint(tmp_path: Path) -> None:
    from trainer.checkpoint.commit import COMMIT_MARKER
    from trainer.checkpoint.dcp import resolve_resume

    for step in (2, 4):
        ckpt = tmp_path / f"checkpoint-{step}"
        ckpt.mkdir()
        (ckpt / COMMIT_MARKER).write_text("ok")  # a marker from before checksums: nothing to verify
    for value in (True, "True"):
        spec = TrainingArguments(
            resume_from_checkpoint=value, output_dir=str(tmp_path)
        ).resume_from_checkpoint  # type: ignore[arg-type]
        assert resolve_resume(spec, tmp_path) == tmp_path / "checkpoint-4"
    assert TrainingArguments(resume_from_checkpoint=False).resume_from_checkpoint is None  # type: ignore[arg-type]
    assert load_config_dict({"resume_from_checkpoint": True}).training.resume_from_checkpoint == "true"


def test_resume_true_without_a_checkpoint_is_refused_latest_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36: `--resume_from_checkpoint latest` (or true) into an output_dir with no checkpoint (a
    mistyped one) trained from step 0 in silence. true, the HF Trainer's bool, is refused as HF refuses
    it ("No valid checkpoint found in output directory"); latest, which restarts under torchrun
    --max-restarts and SLURM requeues use (their first attempt has no checkpoint yet), warns in one line."""
    import logging

    from trainer.checkpoint.dcp import resolve_resume
    from trainer.run.state import log_start

    empty = tmp_path / "outputs" / "demo"
    with pytest.raises(ConfigError, match=rf"^resume_from_checkpoint=true: no valid checkpoint found in output_dir "
                                          rf"'{empty}' \(true, as in the HF Trainer, needs one\)"):  # fmt: skip
        resolve_resume("true", empty)
    assert resolve_resume("latest", empty) is None
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with caplog.at_level(logging.WARNING, logger="trainer"):
        log_start("latest", None, str(empty))
        log_start(None, None, str(empty))  # no resume asked: nothing to say
        log_start("latest", empty / "checkpoint-4", str(empty))  # resumed as asked: set-up logs it
    assert [r.getMessage() for r in caplog.records] == [
        f"resume_from_checkpoint=latest: no committed checkpoint in output_dir '{empty}': training starts from step 0"
    ]
    caplog.clear()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with caplog.at_level(logging.WARNING, logger="trainer"):
        log_start("latest", None, str(empty))
    assert (
        caplog.records[0]
        .getMessage()
        .startswith("restart 1 of 3: resume_from_checkpoint=latest: no committed")
    )


@pytest.mark.parametrize(
    "flag,hint",
    [
        # issue 36: fairseq's names and typos got no hint, where HF names did
        ("--max-update", r"max-update: use max_steps \(fairseq's --max-update\)"),
        ("--max-tokens", r"max-tokens: use max_tokens_per_microbatch"),
        ("--update-freq", r"update-freq: use gradient_accumulation_steps"),
        ("--save-dir", r"save-dir: use output_dir"),
        ("--lr", r"lr: use learning_rate"),
        ("--max_stpes", r"max_stpes: did you mean max_steps\?"),
        ("--learnign-rate", r"learnign-rate: did you mean learning_rate\?"),
    ],
)
def test_fairseq_names_and_near_misses_get_a_hint(tmp_path: Path, flag: str, hint: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"^unknown flag\(s\) \['{flag}'\] \({hint}.*\); see --help"
    ) as err:
        parse_config(["--config", TINY, flag, "3"])
    assert "\n" not in str(err.value)
    key = flag[2:]
    path = tmp_path / "c.yaml"
    path.write_text(f"{key}: 3\n")
    with pytest.raises(ConfigError, match=rf"^unknown config key\(s\) \['{key}'\] \({hint}"):
        parse_config(["--config", str(path)])


def test_no_hint_for_a_name_near_nothing() -> None:
    with pytest.raises(ConfigError, match=r"^unknown flag\(s\) \['--frobnicate'\]; see --help"):
        parse_config(["--config", TINY, "--frobnicate", "1"])


def test_null_unsets_an_earlier_flag_too(tmp_path: Path) -> None:
    """The last flag of a field wins, as argparse takes repeated flags: `--field null` after the user's
    `--field 4` (the planner appends its layout's flags after them) unset only the file's value."""
    args = ["--config", TINY, "--pipeline_schedule", "interleaved_1f1b", "--virtual_pipeline_stages", "4"]
    assert parse_config(args).parallel.virtual_pipeline_stages == 4
    assert parse_config([*args, "--virtual_pipeline_stages", "null"]).parallel.virtual_pipeline_stages is None
    assert (
        parse_config(
            [*args, "--virtual-pipeline-stages=null", "--virtual_pipeline_stages", "8"]
        ).parallel.virtual_pipeline_stages
        == 8
    )
    pairs = [
        "--language_pairs",
        "en-fr",
        "fr-en",
        "--language_pairs",
        "null",
        "--source_lang",
        "en",
        "--target_lang",
        "de",
    ]
    cfg = parse_config(["--config", TINY, *pairs])
    assert cfg.data.directions() == [("en", "de")]
