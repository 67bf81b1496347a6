"""The training section of the job config: optimisation, evaluation, checkpoints, failures, tracking."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config.checks import (
    NAN_POLICIES,
    REPORT_CHOICES,
    SCHEDULER_CHOICES,
    STRATEGY_CHOICES,
    check_choice,
    check_range,
    resolve_report_to,
)
from trainer.errors import ConfigError

FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: the loss scale is held in fp32


@dataclass
class TrainingArguments:
    """The optimisation loop, evaluation, checkpoints and tracking (TrainingArguments names)."""

    _argument_group_name = (
        "training: optimisation, evaluation, checkpoints, failures, tracking"  # a section of `--help`
    )

    output_dir: str = field(default="outputs/run", metadata={"help": "Where everything is written."})
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Reuse a non-empty output_dir: a fresh start (no resume, not a torchrun restart) "
            "first moves the earlier run's checkpoints, metrics, summary, tokenizer, configs and logs "
            "into output_dir/overwritten_run/, removed when this run commits its first checkpoint."
        },
    )
    max_steps: int = field(
        default=-1,
        metadata={
            "help": "Optimizer steps; > 0 overrides num_train_epochs (as in HF); -1: from num_train_epochs."
        },
    )
    num_train_epochs: float = field(
        default=3.0,
        metadata={
            "help": "Epochs when max_steps is -1: max_steps = ceil(num_train_epochs x global batches per "
            "epoch) (a fraction is allowed)."
        },
    )
    learning_rate: float = field(default=5e-4, metadata={"help": "Peak learning rate."})
    warmup_steps: int = field(default=0, metadata={"help": "Linear warmup steps."})
    lr_scheduler_type: str = field(default="linear", metadata={"help": f"One of {list(SCHEDULER_CHOICES)}."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay (not on norms/biases)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.98, metadata={"help": "AdamW beta2."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Global grad-norm clip; 0 disables."})
    nan_policy: str = field(
        default="stop",
        metadata={
            "help": f"One of {list(NAN_POLICIES)}. On a non-finite loss or grad norm, 'stop' exits "
            "with code 3 naming the step (nothing applied or saved); 'skip' drops the step's update "
            "(no AdamW or lr-scheduler step; its batch is consumed) and counts it (skipped_steps)."
        },
    )
    nan_max_consecutive_skips: int = field(
        default=5,
        metadata={"help": "nan_policy=skip: stop (exit code 3) after more non-finite steps in a row."},
    )
    label_smoothing_factor: float = field(default=0.0, metadata={"help": "Label smoothing epsilon."})
    distillation_alpha: float = field(
        default=0.5,
        metadata={
            "help": "With teacher_model_name_or_path: the loss is (1 - alpha) x the label loss + alpha x "
            "the KL term (word-level distillation); 0: plain training (the teacher is not loaded)."
        },
    )
    distillation_temperature: float = field(
        default=1.0,
        metadata={
            "help": "With teacher_model_name_or_path: T of the KL term, KL(p_teacher^T || p_student^T) T^2."
        },
    )
    per_device_train_batch_size: int = field(default=16, metadata={"help": "Sentence pairs per micro-batch."})
    per_device_eval_batch_size: int = field(default=32, metadata={"help": "Sentence pairs per eval batch."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Pipeline flushes per step."})
    logging_steps: int = field(default=10, metadata={"help": "Log every N steps."})
    eval_strategy: str = field(
        default="steps",
        metadata={
            "help": f"One of {list(STRATEGY_CHOICES)}: evaluate during training every eval_steps, at each "
            "epoch's end, or not (do_eval still evaluates before and after)."
        },
    )
    eval_steps: int = field(
        default=0, metadata={"help": "eval_strategy=steps: every N steps (0: only at the end)."}
    )
    do_train: bool = field(default=True, metadata={"help": "Train (false: only evaluate and/or predict)."})
    do_eval: bool = field(default=True, metadata={"help": "Evaluate before and after training."})
    do_predict: bool = field(
        default=False,
        metadata={
            "help": "After training, translate test_file (else dataset_name's 'test' split) per direction: "
            "predictions_<src>-<tgt>.txt and "
            "predict_results.json (predict_bleu, predict_chrf, predict_chrf++ per direction) in output_dir."
        },
    )
    predict_with_generate: bool = field(
        default=True,
        metadata={"help": "Accepted for run_translation configs: evaluation and prediction always decode."},
    )
    save_strategy: str = field(
        default="steps",
        metadata={
            "help": f"One of {list(STRATEGY_CHOICES)}: checkpoint every save_steps, at each epoch's end, or "
            "not during training; the final checkpoint is always written when training."
        },
    )
    save_steps: int = field(
        default=0, metadata={"help": "save_strategy=steps: every N steps (0: only at the end)."}
    )
    async_save: bool = field(
        default=False,
        metadata={
            "help": "Write checkpoints in the background (DCP async_save): a save costs the step only the "
            "copy to host memory; the next save, the end of training and a preemption wait for it, and "
            "its COMMITTED marker is written only once every rank's files are on disk (no HF name)."
        },
    )
    save_total_limit: int | None = field(
        default=None, metadata={"help": "Keep at most N checkpoints (the best one is always kept)."}
    )
    load_best_model_at_end: bool = field(
        default=False,
        metadata={
            "help": "Track the best checkpoint by metric_for_best_model and load it at the end (before "
            "predict and the summary); needs the same eval and save strategy (save_steps a multiple of "
            "eval_steps), as in HF."
        },
    )
    metric_for_best_model: str | None = field(
        default=None,
        metadata={
            "help": "An evaluation key (eval_loss, eval_bleu, eval_chrf, eval_chrf++, eval_spbleu, "
            "eval_bleu_en-de, ...; the eval_ "
            "prefix may be left out); default eval_loss when a best model or early stopping is asked for."
        },
    )
    greater_is_better: bool | None = field(
        default=None,
        metadata={"help": "Whether a larger metric is better; default: false for a *loss metric, else true."},
    )
    early_stopping_patience: int | None = field(
        default=None,
        metadata={
            "help": "Stop after this many evaluations in a row without improving metric_for_best_model by "
            "more than early_stopping_threshold (HF EarlyStoppingCallback)."
        },
    )
    early_stopping_threshold: float = field(
        default=0.0, metadata={"help": "The improvement that counts for early stopping."}
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "A checkpoint directory, or 'latest' for the newest in output_dir (none there: a "
            "warning, and training starts from step 0, as a first attempt under torchrun --max-restarts or "
            "a SLURM requeue does); true (the HF Trainer's bool: True, yes) the newest too, but refused "
            "when output_dir has none, as in the HF Trainer; false means no resume."
        },
    )
    seed: int = field(default=42, metadata={"help": "Seed for init, data order and dropout."})
    bf16: bool = field(
        default=False,
        metadata={"help": "bf16 working weights (cast once per step) over fp32 masters, bf16 autocast."},
    )
    fp16: bool = field(
        default=False,
        metadata={
            "help": "fp16 working weights over fp32 masters, fp16 autocast, dynamic loss scaling agreed "
            "by every rank (an overflow on any rank skips the step everywhere and halves the scale)."
        },
    )
    bf16_full_eval: bool = field(
        default=False,
        metadata={
            "help": "Evaluate (loss and decoding) with every weight cast to bf16 and no autocast, as "
            "transformers does; default: evaluation runs in the training precision (autocast)."
        },
    )
    fp16_full_eval: bool = field(
        default=False,
        metadata={"help": "Evaluate with every weight cast to fp16 and no autocast (as bf16_full_eval)."},
    )
    fp16_initial_scale: float = field(
        default=2.0**16,
        metadata={
            "help": "fp16: the loss scale of the first step (torch GradScaler's init_scale; DeepSpeed's "
            "2**initial_scale_power)."
        },
    )
    fp16_scale_growth_interval: int = field(
        default=2000,
        metadata={
            "help": "fp16: steps in a row without overflow before the loss scale doubles (GradScaler's "
            "growth_interval; DeepSpeed's loss_scale_window)."
        },
    )
    torch_compile: bool = field(
        default=False, metadata={"help": "torch.compile each encoder/decoder layer (regional compilation)."}
    )
    mfu_peak_tflops: float = field(
        default=0.0,
        metadata={"help": "Per-device peak TFLOP/s for the logged mfu; 0: from the device table (GPUs)."},
    )
    generation_num_beams: int = field(default=1, metadata={"help": "Beams for evaluation decoding."})
    generation_max_length: int = field(default=64, metadata={"help": "Longest generated translation."})
    eval_spbleu: bool = field(
        default=False,
        metadata={
            "help": "Also score spBLEU (eval_spbleu, per direction too: BLEU on sacreBLEU's flores200 "
            "SentencePiece pieces, as NLLB reports). Needs that model in sacreBLEU's cache "
            "($SACREBLEU/models/flores200sacrebleuspm, default ~/.sacrebleu/...); refused before the run "
            "where it is absent (never downloaded)."
        },
    )
    report_to: list[str] = field(
        default_factory=lambda: ["none"],
        metadata={
            "help": f"Trackers beside metrics.jsonl: any of {list(REPORT_CHOICES)}, 'all' (those installed) "
            "or 'none'; one name or a list, as in the HF Trainer."
        },
    )
    run_name: str | None = field(default=None, metadata={"help": "Run name for tracking."})
    wandb_project: str = field(default="polyglot3d", metadata={"help": "W&B project."})
    disable_tqdm: bool = field(default=False, metadata={"help": "No progress bar."})
    plots: bool = field(
        default=True,
        metadata={
            "help": "Draw curves.png (from metrics.jsonl) and, under a pipeline, timeline.png in output_dir "
            "with matplotlib (a few hundred ms of CPU each, on the logging rank); false: neither "
            "(timeline_trace.json is still written)."
        },
    )

    def __post_init__(self) -> None:
        self.resume_from_checkpoint = resume_spec(self.resume_from_checkpoint)
        self.report_to = resolve_report_to(self.report_to)
        check_choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULER_CHOICES)
        check_choice("nan_policy", self.nan_policy, NAN_POLICIES)
        positive = ("per_device_train_batch_size", "per_device_eval_batch_size",
                    "gradient_accumulation_steps", "logging_steps", "generation_num_beams",
                    "generation_max_length", "nan_max_consecutive_skips",
                    "fp16_scale_growth_interval")  # fmt: skip
        check_range(self, positive, 1)
        check_range(self, ("warmup_steps", "eval_steps", "save_steps"), 0)  # 0: none / only at the end
        check_range(self, ("learning_rate", "weight_decay", "mfu_peak_tflops"), 0)
        check_range(self, ("max_grad_norm",), 0)  # 0 disables clipping
        check_range(self, ("adam_beta1", "adam_beta2", "label_smoothing_factor"), 0, 1, high_open=True)
        check_range(self, ("distillation_alpha",), 0, 1)
        check_range(self, ("distillation_temperature",), 0, low_open=True)
        check_range(self, ("adam_epsilon",), 0, low_open=True)
        check_range(self, ("save_total_limit",), 1, optional=True)
        check_range(self, ("seed",), 0, 2**32 - 1)  # numpy's seed range
        check_range(self, ("fp16_initial_scale",), 0, FP32_MAX, low_open=True)  # the scale is an fp32
        self._check_hf_fields()

    @property
    def half_precision(self) -> bool:
        """bf16 or fp16: 2-byte working weights and activations, 16-bit tensor-core peak."""
        return self.bf16 or self.fp16

    def _check_hf_fields(self) -> None:
        """The run_translation / Seq2SeqTrainingArguments fields: length, strategies, best model, precision."""
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps={self.max_steps} must be >= 1, or -1 to train num_train_epochs")
        if self.max_steps == -1:
            check_range(self, ("num_train_epochs",), 0, low_open=True)
        check_choice("eval_strategy", self.eval_strategy, STRATEGY_CHOICES)
        check_choice("save_strategy", self.save_strategy, STRATEGY_CHOICES)
        check_range(self, ("early_stopping_patience",), 1, optional=True)
        check_range(self, ("early_stopping_threshold",), 0)
        if self.fp16 and self.bf16:
            raise ConfigError("fp16=True and bf16=True together: choose one precision (or neither for fp32)")
        if self.fp16_full_eval and self.bf16_full_eval:
            raise ConfigError(
                "fp16_full_eval=True and bf16_full_eval=True together: choose one evaluation precision"
            )
        if not self.predict_with_generate:
            raise ConfigError(
                "predict_with_generate=False is not supported: evaluation and do_predict always decode "
                "(eval_bleu, predictions); remove it or set it to true"
            )
        if self.load_best_model_at_end or self.early_stopping_patience or self.metric_for_best_model:
            check_best_model_args(self)


# `resume_from_checkpoint` words that mean the HF Trainer's bool (`trainer.train(resume_from_checkpoint=True)`:
# the last checkpoint in output_dir, an error where there is none), as YAML 1.1 and `string_to_bool` read them.
RESUME_TRUE_WORDS = ("true", "yes", "on")
RESUME_NONE_WORDS = ("false", "no", "off", "")


def resume_spec(value: object) -> str | None:
    """`resume_from_checkpoint` as `trainer.checkpoint.dcp.resolve_resume` takes it: the HF bool form
    (True / "True" / "yes") is "true" (the newest checkpoint in output_dir, which must exist), False /
    "false" is None; a directory or "latest" (the newest, or step 0 where there is none) as given.
    "true" and "latest" stay apart: only "latest" may find nothing.

    Raises:
        ConfigError: a value that is neither text nor a bool.
    """
    if value is None or isinstance(value, bool):
        return "true" if value else None
    if not isinstance(value, str):
        raise ConfigError(
            f"resume_from_checkpoint={value!r} is not valid: a checkpoint directory, 'latest' "
            "(the newest checkpoint in output_dir, if any), true (the newest, which must exist), or false"
        )
    if value.strip().lower() in RESUME_TRUE_WORDS:
        return "true"
    return None if value.strip().lower() in RESUME_NONE_WORDS else value


def check_best_model_args(args: TrainingArguments) -> None:
    """Fill the HF defaults of the best-model fields and check they can work (in place).

    `metric_for_best_model` defaults to eval_loss and gets the `eval_` prefix when left out;
    `greater_is_better` defaults to False for a metric ending in "loss", True otherwise.

    Raises:
        ConfigError: no evaluation during training, or (load_best_model_at_end) a save
            strategy that does not save at evaluation steps.
    """
    metric = args.metric_for_best_model or "eval_loss"
    args.metric_for_best_model = metric if metric.startswith("eval_") else f"eval_{metric}"
    if args.greater_is_better is None:
        args.greater_is_better = not args.metric_for_best_model.endswith("loss")
    if not (args.load_best_model_at_end or args.early_stopping_patience):
        return  # metric_for_best_model alone: best_metric is recorded at the evaluations there are
    asked = "load_best_model_at_end" if args.load_best_model_at_end else "early_stopping_patience"
    if args.eval_strategy == "no" or (args.eval_strategy == "steps" and not args.eval_steps):
        raise ConfigError(
            f"{asked} needs evaluations during training: eval_strategy={args.eval_strategy!r}, "
            f"eval_steps={args.eval_steps}; set eval_strategy: epoch, or steps with eval_steps > 0"
        )
    if not args.load_best_model_at_end:
        return
    if args.save_strategy != args.eval_strategy:
        raise ConfigError(
            f"load_best_model_at_end needs save_strategy == eval_strategy, got save_strategy="
            f"{args.save_strategy!r} and eval_strategy={args.eval_strategy!r}"
        )
    if args.save_strategy == "steps" and (not args.save_steps or args.save_steps % args.eval_steps):
        raise ConfigError(
            f"load_best_model_at_end needs save_steps to be a multiple of eval_steps, got save_steps="
            f"{args.save_steps} and eval_steps={args.eval_steps}"
        )
