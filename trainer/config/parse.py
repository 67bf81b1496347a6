"""Parsing the job config: `--config FILE` (YAML or JSON) plus flag overrides, by `HfArgumentParser`.

Unknown keys (file or flag) are an error naming the key, with a hint where it is an HF
Trainer name we spell differently (`HF_NAME_HINTS`); `--field null` unsets a value the file set.
The flags' spellings and value types: `trainer.config.flags`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from trainer.config.flags import (
    argument_error,
    build_parser,
    check_file_value,
    field_kinds,
    options,
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
            f"unknown config key(s) {unknown}{_hints(unknown)}; see `python -m trainer.train --help` for valid keys"
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
    flags = [a.split("=", 1)[0] for a in argv if a.startswith("--") and a != "--"]
    bad = sorted({f for f in flags if f not in spelled})
    if bad:
        raise ConfigError(f"unknown flag(s) {bad}{_hints([b[2:] for b in bad])}; see --help for valid flags")
    try:
        model, data, parallel, training = parser.parse_args_into_dataclasses(args=argv)
    except argparse.ArgumentError as e:
        raise argument_error(e) from None
    except ValueError as e:
        raise ConfigError(str(e)) from None
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


def _hints(names: list[str]) -> str:
    """`; use X for Y` for the unknown names that are HF Trainer names we spell differently
    (either spelling: `per-gpu-train-batch-size` too), or a file key with dashes."""
    known = {f.name for cls in SECTIONS for f in fields(cls)}
    hints = []
    for n in names:
        under = n.replace("-", "_")
        if under in HF_NAME_HINTS:
            hints.append(f"{n}: use {HF_NAME_HINTS[under]}")
        elif under in known and under != n:
            hints.append(f"{n}: write {under}")
    return f" ({'; '.join(hints)})" if hints else ""


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
        raise ConfigError(f"unknown config key(s) {unknown}{_hints(unknown)}")
    parts: list[Any] = []
    for cls in SECTIONS:
        names = {f.name for f in fields(cls)}
        parts.append(cls(**{k: _as_default(v) for k, v in values.items() if k in names}))
    return JobConfig(*parts)
