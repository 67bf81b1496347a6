"""Parsing the job config: `--config FILE` (YAML or JSON) plus flag overrides, by `HfArgumentParser`.

Unknown keys (file or flag) are an error naming the key, with a hint where it is an HF Trainer or
fairseq name we spell differently (`HF_NAME_HINTS`, `FAIRSEQ_NAME_HINTS`) or a near miss of one of
ours (`--max_stpes`: did you mean max_steps?); `--field null` unsets a value the file set.
The flags' spellings and value types: `trainer.config.flags`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from trainer.config.flags import (
    build_parser,
    check_file_value,
    field_kinds,
    hints,
    options,
    parse_dataclasses,
    take_config,
    take_nulls,
    takes_value,
)
from trainer.config.schema import SECTIONS, JobConfig
from trainer.errors import ConfigError

# HF Trainer / run_translation names this trainer does not take, with the field to use instead.
# Consulted when a key (file or flag) is unknown, so the error points at ours.
HF_NAME_HINTS: dict[str, str] = {
    "evaluation_strategy": "eval_strategy (the name HF renamed it to)",
    "per_gpu_train_batch_size": "per_device_train_batch_size",
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "deepspeed": "the parallel fields: data_parallel_size, data_parallel_sharding (zero1 | fsdp), "
    "pipeline_parallel_size, tensor_parallel_size",
    "fsdp": "data_parallel_sharding: fsdp (FSDP2 over the dp axis, composed with tp and pp)",
    "fsdp_config": "data_parallel_sharding: fsdp (layers are the FSDP units; bf16 sets mixed precision)",
    "gradient_checkpointing": "activation_checkpointing (none | full | stage | selective)",
    "gradient_checkpointing_kwargs": "activation_checkpointing (none | full | stage | selective)",
    "lr_scheduler_kwargs": "lr_scheduler_type with warmup_steps (no scheduler kwargs)",
    "optim": "nothing: the optimizer is AdamW (adam_beta1, adam_beta2, adam_epsilon, weight_decay)",
    "warmup_ratio": "warmup_steps",
    "torch_compile_backend": "torch_compile (inductor, per layer)",
    "tf32": "nothing: fp32 matmul precision is PyTorch's default; use bf16 for speed",
    "fp16_opt_level": "fp16 (fp16 working weights over fp32 masters: no apex opt levels)",
    "half_precision_backend": "bf16 or fp16 (torch autocast over fp32 masters)",
    "logging_strategy": "logging_steps (a row every N steps)",
    "save_safetensors": "nothing: checkpoints are sharded DCP; `python -m trainer.export` writes safetensors",
    "local_rank": "nothing: torchrun sets LOCAL_RANK",
    "ddp_timeout": "dist_timeout_s",
    "ddp_backend": "nothing: NCCL on GPUs, gloo on CPUs",
    "generation_config": "generation_num_beams and generation_max_length",
    "num_beams": "generation_num_beams",
    "config_name": "the model fields (d_model, encoder_layers, ...) or model_name_or_path",
    "overwrite_cache": "nothing: the tokenization cache is keyed by data, tokenizer and lengths",
    "pad_to_max_length": "nothing: batches are padded to their longest example (length-bucketed)",
    "ignore_pad_token_for_loss": "nothing: padding never counts in the loss",
    "val_max_target_length": "generation_max_length (decoding) / max_target_length (data)",
}

# fairseq-train / fairseq-generate flags (`--max-update` is looked up as max_update), with our field.
FAIRSEQ_NAME_HINTS: dict[str, str] = {
    "max_update": "max_steps (fairseq's --max-update)",
    "total_num_update": "max_steps (fairseq's --total-num-update)",
    "max_epoch": "num_train_epochs (fairseq's --max-epoch)",
    "max_tokens": "max_tokens_per_microbatch (fairseq's --max-tokens; here the tokens of one micro-batch)",
    "max_sentences": "per_device_train_batch_size (fairseq's --max-sentences)",
    "batch_size": "per_device_train_batch_size (fairseq's --batch-size)",
    "update_freq": "gradient_accumulation_steps (fairseq's --update-freq)",
    "save_dir": "output_dir (fairseq's --save-dir)",
    "lr": "learning_rate (fairseq's --lr)",
    "warmup_updates": "warmup_steps (fairseq's --warmup-updates)",
    "lr_scheduler": "lr_scheduler_type (fairseq's --lr-scheduler)",
    "clip_norm": "max_grad_norm (fairseq's --clip-norm)",
    "adam_betas": "adam_beta1 and adam_beta2 (fairseq's --adam-betas)",
    "adam_eps": "adam_epsilon (fairseq's --adam-eps)",
    "label_smoothing": "label_smoothing_factor (fairseq's --label-smoothing)",
    "lang_pairs": "language_pairs (fairseq's --lang-pairs)",
    "log_interval": "logging_steps (fairseq's --log-interval)",
    "save_interval_updates": "save_steps (fairseq's --save-interval-updates)",
    "validate_interval_updates": "eval_steps (fairseq's --validate-interval-updates)",
    "keep_interval_updates": "save_total_limit (fairseq's --keep-interval-updates)",
    "patience": "early_stopping_patience (fairseq's --patience)",
    "best_checkpoint_metric": "metric_for_best_model (fairseq's --best-checkpoint-metric)",
    "restore_file": "resume_from_checkpoint (fairseq's --restore-file)",
    "beam": "generation_num_beams (fairseq's --beam)",
    "checkpoint_activations": "activation_checkpointing (fairseq's --checkpoint-activations)",
    "tensorboard_logdir": "report_to: tensorboard (events in output_dir/runs)",
    "num_workers": "dataloader_num_workers (streaming) or preprocessing_num_workers",
}
OTHER_NAMES = {**HF_NAME_HINTS, **FAIRSEQ_NAME_HINTS}


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {path!r} does not exist")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"config file {path!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path!r} must hold a mapping of field: value, got {type(data).__name__}"
        )
    return data


def parse_config(argv: list[str] | None = None) -> JobConfig:
    """Parse `--config FILE` plus CLI overrides into a validated JobConfig.

    Every field takes `--name value`, `--name-with-dashes value` and `--name=value` (the spellings
    `--help` prints); `--name null` unsets what the file set (`trainer.config.flags`).

    Raises:
        ConfigError: on an unknown key (file or flag) or an invalid value (one line naming the
            field, the value and what it must be).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    path = take_config(argv)
    file_values = _read_file(path) if path is not None else {}
    known = {f.name for cls in SECTIONS for f in fields(cls)}
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {unknown}{hints(unknown, known, OTHER_NAMES)}; see `python -m trainer.train "
            "--help` for valid keys"
        )
    kinds = field_kinds(SECTIONS)
    file_values = {
        k: check_file_value(k, _as_default(v), kinds[k], str(path)) for k, v in file_values.items()
    }
    parser = build_parser(SECTIONS, USAGE, DESCRIPTION)
    spelled = options(parser)
    valued = {s: name for s, name in spelled.items() if s in takes_value(parser)}
    file_values.update(dict.fromkeys(take_nulls(argv, valued)))
    for name in [k for k, v in file_values.items() if v is None and not kinds[k].optional]:
        del file_values[name]  # null on a field that cannot be None: unset, its default applies
    parser.set_defaults(**file_values)
    model, data, parallel, training = parse_dataclasses(parser, argv, OTHER_NAMES)
    return JobConfig(model, data, parallel, training)


