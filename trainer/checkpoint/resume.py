"""Honest resume: what a resumed run must share with its checkpoint's run, and what it reads back.

A resume continues *the same run*. Its tokenizer and model config are read back from the
checkpoint's run (the directory holding `checkpoint-<step>/`: `tokenizer/`, and the
checkpoint's `trainer_state.json` "model_config", which `model_config.json` mirrors); they
are never retrained or rewritten, and neither is `config.yaml`. Every check below reads
files only and runs on every rank before anything is written, so a mismatch is one
clear error on all ranks and leaves output_dir as it was.

    must match (ConfigError naming the field, the run's value and the new one)
        tokenizer     tokenizer_name, vocab_size, spm_model_type, spm_character_coverage,
                      spm_input_sentence_size; tokenizer/ must still hash to the checkpoint's
        model         model_name_or_path and the architecture fields
        data          what the sequence of global batches depends on: seed, the source and
                      the directions, builtin_size, max_train_samples, max_*_length,
                      sampling_temperature, sampling_weights
        lr schedule   learning_rate, lr_scheduler_type, warmup_steps: the checkpoint's
                      scheduler state (its base lr included) is restored, so a new value
                      would be silently ignored or mixed with the old one
        global batch  per_device_train_batch_size x num_microbatches x gradient_accumulation_steps
                      x dp (or the token cap and the slot count): the data position counts
                      global batches. A different mesh with the same global batch is fine:
                      checkpoints reshard.
    may change (logged at resume; later checkpoints record them in trainer_state.json "config")
        the mesh and the pipeline engine, max_steps (the lr decay then stretches to the new
        end, as in the HF Trainer), logging / eval / save cadence and limits, evaluation and
        generation settings, validation data, file paths of the same training data (its
        example count is checked by the sampler), tokenization and data-loader workers and cache_dir,
        optimizer betas / eps / weight decay and
        clipping (applied from the resumed step on; DCP restores only the moment tensors),
        regularisation (dropout, label smoothing, NLLB-MoE's moe_token_dropout), the distillation
        teacher and loss (teacher_model_name_or_path, distillation_alpha / _temperature), NLLB-MoE's
        router_aux_loss_coef, moe_dropless and moe_capacity_factor, the divergence guard (nan_policy), precision /
        compile, timeouts, tracking, output_dir; num_train_epochs, the eval/save strategies,
        best-model and early-stopping settings, do_train/do_predict and test_file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from models.config import ModelConfig
from parallel.mesh import ParallelDims
from trainer.checkpoint import dcp as ckpt
from trainer.config.schema import (
    LAYERDROP_FIELDS,
    MOE_ARCH_FIELDS,
    MOE_RUN_FIELDS,
    MOE_SESSION_FIELDS,
    SESSION_DROPOUTS,
    JobConfig,
)
from trainer.data.batching import BatchLayout
from trainer.errors import ConfigError

logger = logging.getLogger(__name__)

TOKENIZER = "tokenizer"
MUST_MATCH: dict[str, tuple[str, ...]] = {
    "tokenizer": (
        "tokenizer_name",
        "vocab_size",
        "spm_model_type",
        "spm_character_coverage",
        "spm_input_sentence_size",
    ),
    "model": (
        "model_name_or_path",
        "d_model",
        "encoder_layers",
        "decoder_layers",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "activation_function",
        "max_position_embeddings",
        "scale_embedding",
        "num_experts",  # NLLB-MoE architecture (the routing options may change, as EOM)
        *MOE_ARCH_FIELDS,
    ),
    "data": (
        "seed",
        "dataset_name",
        "dataset_config_name",
        "language_pairs",
        "source_lang",
        "target_lang",
        "builtin_size",
        "max_train_samples",
        "max_source_length",
        "max_target_length",
        "skip_long_examples",
        "streaming",  # a stream's data position is not a map-style sampler's
        "max_tokens_per_microbatch",
        "pad_to_multiple_of",  # in token mode it decides which examples share a micro-batch
        "sampling_temperature",
        "sampling_weights",
    ),
    "lr schedule": ("learning_rate", "lr_scheduler_type", "warmup_steps"),
}
GLOBAL_BATCH = ("per_device_train_batch_size", "num_microbatches", "gradient_accumulation_steps")
# Regularisation is the session's choice: the weights' model_config takes these from the new config.
SESSION_MODEL_FIELDS = SESSION_DROPOUTS
MAY_CHANGE = (
    *GLOBAL_BATCH,  # each may change; their product (x dp) may not
    *SESSION_MODEL_FIELDS,
    *LAYERDROP_FIELDS,  # LayerDrop too, where the session sets it (None: the checkpoint's value)
    *MOE_SESSION_FIELDS,  # NLLB-MoE: EOM, the aux loss weight and routing, as LayerDrop
    *MOE_RUN_FIELDS,  # NLLB-MoE routing options of the run (dropless, capacity factor)
    "init_std",  # only draws the initial weights, which come from the checkpoint
    "train_file",
    "validation_file",
    "max_eval_samples",
    "max_bad_record_fraction",
    "cache_dir",
    "pipeline_parallel_size",
    "tensor_parallel_size",
    "data_parallel_size",
    "expert_parallel_size",  # checkpoints keep one entry per expert: they reshard across ep
    "pipeline_schedule",
    "virtual_pipeline_stages",
    "activation_checkpointing",
    "partition_method",
    "sequence_parallel",
    "profile_activation_memory",
    "data_parallel_sharding",
    "allow_tp_across_nodes",
    "dist_timeout_s",
    "hang_warning_s",
    "output_dir",
    "overwrite_output_dir",
    "max_steps",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "max_grad_norm",
    "nan_policy",
    "nan_max_consecutive_skips",
    "label_smoothing_factor",
    # the distillation loss, like label smoothing (the teacher is reloaded from its path on resume)
    "teacher_model_name_or_path",
    "distillation_alpha",
    "distillation_temperature",
    "per_device_eval_batch_size",
    "logging_steps",
    "eval_steps",
    "do_eval",
    "save_steps",
    "async_save",  # how checkpoints are written, not what
    "save_total_limit",
    "resume_from_checkpoint",
    "bf16",
    "fp16",  # an fp16 resume restores the checkpoint's loss scale when it has one (else the initial)
    "fp16_initial_scale",  # only the first step of a run without a saved scale starts from it
    "fp16_scale_growth_interval",
    "bf16_full_eval",  # evaluation's precision only
    "fp16_full_eval",
    "torch_compile",
    "mfu_peak_tflops",
    "generation_num_beams",
    "generation_max_length",
    "report_to",
    "run_name",
    "wandb_project",
    "disable_tqdm",
    "plots",
    # run_translation / Seq2SeqTrainingArguments names (trainer/run/strategies.py, trainer/eval/predict.py)
    "num_train_epochs",  # like max_steps: the lr decay stretches to the new end
    "eval_strategy",
    "save_strategy",
    "do_train",
    "do_predict",
    "predict_with_generate",
    "load_best_model_at_end",
    "metric_for_best_model",  # a changed metric or direction restarts the best-model record
    "greater_is_better",
    "early_stopping_patience",
    "early_stopping_threshold",
    "test_file",
    "forced_bos_token",  # only confirms the directions' target, which must match
    "source_prefix",
    "preprocessing_num_workers",  # how, not what, is tokenized
    "dataloader_num_workers",  # the stream is the same for any number of workers
    "dataloader_prefetch_factor",
    "max_predict_samples",
    "eval_spbleu",  # an evaluation metric
)


@dataclass
class ResumePoint:
    """A complete checkpoint to resume from, its trainer_state, and the run it belongs to."""

    path: Path  # checkpoint-<step>/
    state: dict[str, Any]  # its trainer_state.json
    changes: list[str] = field(default_factory=list)  # "max_steps: 4 -> 8", the allowed differences

    @property
    def run_dir(self) -> Path:
        """The output_dir of the run that wrote the checkpoint (holds its tokenizer/)."""
        return self.path.parent

    @property
    def step(self) -> int:
        return int(self.state["step"])

    def model_config(self, cfg: JobConfig) -> ModelConfig:
        """The architecture the checkpoint's weights have, with this session's dropouts."""
        values = dict(self.state["model_config"])
        values.update({k: getattr(cfg.model, k) for k in SESSION_MODEL_FIELDS})
        session = (*LAYERDROP_FIELDS, *MOE_SESSION_FIELDS)
        values.update({k: v for k in session if (v := getattr(cfg.model, k)) is not None})
        return ModelConfig.from_dict(values)


def find_resume(cfg: JobConfig, dims: ParallelDims) -> ResumePoint | None:
    """Resolve `resume_from_checkpoint` and check this config against the checkpoint's run.

    Reads files only (same answer on every rank); call before anything is written.

    Args:
        cfg: this session's config.
        dims: the validated mesh (its dp enters the global batch).

    Returns:
        The resume point (with the allowed changes listed), or None to start from step 0.

    Raises:
        ConfigError: a must-match field, the global batch or the tokenizer files differ from
            the checkpoint's run (message: field, the run's value, the new one), or max_steps
            is below the checkpoint's step.
        FileNotFoundError: the named checkpoint does not exist or is incomplete.
    """
    path = ckpt.resolve_resume(cfg.training.resume_from_checkpoint, cfg.training.output_dir)
    if path is None:
        return None
    state = json.loads((path / "trainer_state.json").read_text())
    point = ResumePoint(path, state)
    if 0 < cfg.training.max_steps < point.step:  # -1 (epochs): checked once resolved (trainer.train)
        raise ConfigError(
            f"max_steps={cfg.training.max_steps} is below the step of resume_from_checkpoint={path} "
            f"({point.step}); valid: max_steps >= {point.step}"
        )
    saved = state.get("config") or _read_run_config(point.run_dir)
    if saved is not None:
        point.changes = compare_configs(saved, cfg.to_dict(), str(path))
    check_global_batch(cfg, dims, state, saved or {}, str(path))
    check_tokenizer(point, Path(cfg.training.output_dir))
    return point


def _read_run_config(run_dir: Path) -> dict[str, Any] | None:
    """config.yaml of the checkpoint's run: the fallback for checkpoints written before
    trainer_state.json held the config."""
    p = run_dir / "config.yaml"
    return yaml.safe_load(p.read_text()) if p.is_file() else None


def compare_configs(saved: dict[str, Any], new: dict[str, Any], where: str) -> list[str]:
    """Raise on the first must-match field that differs; return the allowed differences.

    Raises:
        ConfigError: `resume_from_checkpoint=<where>: <field>=<new> but the run has <old> (<group>) ...`.
    """
    for group, names in MUST_MATCH.items():
        for name in names:
            if name in saved and saved[name] != new.get(name):
                raise ConfigError(
                    f"resume_from_checkpoint={where}: {name}={new.get(name)!r} but the checkpoint's run has "
                    f"{saved[name]!r} ({group}); a resumed run keeps its tokenizer, model, data, lr schedule "
                    f"and global batch: resume with {name}={saved[name]!r}, or start a new output_dir"
                )
    return [
        f"{k}: {saved[k]!r} -> {v!r}"
        for k, v in new.items()
        if k in saved and saved[k] != v and k not in ("resume_from_checkpoint",)
    ]


def check_global_batch(
    cfg: JobConfig, dims: ParallelDims, state: dict[str, Any], saved: dict[str, Any], where: str
) -> None:
    """The data position counts global batches: their size must be the checkpoint's.

    Raises:
        ConfigError: naming both products and their factors.
    """
    layout = BatchLayout(
        cfg.training.per_device_train_batch_size,
        cfg.parallel.num_microbatches,
        cfg.training.gradient_accumulation_steps,
        dims.dp,
        cfg.data.max_tokens_per_microbatch,
        cfg.data.pad_to_multiple_of,
    )
    mine = layout.signature()
    theirs = {k: state.get("data", {}).get(k) for k in mine}
    if theirs == mine:
        return
    new_dp, old_dp = dims.dp, state.get("mesh", {}).get("dp", "?")
    values = cfg.to_dict()
    factors = " x ".join(f"{n}({values[n]})" for n in GLOBAL_BATCH)
    old = " x ".join(f"{n}({saved.get(n, '?')})" for n in GLOBAL_BATCH)
    raise ConfigError(
        f"resume_from_checkpoint={where}: global batch {_show(mine)} = {factors} x dp({new_dp}) but the "
        f"checkpoint's run has {_show(theirs)} = {old} x dp({old_dp}); a different mesh is fine if the "
        f"global batch stays the same"
    )


def _show(signature: dict[str, Any]) -> str:
    """A BatchLayout signature in words: `8`, or `4 slots of <= 512 tokens`."""
    if "global_batch_size" in signature:
        return str(signature["global_batch_size"])
    return f"{signature['num_slots']} slots of <= {signature['max_tokens_per_microbatch']} tokens"


def tokenizer_checksum(directory: Path) -> str:
    """sha256 over the tokenizer directory's file names and bytes (its identity in trainer_state.json)."""
    h = hashlib.sha256()
    for p in sorted(q for q in directory.rglob("*") if q.is_file()):
        h.update(p.relative_to(directory).as_posix().encode() + b"\0")
        h.update(p.read_bytes())
    return h.hexdigest()


