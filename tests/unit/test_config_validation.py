"""Every config value is checked when the dataclasses are built, before anything is written.

Regression: a negative learning_rate failed late inside AdamW (after the tokenizer was
written); negative warmup_steps, max_grad_norm and save_steps were accepted.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from trainer.config.data_args import DataArguments
from trainer.config.schema import SECTIONS, ModelArguments, ParallelArguments
from trainer.config.training_args import TrainingArguments
from trainer.errors import ConfigError

BAD = [
    (TrainingArguments, "learning_rate", -1.0, r"learning_rate=-1\.0 must be >= 0"),
    (TrainingArguments, "learning_rate", float("inf"), r"learning_rate=inf must be >= 0"),
    (TrainingArguments, "warmup_steps", -5, r"warmup_steps=-5 must be >= 0"),
    (TrainingArguments, "max_grad_norm", -1.0, r"max_grad_norm=-1\.0 must be >= 0"),
    (TrainingArguments, "save_steps", -3, r"save_steps=-3 must be >= 0"),
    (TrainingArguments, "eval_steps", -1, r"eval_steps=-1 must be >= 0"),
    (TrainingArguments, "save_total_limit", 0, r"save_total_limit=0 must be >= 1 or null"),
    (TrainingArguments, "weight_decay", -0.1, r"weight_decay=-0\.1 must be >= 0"),
    (TrainingArguments, "adam_beta1", 1.0, r"adam_beta1=1\.0 must be in \[0, 1\)"),
    (TrainingArguments, "adam_beta2", -0.5, r"adam_beta2=-0\.5 must be in \[0, 1\)"),
    (TrainingArguments, "adam_epsilon", 0.0, r"adam_epsilon=0\.0 must be > 0"),
    (TrainingArguments, "generation_max_length", 0, r"generation_max_length=0 must be >= 1"),
    (TrainingArguments, "seed", -1, r"seed=-1 must be in \[0, 4\.29497e\+09\]"),
    (ModelArguments, "dropout", 1.0, r"dropout=1\.0 must be in \[0, 1\)"),
    (ModelArguments, "attention_dropout", -0.1, r"attention_dropout=-0\.1 must be in \[0, 1\)"),
    (ModelArguments, "activation_dropout", 2.0, r"activation_dropout=2\.0 must be in \[0, 1\)"),
    (ModelArguments, "encoder_layerdrop", 1.0, r"encoder_layerdrop=1\.0 must be in \[0, 1\)"),
    (ModelArguments, "decoder_layerdrop", -0.5, r"decoder_layerdrop=-0\.5 must be in \[0, 1\)"),
    (ModelArguments, "vocab_size", 3, r"vocab_size=3 must be >= 8"),
    (ModelArguments, "init_std", 0.0, r"init_std=0\.0 must be > 0"),
    (ModelArguments, "encoder_layers", 0, r"encoder_layers=0 must be a positive integer"),
    (DataArguments, "max_source_length", 0, r"max_source_length=0 must be >= 1"),
    (DataArguments, "max_target_length", -4, r"max_target_length=-4 must be >= 1"),
    (DataArguments, "max_tokens_per_microbatch", 0, r"max_tokens_per_microbatch=0 must be >= 1 or null"),
    (DataArguments, "spm_character_coverage", 0.0, r"spm_character_coverage=0\.0 must be in \(0, 1\]"),
    (DataArguments, "max_bad_record_fraction", 1.5, r"max_bad_record_fraction=1\.5 must be in \[0, 1\]"),
    (ParallelArguments, "dist_timeout_s", 0, r"dist_timeout_s=0 must be >= 1"),
    (ParallelArguments, "num_microbatches", 0, r"num_microbatches=0 must be >= 1"),
    (ParallelArguments, "hang_warning_s", float("nan"), r"hang_warning_s=nan must be a finite number"),
    (TrainingArguments, "nan_max_consecutive_skips", 0, r"nan_max_consecutive_skips=0 must be >= 1"),
    (TrainingArguments, "fp16_initial_scale", 0.0, r"fp16_initial_scale=0\.0 must be in \(0, 3\.40282e\+38"),
    (TrainingArguments, "fp16_initial_scale", 1e39, r"fp16_initial_scale=1e\+39 must be in \(0, 3\.4028"),
    (TrainingArguments, "fp16_scale_growth_interval", 0, r"fp16_scale_growth_interval=0 must be >= 1"),
    (ModelArguments, "moe_capacity_factor", 0.0, r"moe_capacity_factor=0.0 must be > 0"),
    (ModelArguments, "num_experts", 1, r"num_experts=1 must be 0 \(dense\) or >= 2"),
    (ModelArguments, "moe_token_dropout", 1.0, r"moe_token_dropout=1.0 must be in \[0, 1\)"),
]


@pytest.mark.parametrize("cls,name,value,message", BAD, ids=[f"{b[1]}={b[2]}" for b in BAD])
def test_out_of_range_value_is_one_line_naming_field_value_and_range(
    cls: type, name: str, value: object, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        cls(**{name: value})


def test_defaults_and_boundaries_are_valid() -> None:
    for cls in SECTIONS:
        cls()
    TrainingArguments(learning_rate=0.0, warmup_steps=0, max_grad_norm=0.0, save_total_limit=None)
    DataArguments(max_bad_record_fraction=0.0, spm_character_coverage=1.0)
    DataArguments(max_bad_record_fraction=1.0)
    ModelArguments(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)


def test_every_numeric_field_is_checked() -> None:
    """A numeric field added later without a range check fails here: set each to -1 (or NaN)."""
    unchecked = []
    for cls in SECTIONS:
        for f in fields(cls):
            if f.type not in ("int", "float", "int | None", "float | None"):
                continue
            # data_parallel_size: -1 is inferred (its range is tested in test_mesh); hang_warning_s: < 0 is off;
            # moe_eval_capacity_token_fraction: <= 0 is the training capacity (NllbMoeConfig's meaning)
            negative_ok = f.name in (
                "data_parallel_size",
                "hang_warning_s",
                "moe_eval_capacity_token_fraction",
            )
            below = -2 if f.name == "max_steps" else -1  # max_steps: -1 trains num_train_epochs
            values = ([] if negative_ok else [below]) + ([float("nan")] if "float" in str(f.type) else [])
            for value in values:
                try:
                    cls(**{f.name: value})
                except ConfigError:
                    continue
                unchecked.append((cls.__name__, f.name, value))
    assert not unchecked


def test_fsdp_with_layerdrop_is_refused_before_anything_runs() -> None:
    from trainer.config.parse import load_config_dict
    from trainer.run.preflight import validate_early

    base = {"dataset_name": "builtin", "language_pairs": ["en-de"], "data_parallel_sharding": "fsdp"}
    cfg = load_config_dict({**base, "decoder_layerdrop": 0.1})
    with pytest.raises(ConfigError, match=r"fsdp does not support LayerDrop yet .*decoder_layerdrop=0\.1"):
        validate_early(cfg, world=2)
    ok = load_config_dict(base)
    assert validate_early(ok, world=2).dp == 2


@pytest.mark.parametrize(
    ("world", "values", "message"),
    [
        # the 12B config shipped sequence_parallel: true on its tp = 1 mesh (issue 23)
        (2, {"sequence_parallel": True}, r"^sequence_parallel=True does nothing with tensor_parallel_size=1"),
        (1, {"data_parallel_sharding": "fsdp"}, r"^data_parallel_sharding='fsdp' does nothing with data_parallel_size=1 \(data_parallel_size=-1 inferred"),
        (2, {"data_parallel_sharding": "zero1", "pipeline_parallel_size": 2}, r"^data_parallel_sharding='zero1' does nothing with data_parallel_size=1"),
        (2, {"virtual_pipeline_stages": 3}, r"^virtual_pipeline_stages=3 does nothing with pipeline_schedule='1f1b'"),
        # issue 36: 2 was the default, so the planner's `--pipeline_schedule zero_bubble --virtual_pipeline_stages 2`
        # passed, though docs/training.md says it is refused
        (2, {"virtual_pipeline_stages": 2, "pipeline_parallel_size": 2, "pipeline_schedule": "zero_bubble"},
         r"^virtual_pipeline_stages=2 does nothing with pipeline_schedule='zero_bubble'"),
        (2, {"partition_method": "time"}, r"^partition_method='time' does nothing with one pipeline stage"),
        (2, {"fp16_initial_scale": 1024.0}, r"^fp16_initial_scale=1024\.0 does nothing without fp16=True"),
        (2, {"early_stopping_threshold": 0.1}, r"^early_stopping_threshold=0\.1 does nothing without early_stopping_patience"),
        (2, {"hang_warning_s": 900.0}, r"^hang_warning_s=900 does nothing with dist_timeout_s=600"),
        (2, {"language_pairs": [], "source_lang": "en", "target_lang": "de", "sampling_temperature": 5.0},
         r"^sampling_temperature=5\.0 does nothing with one direction \(en-de\)"),
    ],
)  # fmt: skip
def test_options_that_would_do_nothing_are_refused_in_one_line(
    world: int, values: dict[str, object], message: str
) -> None:
    from trainer.config.parse import load_config_dict
    from trainer.run.preflight import validate_early

    base = {"dataset_name": "builtin", "language_pairs": ["en-de", "de-en"]}
    with pytest.raises(ConfigError, match=message) as err:
        validate_early(load_config_dict({**base, **values}), world=world)
    assert "\n" not in str(err.value)
    # the same options where they act are accepted
    acting = {
        "sequence_parallel": {"tensor_parallel_size": 2},
        "data_parallel_sharding": {"data_parallel_size": 2},
    }
    for key, fix in acting.items():
        if key in values and "pipeline_parallel_size" not in values:
            assert validate_early(load_config_dict({**base, **values, **fix}), world=2)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"moe_dropless": True}, r"^moe_dropless=True applies to NLLB-MoE models only, but this model is dense"),
        ({"encoder_sparse_step": 2}, r"^encoder_sparse_step=2 applies to NLLB-MoE models only"),
        ({"router_aux_loss_coef": 0.0}, r"^router_aux_loss_coef=0\.0 applies to NLLB-MoE models only"),
        # experts in no layer: 3 + 3 layers, every 4th sparse would be layer 4 (review of issue 24)
        ({"num_experts": 4, "encoder_sparse_step": 0, "decoder_sparse_step": 4},
         r"^num_experts=4 does nothing: encoder_sparse_step=0 and decoder_sparse_step=4 make none of the 3"),
        ({"num_experts": 4, "encoder_sparse_step": 2, "moe_dropless": True, "moe_capacity_factor": 2.0},
         r"^moe_capacity_factor=2\.0 does nothing with moe_dropless=True"),
    ],
)  # fmt: skip
def test_moe_fields_that_would_do_nothing_are_refused_in_one_line(
    values: dict[str, object], message: str
) -> None:
    from trainer.config.parse import load_config_dict
    from trainer.run.preflight import validate_early

    base = {"dataset_name": "builtin", "language_pairs": ["en-de", "de-en"]}
    with pytest.raises(ConfigError, match=message) as err:
        validate_early(load_config_dict({**base, **values}), world=1)
    assert "\n" not in str(err.value)
    acting = {"num_experts": 4, "encoder_sparse_step": 2, "decoder_sparse_step": 2, "moe_dropless": True}
    assert validate_early(load_config_dict({**base, **acting}), world=1).dp == 1


def test_torch_compile_with_experts_over_ranks_is_refused_in_one_line() -> None:
    """Compiled NLLB-MoE layers equal eager on one rank's experts; spread over ep (gradients off by
    ~1e-4) or tp (dynamo fails on the capacity) they do not yet: refused before anything runs."""
    from trainer.config.parse import load_config_dict
    from trainer.run.preflight import validate_early

    base = {"dataset_name": "builtin", "language_pairs": ["en-de", "de-en"], "torch_compile": True,
            "num_experts": 4, "encoder_sparse_step": 2, "decoder_sparse_step": 2}  # fmt: skip
    for mesh, got in (
        ({"expert_parallel_size": 2}, r"\(got 2 and 1\)"),
        ({"tensor_parallel_size": 2}, r"\(got 1 and 2\)"),
    ):
        with pytest.raises(
            ConfigError, match=r"^torch_compile with an NLLB-MoE model \(num_experts=4\) needs " + ".*" + got
        ):
            validate_early(load_config_dict({**base, **mesh}), world=2)
    assert validate_early(load_config_dict({**base, "data_parallel_size": 2}), world=2).dp == 2
    assert validate_early(
        load_config_dict({**base, "expert_parallel_size": 2, "torch_compile": False}), world=2
    )


def test_options_transformers_accepts_are_warned_about_naming_the_field() -> None:
    from trainer.config.parse import load_config_dict
    from trainer.run.preflight import idle_option_warnings

    base = {"dataset_name": "builtin", "language_pairs": ["en-de"]}
    cfg = load_config_dict(
        {**base, "eval_strategy": "epoch", "eval_steps": 50, "greater_is_better": True,
         "do_eval": False, "save_strategy": "no", "save_steps": 10}
    )  # fmt: skip
    assert idle_option_warnings(cfg) == [
        "eval_steps=50 does nothing with eval_strategy='epoch' (only 'steps' reads it)",
        "save_steps=10 does nothing with save_strategy='no' (only 'steps' reads it)",
        "greater_is_better=True does nothing without metric_for_best_model, load_best_model_at_end or "
        "early_stopping_patience",
    ]
    quiet = {
        **base,
        "eval_strategy": "no",
        "do_eval": False,
        "bf16_full_eval": True,
        "generation_num_beams": 4,
    }
    assert idle_option_warnings(load_config_dict(quiet)) == [
        f"{name} does nothing: no evaluation runs (do_eval, do_predict false, eval_strategy 'no')"
        for name in ("bf16_full_eval=True", "generation_num_beams=4")
    ]
    assert idle_option_warnings(load_config_dict(base)) == []


def test_shipped_configs_pass_their_own_checks_on_the_meshes_they_name() -> None:
    """... and none sets overwrite_output_dir (issue 36: five did, so rerunning a shipped config
    deleted the earlier run; DESIGN: nothing the user made is deleted unless asked for)."""
    from pathlib import Path

    from trainer.config.parse import parse_config
    from trainer.run.preflight import idle_option_warnings, validate_early

    root = Path(__file__).resolve().parents[2]
    worlds = {
        "demo": 8,
        "m2m100_12b": 16,
        "m2m100_1b_4x8": 32,
        "nllb200_distilled_600m": 8,
        "nllb200_1.3b": 8,
    }
    worlds["nllb200_3.3b"] = 16
    worlds["nllb_moe_54b"] = 32
    for path in sorted((root / "configs").glob("*.yaml")):
        cfg = parse_config(["--config", str(path)])
        validate_early(cfg, worlds.get(path.stem, 1))
        assert idle_option_warnings(cfg) == [], path.name
        assert cfg.training.overwrite_output_dir is False, f"{path.name} sets overwrite_output_dir"


def test_validation_raises_bad_input_types_internal_checks_do_not() -> None:
    """The checks of user input in models/ and parallel/ raise their bad-input types (one line,
    exit 2); internal consistency checks stay plain ValueErrors (a traceback, exit 1)."""
    from models.config import ModelConfig
    from parallel.mesh import ParallelDims, rank_to_coords
    from parallel.pipeline.partition import validate_balance
    from parallel.pipeline.schedule import build_schedule
    from trainer.errors import BAD_INPUT

    bad_input = [
        lambda: ParallelDims(1, 2, 1, 1).validate(),  # dp x tp x pp != world
        lambda: build_schedule("interleaved_1f1b", 2, 3, 2),  # m not a multiple of p
        lambda: validate_balance([3, 3], 8, 2),
        lambda: ModelConfig(d_model=10, encoder_attention_heads=3),
    ]
    for check in bad_input:
        with pytest.raises(BAD_INPUT):
            check()
    with pytest.raises(ValueError) as internal:
        rank_to_coords(9, (1, 2, 2))
    assert not isinstance(internal.value, BAD_INPUT)


@pytest.mark.parametrize("internal", [False, True])
def test_entry_point_keeps_internal_tracebacks(internal: bool, monkeypatch, capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Regression (issue 23): `trainer.train` turned every ValueError into "bad input", exit 2,
    without a traceback, internal ones too. Bad input keeps its one line; an internal error
    propagates (Python prints its traceback, exit status 1)."""
    from parallel.errors import ParallelConfigError
    from trainer import train

    def fail(cfg, launcher=None):  # type: ignore[no-untyped-def]
        if internal:
            raise ValueError("an internal check failed")
        raise ParallelConfigError("tensor_parallel_size=3 does not divide 4 ranks; valid: 1, 2, 4")

    monkeypatch.setattr(train, "run", fail)
    monkeypatch.delenv("TRAINER_TRACEBACK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    argv = ["--config", str(tiny), "--output_dir", str(tmp_path / "out")]
    if internal:
        with pytest.raises(ValueError, match="an internal check failed"):
            train.cli(argv)
        return
    assert train.cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ParallelConfigError: tensor_parallel_size=3 does not divide 4 ranks")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_rehearsal_table_names_every_shipped_config() -> None:
    """The rehearsal table of docs/development.md (the list of combinations tests/dist/test_rehearsal.py
    covers) has a row per configs/*.yaml: a config added without its row fails here."""
    root = Path(__file__).resolve().parents[2]
    page = (root / "docs" / "development.md").read_text()
    section = page.split("## Every shipped config, rehearsed", 1)[1].split("\n## ", 1)[0]
    missing = [p.stem for p in sorted((root / "configs").glob("*.yaml")) if f"\n| {p.stem} |" not in section]
    assert not missing, f"docs/development.md rehearsal table lacks {missing}"


SAMPLE = "configs/data/en-de_sample"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], r"^do_eval=True needs validation data, but train_file='configs/data/en-de_sample/train\.jsonl' comes "
             r"with none: set validation_file .*; or train without evaluating: --do_eval false$"),
        (["--do_eval", "false", "--eval_steps", "2"], r"^eval_strategy='steps' with eval_steps=2 needs validation "
             r"data.*: --eval_strategy no$"),
        (["--do_eval", "false", "--eval_strategy", "epoch", "--save_strategy", "epoch", "--load_best_model_at_end", "true"],
         r"^eval_strategy='epoch' and load_best_model_at_end=True need validation data.*: --eval_strategy no, "
         r"no load_best_model_at_end$"),
    ],
)  # fmt: skip
def test_evaluations_without_validation_data_are_refused_naming_the_way_out(
    flags: list[str], message: str
) -> None:
    """Issue 36: `--train_file` with no validation data and `--do_eval true --eval_steps 2` exited 0 with
    no eval row (the only trace: `validation {}` in the log); with load_best_model_at_end the error
    did not name the cause. run_translation.py refuses it: "--do_eval requires a validation dataset"."""
    from trainer.config.parse import parse_config
    from trainer.run.preflight import validate_early

    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml")
    data = ["--config", tiny, "--dataset_name", "null", "--train_file", f"{SAMPLE}/train.jsonl",
            "--language_pairs", "en-de", "de-en"]  # fmt: skip
    with pytest.raises(ConfigError, match=message):
        validate_early(parse_config([*data, *flags]), world=1)
    validate_early(parse_config([*data, *flags, "--validation_file", f"{SAMPLE}/validation.jsonl"]), world=1)
    validate_early(
        parse_config([*data, "--do_eval", "false", "--streaming", "true", "--max_steps", "2"]), world=1
    )
    validate_early(
        parse_config(["--config", tiny, *flags]), world=1
    )  # the builtin corpus has a validation split


def test_a_dataset_without_a_validation_split_is_refused_once_read() -> None:
    """A dataset_name's splits are known once it is read: `setup_data` refuses there, before the
    tokenizer is written (tests/dist/test_predict_dataset.py reads such a dataset for do_predict)."""
    from trainer.config.parse import load_config_dict
    from trainer.data.sources import RawDatasets
    from trainer.errors import DataError
    from trainer.run.data import require_eval_data

    cfg = load_config_dict({"dataset_name": "data/saved", "language_pairs": ["en-de"]})
    with pytest.raises(DataError, match=r"^do_eval=True needs validation data, but dataset_name='data/saved' "
                                        r"has no validation, dev or test split: set validation_file"):  # fmt: skip
        require_eval_data(cfg, RawDatasets([], {}, {}))
    require_eval_data(cfg, RawDatasets([], {"en-de": []}, {}))
    require_eval_data(
        load_config_dict({"dataset_name": "data/saved", "do_eval": False}), RawDatasets([], {}, {})
    )