USAGE = (
    "python -m trainer.train --config FILE.yaml [--field value ...]\n"
    "       torchrun --nproc-per-node N -m trainer.train --config FILE.yaml [--field value ...]"
)


DESCRIPTION = (
    "Train an M2M100/NLLB translation model on a (pp, dp, tp) mesh. --config FILE (YAML or JSON, "
    "flat field: value pairs, e.g. configs/tiny.yaml) gives every field below; flags override it; "
    "`--field null` unsets a value the file set. Fields follow the HF TrainingArguments names."
)


def _as_default(value: Any) -> Any:
    # Explicit partition lists in YAML ([5, 4, 4, 5]) are carried as the string form.
    if isinstance(value, list) and all(isinstance(x, int) for x in value):
        return ",".join(str(x) for x in value)
    return value


def load_config_dict(values: dict[str, Any]) -> JobConfig:
    """Build a JobConfig from a flat dict (tests, programmatic use); unknown keys are an error."""
    known = {f.name for cls in SECTIONS for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown}{hints(unknown, known, OTHER_NAMES)}")
    parts: list[Any] = []
    for cls in SECTIONS:
        names = {f.name for f in fields(cls)}
        parts.append(cls(**{k: _as_default(v) for k, v in values.items() if k in names}))
    return JobConfig(*parts)
