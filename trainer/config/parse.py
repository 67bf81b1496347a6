"""Parsing the job config: `--config FILE` (YAML or JSON) plus flag overrides, by `HfArgumentParser`.

Unknown keys (file or flag) are an error naming the key, with a hint where it is an HF
Trainer name we spell differently (`HF_NAME_HINTS`); `--field null` unsets a value the file set.
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

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

    Raises:
        ConfigError: on an unknown key (file or flag) or an invalid value.
    """
    from transformers import HfArgumentParser

    argv = list(sys.argv[1:] if argv is None else argv)
    file_values: dict[str, Any] = {}
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config needs a file path")
        file_values = _read_file(argv[i + 1])
        del argv[i : i + 2]
    known = {f.name for cls in SECTIONS for f in fields(cls)}
    unknown = sorted(set(file_values) - known)
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {unknown}{_hints(unknown)}; see `python -m trainer.train --help` for valid keys"
        )
    parser = HfArgumentParser(SECTIONS, usage=USAGE, description=DESCRIPTION)  # type: ignore[arg-type]
    file_values.update(_take_nulls(argv, known))
    parser.set_defaults(**{k: _as_default(v) for k, v in file_values.items()})
    flags = [a.split("=", 1)[0][2:] for a in argv if a.startswith("--")]
    bad = sorted({f for f in flags if f not in known and f != "help"})
    if bad:
        raise ConfigError(
            f"unknown flag(s) {['--' + b for b in bad]}{_hints(bad)}; see --help for valid flags"
        )
    try:
        model, data, parallel, training = parser.parse_args_into_dataclasses(args=argv)
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
    """`; use X for Y` for the unknown names that are HF Trainer names we spell differently."""
    hints = [f"{n}: use {HF_NAME_HINTS[n]}" for n in names if n in HF_NAME_HINTS]
    return f" ({'; '.join(hints)})" if hints else ""


def _take_nulls(argv: list[str], known: set[str]) -> dict[str, None]:
    """Remove `--field null` / `--field=null` from `argv` (in place); returns {field: None}.

    argparse would read "null" as the string "null" (or fail on a number); on the command
    line it means: unset what the config file set, as `field: null` would in the file.
    """
    out: dict[str, None] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name in known and eq and value == "null":
            out[name] = None
            del argv[i]
            continue
        if name in known and not eq and i + 1 < len(argv) and argv[i + 1] == "null":
            out[name] = None
            del argv[i : i + 2]
            continue
        i += 1
    return out


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
