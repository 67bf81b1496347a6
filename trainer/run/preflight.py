"""The checks a run makes before anything is written or any collective runs (`validate_early`).

Also the planner's filter: a candidate layout's trainer flags must pass them. An option that
would do nothing on the run's mesh or settings is refused in one line naming the field and
why (`refuse_idle_options`), or, where `transformers` accepts it, warned about once by the
logging rank (`idle_option_warnings`).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from models.config import ModelConfig
from parallel.mesh import ParallelDims
from trainer.config.dims import parallel_dims
from trainer.config.pretrained import pretrained_sources
from trainer.config.schema import LAYERDROP_FIELDS, MOE_RUN_DEFAULTS, JobConfig
from trainer.config.training_args import TrainingArguments
from trainer.data.sources import run_languages
from trainer.errors import ConfigError
from trainer.eval.metrics import check_spbleu_model
from trainer.run.strategies import check_metric_name


def validate_early(
    cfg: JobConfig, world: int, arch: ModelConfig | None = None, run_tokenizer: Path | None = None
) -> ParallelDims:
    """Every check that needs no data, before anything is written or any collective runs.

    Where the pretrained model and tokenizer come from (a model directory without tokenizer
    files needs tokenizer_name), mesh vs world size and node size, tp vs heads/FFN/d_model,
    blocks vs stages, an explicit partition's length and sum, and the schedule's (p, m, v)
    constraints; a distillation teacher against the student and the mesh (`trainer.run.distill`).
    `arch`: the architecture when it is known already (a resume: the checkpoint's, so a
    `model_name_or_path` that is gone since is never read); else `model_name_or_path`'s config.json
    or the config's fields. `run_tokenizer`: a resume's tokenizer (its run's). Raises one of
    `trainer.errors.BAD_INPUT` naming the bad value.
    """
    from parallel.pipeline.partition import validate_balance
    from parallel.pipeline.schedule import build_schedule
    from trainer.run.distill import check_mesh, check_teacher, student_tokenizer_dir

    dims = parallel_dims(cfg.parallel, world)
    resumed = arch is not None
    if arch is not None:
        arch = ModelConfig.from_dict(arch.to_dict())  # a copy: the LayerDrop overrides below
    else:
        arch = _architecture(cfg)
    for name in LAYERDROP_FIELDS:
        if getattr(cfg.model, name) is not None:
            setattr(arch, name, getattr(cfg.model, name))
    cfg.model.check_moe(arch)
    tokenizer = run_tokenizer if resumed else student_tokenizer_dir(cfg)
    new_student = not resumed and not cfg.model.model_name_or_path
    teacher = check_teacher(cfg, dims, arch, tokenizer, new_student)
    check_mesh(dims, arch, teacher.config if teacher is not None else None)
    layerdrop = max(arch.encoder_layerdrop, arch.decoder_layerdrop)
    if cfg.parallel.data_parallel_sharding == "fsdp" and dims.dp > 1 and layerdrop > 0:
        raise ConfigError(
            f"data_parallel_sharding=fsdp does not support LayerDrop yet (encoder_layerdrop="
            f"{arch.encoder_layerdrop}, decoder_layerdrop={arch.decoder_layerdrop}): a skipped layer "
            f"leaves its FSDP unit unused; set both to 0 or use data_parallel_sharding none | zero1"
        )
    if cfg.training.torch_compile and arch.num_experts and (dims.ep > 1 or dims.tp > 1):
        # measured in issue 34: ep=2 compiled gradients off eager's by ~1e-4 (the forward equal),
        # tp=2 a dynamo failure on the experts' symbolic capacity; one rank's experts compile exactly
        raise ConfigError(
            f"torch_compile with an NLLB-MoE model (num_experts={arch.num_experts}) needs "
            f"expert_parallel_size=1 and tensor_parallel_size=1 for now (got {dims.ep} and {dims.tp}): "
            "compiled sparse layers spread over ranks do not equal eager yet; set torch_compile: false"
        )
    p, v = dims.pp, cfg.parallel.virtual_stages
    n_blocks = arch.encoder_layers + arch.decoder_layers + 4
    if p * v > n_blocks:
        raise ConfigError(
            f"pipeline_parallel_size({p}) x virtual stages({v}) = {p * v} stages but the model "
            f"has only {n_blocks} blocks ({arch.encoder_layers} encoder + {arch.decoder_layers} "
            f"decoder layers + 4); use fewer stages or more layers"
        )
    balance = cfg.parallel.partition_balance()
    if balance is not None:
        validate_balance(balance, n_blocks, p * v)
    build_schedule(cfg.parallel.pipeline_schedule, p, cfg.parallel.num_microbatches, v)
    refuse_idle_options(cfg, dims)
    check_streaming(cfg)
    check_eval_data(cfg)
    check_predict_args(cfg)
    directions = [f"{s}-{t}" for s, t in cfg.data.directions()]
    check_metric_name(cfg.training.metric_for_best_model, directions, cfg.training.eval_spbleu)
    if cfg.training.eval_spbleu:
        check_spbleu_model("eval_spbleu")  # its SentencePiece model is never downloaded during a run
    return dims


def evaluations_asked(args: TrainingArguments) -> list[str]:
    """What in the config runs evaluations, each as `field=value` ([]: none does): do_eval (before and
    after training), an eval_strategy that evaluates during training, and what reads those evaluations."""
    out = ["do_eval=True"] if args.do_eval else []
    if args.eval_strategy == "epoch" or (args.eval_strategy == "steps" and args.eval_steps):
        every = f" with eval_steps={args.eval_steps}" if args.eval_strategy == "steps" else ""
        out.append(f"eval_strategy={args.eval_strategy!r}{every}")
    out += [f"{name}={getattr(args, name)}" for name in EVAL_READERS if getattr(args, name)]
    return out


# What reads the evaluations (checked by check_best_model_args to come with an eval_strategy), and the
# way to do without each evaluation source named by `evaluations_asked`.
EVAL_READERS = ("load_best_model_at_end", "early_stopping_patience")
WITHOUT = {"do_eval": "--do_eval false", "eval_strategy": "--eval_strategy no",
           "load_best_model_at_end": "no load_best_model_at_end", "early_stopping_patience": "no early_stopping_patience"}  # fmt: skip


def no_eval_data(asked: list[str], source: str) -> str:
    """The one line for evaluations asked without validation data (run_translation.py: "--do_eval
    requires a validation dataset"): what asks, where the data would come from, how to do without."""
    without = ", ".join(WITHOUT[a.split("=", 1)[0]] for a in asked)
    return (
        f"{' and '.join(asked)} need{'s' if len(asked) == 1 else ''} validation data, but {source}: set "
        "validation_file (JSON lines / Parquet / '{lang}' text files, as train_file), or use a dataset_name "
        f"with a validation split; or train without evaluating: {without}"
    )


def check_eval_data(cfg: JobConfig) -> None:
    """Evaluations need validation data: refused where the config has none (train_file without
    validation_file), as run_translation.py refuses do_eval. A dataset_name's splits are known once it
    is read (`trainer.run.data.setup_data` checks them then); the builtin corpus has one.

    Raises:
        ConfigError: evaluations asked (`evaluations_asked`) with neither validation_file nor dataset_name.
    """
    d = cfg.data
    asked = evaluations_asked(cfg.training)
    if asked and not d.validation_file and not d.dataset_name:
        raise ConfigError(no_eval_data(asked, f"train_file={d.train_file!r} comes with none"))


def check_predict_args(cfg: JobConfig) -> None:
    """do_predict needs test data: a test_file that exists, or a dataset_name (checked before
    anything runs; a dataset without a 'test' split is refused when the data is loaded, before
    training: `trainer.run.setup.setup_run`).

    Raises:
        ConfigError: do_predict with neither test_file nor dataset_name, or a test_file (or one of
            its per-language files, for a '{lang}' pattern) that does not exist.
    """
    if not cfg.training.do_predict:
        return
    test = cfg.data.test_file
    if not test and cfg.data.dataset_name:
        return
    if not test:
        raise ConfigError(
            "do_predict=True needs test_file (JSON lines / Parquet / '{lang}' text files) "
            "or a dataset_name with a 'test' split"
        )
    paths = [test.format(lang=lang) for lang in run_languages(cfg.data)] if "{lang}" in test else [test]
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise ConfigError(f"test_file={test!r}: {missing[0]!r} does not exist")


def check_streaming(cfg: JobConfig) -> None:
    """A stream's epoch length is unknown before it is read (counting it would read the corpus), so
    `streaming: true` needs max_steps and steps-based evaluation and saving, as the HF Trainer
    needs max_steps for an IterableDataset.

    Raises:
        ConfigError: streaming with max_steps <= 0 or an "epoch" strategy.
    """
    tr = cfg.training
    if not cfg.data.streaming:
        return
    if tr.max_steps <= 0:
        raise ConfigError(
            f"streaming: true needs max_steps > 0 (got {tr.max_steps}; num_train_epochs={tr.num_train_epochs} "
            "cannot be turned into steps without reading the whole corpus); set max_steps"
        )
    for kind in ("eval", "save"):
        if getattr(tr, f"{kind}_strategy") == "epoch":
            raise ConfigError(
                f"{kind}_strategy='epoch' needs the epoch's length, unknown for a stream (streaming: true); "
                f"use {kind}_strategy: steps with {kind}_steps"
            )


def _default(section: type, name: str) -> Any:
    return next(f.default for f in fields(section) if f.name == name)


def refuse_idle_options(cfg: JobConfig, dims: ParallelDims) -> None:
    """Refuse options that would do nothing on this mesh or with these settings (our own fields;
    `transformers` has none of them), naming the field, its value, why, and what to set.

    Raises:
        ConfigError: the first such option.
    """
    par, tr = cfg.parallel, cfg.training
    if par.sequence_parallel and dims.tp == 1:
        raise ConfigError(
            "sequence_parallel=True does nothing with tensor_parallel_size=1: it splits the tp ranks' "
            "replicated norms and dropout along the sequence; set sequence_parallel: false, or "
            "tensor_parallel_size > 1"
        )
    if par.data_parallel_sharding != "none" and dims.dp == 1:
        inferred = (
            " (data_parallel_size=-1 inferred it from the world size)" if par.data_parallel_size == -1 else ""
        )
        raise ConfigError(
            f"data_parallel_sharding={par.data_parallel_sharding!r} does nothing with data_parallel_size=1"
            f"{inferred}: there is no replica to shard over; set data_parallel_sharding: none, or "
            "data_parallel_size > 1"
        )
    if par.pipeline_schedule != "interleaved_1f1b" and par.virtual_pipeline_stages is not None:
        raise ConfigError(
            f"virtual_pipeline_stages={par.virtual_pipeline_stages} does nothing with pipeline_schedule="
            f"{par.pipeline_schedule!r}: only interleaved_1f1b takes it (zbv always places 2 stages per "
            "rank); remove it, or use pipeline_schedule: interleaved_1f1b"
        )
    if dims.pp * par.virtual_stages == 1 and par.partition_method in ("parameters", "time", "memory"):
        raise ConfigError(
            f"partition_method={par.partition_method!r} does nothing with one pipeline stage "
            "(pipeline_parallel_size=1): there is nothing to balance; remove it, or set "
            "pipeline_parallel_size > 1"
        )
    if par.hang_warning_s >= par.dist_timeout_s:
        raise ConfigError(
            f"hang_warning_s={par.hang_warning_s:g} does nothing with dist_timeout_s={par.dist_timeout_s}: "
            "a wait fails at the timeout before it would warn; set it below dist_timeout_s (0: the default)"
        )
    if not tr.fp16:
        for name in ("fp16_initial_scale", "fp16_scale_growth_interval"):
            if getattr(tr, name) != _default(TrainingArguments, name):
                raise ConfigError(
                    f"{name}={getattr(tr, name)!r} does nothing without fp16=True (the dynamic loss "
                    "scale is fp16's); remove it, or set fp16: true"
                )
    if tr.early_stopping_threshold and not tr.early_stopping_patience:
        raise ConfigError(
            f"early_stopping_threshold={tr.early_stopping_threshold} does nothing without "
            "early_stopping_patience; remove it, or set early_stopping_patience"
        )
    m = cfg.model
    if m.moe_dropless and m.moe_capacity_factor != MOE_RUN_DEFAULTS["moe_capacity_factor"]:
        raise ConfigError(
            f"moe_capacity_factor={m.moe_capacity_factor} does nothing with moe_dropless=True (dropless "
            "routing has no capacity); remove it, or set moe_dropless: false"
        )
    if not cfg.model.teacher_model_name_or_path:
        for name in ("distillation_alpha", "distillation_temperature"):
            if getattr(tr, name) != _default(TrainingArguments, name):
                raise ConfigError(
                    f"{name}={getattr(tr, name)} does nothing without teacher_model_name_or_path (it "
                    "weighs the distillation loss); remove it, or name a teacher"
                )
    if cfg.data.sampling_temperature != 1.0 and len(cfg.data.directions()) == 1:
        raise ConfigError(
            f"sampling_temperature={cfg.data.sampling_temperature} does nothing with one direction "
            f"({'-'.join(cfg.data.directions()[0])}): it weighs directions against each other; remove it"
        )


def idle_option_warnings(cfg: JobConfig) -> list[str]:
    """Options `transformers` accepts that would do nothing here, one line each naming the field
    (the logging rank warns once). `greater_is_better` is resolved by then only where a best
    model or early stopping is asked for."""
    tr = cfg.training
    out = []
    for kind in ("eval", "save"):
        strategy, every = getattr(tr, f"{kind}_strategy"), getattr(tr, f"{kind}_steps")
        if every and strategy != "steps":
            out.append(
                f"{kind}_steps={every} does nothing with {kind}_strategy={strategy!r} (only 'steps' reads it)"
            )
    d = cfg.data
    if not d.streaming:
        for name in ("dataloader_num_workers", "dataloader_prefetch_factor"):
            if getattr(d, name) != _default(type(d), name):
                out.append(
                    f"{name}={getattr(d, name)} does nothing without streaming: true (map-style batches "
                    "are fetched in the training process; preprocessing_num_workers tokenizes the corpus)"
                )
    if cfg.model.teacher_model_name_or_path and tr.distillation_alpha == 0:
        out.append(
            "teacher_model_name_or_path does nothing with distillation_alpha=0: the teacher is not "
            "loaded and the run trains on the label loss alone"
        )
    if tr.greater_is_better is not None and tr.metric_for_best_model is None:
        out.append(
            f"greater_is_better={tr.greater_is_better} does nothing without metric_for_best_model, "
            "load_best_model_at_end or early_stopping_patience"
        )
    if not (tr.do_eval or tr.do_predict or tr.eval_strategy != "no"):
        for name in ("bf16_full_eval", "fp16_full_eval", "generation_num_beams", "generation_max_length",
                     "eval_spbleu"):  # fmt: skip
            if getattr(tr, name) != _default(TrainingArguments, name):
                out.append(
                    f"{name}={getattr(tr, name)} does nothing: no evaluation runs (do_eval, do_predict "
                    "false, eval_strategy 'no')"
                )
    return out


def _architecture(cfg: JobConfig) -> ModelConfig:
    """The run's architecture: `model_name_or_path`'s config.json (resolved, and checked to come
    with a tokenizer: `pretrained_sources`), else the config's fields."""
    pretrained = pretrained_sources(cfg.model.model_name_or_path, cfg.model.tokenizer_name)
    if pretrained.model is None:
        return cfg.model.model_config(cfg.model.vocab_size, {})
    from models.hf import read_hf_config

    return read_hf_config(pretrained.model)