def check_tokenizer(point: ResumePoint, out: Path) -> None:
    """The run's tokenizer/ exists, is the one the checkpoint was trained with, and (resuming
    into another output_dir) that directory holds no different tokenizer/.

    Raises:
        ConfigError: tokenizer/ is missing, its checksum differs from the checkpoint's, or
            output_dir already holds a different one.
    """
    tok_dir = point.run_dir / TOKENIZER
    if not tok_dir.is_dir():
        raise ConfigError(
            f"resume_from_checkpoint={point.path}: the run has no {TOKENIZER}/ at {str(tok_dir)!r}; "
            f"a resumed run reads its tokenizer back from there"
        )
    saved = point.state.get("tokenizer_sha256")
    if saved and saved != tokenizer_checksum(tok_dir):
        raise ConfigError(
            f"resume_from_checkpoint={point.path}: {str(tok_dir)!r} is not the tokenizer the checkpoint "
            f"was trained with (sha256 {tokenizer_checksum(tok_dir)[:12]} != {saved[:12]}); it was rewritten "
            f"after the checkpoint"
        )
    dst = out / TOKENIZER
    if dst.is_dir() and dst.resolve() != tok_dir.resolve():
        if tokenizer_checksum(dst) != tokenizer_checksum(tok_dir):
            raise ConfigError(
                f"output_dir={str(out)!r} holds a {TOKENIZER}/ different from the checkpoint's run's "
                f"({str(tok_dir)!r}); resume into the checkpoint's own output_dir or an empty one"
            )


def adopt_tokenizer(point: ResumePoint, out: Path, rank: int) -> Path:
    """Where this session reads the tokenizer: the checkpoint's run's tokenizer/.

    Resuming into another output_dir copies it there (rank 0) so that its checkpoints export;
    one already there was checked identical by `check_tokenizer` and is left alone.

    Returns:
        The tokenizer directory to load (identical on every rank).
    """
    src, dst = point.run_dir / TOKENIZER, out / TOKENIZER
    if rank == 0 and not dst.is_dir():
        shutil.copytree(src, dst)
    return src


def run_identity(cfg: JobConfig, tok_dir: Path) -> dict[str, Any]:
    """What a checkpoint records so that a resume can check it continues the same run."""
    return {"config": cfg.to_dict(), "tokenizer_sha256": tokenizer_checksum(tok_dir)}


def log_changes(point: ResumePoint) -> None:
    logger.info(
        "resuming %s at step %d; changed on resume: %s",
        point.path,
        point.step,
        "; ".join(point.changes) if point.changes else "nothing",
    )
