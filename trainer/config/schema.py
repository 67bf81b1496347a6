"""Job configuration: typed dataclasses, one per concern, parsed by `HfArgumentParser`.

    python -m trainer.train --config configs/tiny.yaml --max_steps 20 --tensor_parallel_size 2

The file (YAML or JSON) gives defaults, CLI flags override it, unknown keys in
either are an error naming the key; `--field null` unsets a value the file set
(e.g. `--dataset_name null --train_file my.jsonl` over a config with a dataset). Field names follow `Seq2SeqTrainingArguments`
and `run_translation.py` where one exists; model fields follow `M2M100Config`.
Each component receives only its own section.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from models.config import ModelConfig

SCHEDULE_CHOICES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
REMAT_CHOICES = ("none", "full", "stage", "selective")
PARTITION_CHOICES = ("uniform", "parameters", "time", "memory")
SHARDING_CHOICES = ("none", "zero1")
REPORT_CHOICES = ("wandb", "tensorboard")  # report_to: any of these, "all" or "none"
NAN_POLICIES = ("stop", "skip")
SCHEDULER_CHOICES = ("linear", "cosine", "constant", "constant_with_warmup", "inverse_sqrt", "polynomial")
STRATEGY_CHOICES = ("no", "steps", "epoch")  # eval_strategy / save_strategy, as IntervalStrategy

# HF Trainer / run_translation names this trainer does not take, with the field to use instead.
# Consulted when a key (file or flag) is unknown, so the error points at ours.
HF_NAME_HINTS: dict[str, str] = {
    "evaluation_strategy": "eval_strategy (the name HF renamed it to)",
    "per_gpu_train_batch_size": "per_device_train_batch_size",
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "deepspeed": "the parallel fields: data_parallel_size, data_parallel_sharding (zero1), "
    "pipeline_parallel_size, tensor_parallel_size",
    "fsdp": "data_parallel_sharding (zero1) and tensor_parallel_size / pipeline_parallel_size",
    "fsdp_config": "data_parallel_sharding (zero1) and tensor_parallel_size / pipeline_parallel_size",
    "gradient_checkpointing": "activation_checkpointing (none | full | stage | selective)",
    "gradient_checkpointing_kwargs": "activation_checkpointing (none | full | stage | selective)",
    "lr_scheduler_kwargs": "lr_scheduler_type with warmup_steps (no scheduler kwargs)",
    "optim": "nothing: the optimizer is AdamW (adam_beta1, adam_beta2, adam_epsilon, weight_decay)",
    "warmup_ratio": "warmup_steps",
    "torch_compile_backend": "torch_compile (inductor, per layer)",
    "tf32": "nothing: fp32 matmul precision is PyTorch's default; use bf16 for speed",
    "bf16_full_eval": "bf16 (evaluation runs in the training precision)",
    "fp16_full_eval": "bf16",
    "half_precision_backend": "bf16",
    "logging_strategy": "logging_steps (a row every N steps)",
    "save_safetensors": "nothing: checkpoints are sharded DCP; `python -m trainer.export` writes safetensors",
    "local_rank": "nothing: torchrun sets LOCAL_RANK",
    "ddp_timeout": "dist_timeout_s",
    "ddp_backend": "nothing: NCCL on GPUs, gloo on CPUs",
    "dataloader_num_workers": "preprocessing_num_workers (tokenization); batches are built in process",
    "max_predict_samples": "max_eval_samples (it caps test directions too)",
    "generation_config": "generation_num_beams and generation_max_length",
    "num_beams": "generation_num_beams",
    "config_name": "the model fields (d_model, encoder_layers, ...) or model_name_or_path",
    "overwrite_cache": "nothing: the tokenization cache is keyed by data, tokenizer and lengths",
    "pad_to_max_length": "nothing: batches are padded to their longest example (length-bucketed)",
    "ignore_pad_token_for_loss": "nothing: padding never counts in the loss",
    "val_max_target_length": "generation_max_length (decoding) / max_target_length (data)",
}


class ConfigError(ValueError):
    """A configuration value is invalid; the message names it and what is valid."""


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def _check_range(
    section: Any,
    names: tuple[str, ...],
    low: float,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
) -> None:
    """Raise ConfigError unless each named field of `section` lies in the range (None passes if `optional`).

    The message names the field, its value and the valid range, e.g.
    `learning_rate=-1.0 must be >= 0`, `adam_beta2=1.0 must be in [0, 1)`.
    """
    for name in names:
        value = getattr(section, name)
        if value is None and optional:
            continue
        ok = (
            value is not None
            and math.isfinite(value)
            and (value > low if low_open else value >= low)
            and (value < high if high_open else value <= high)
        )
        if not ok:
            if math.isinf(high):
                valid = f"{'>' if low_open else '>='} {low:g}"
            else:
                valid = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            raise ConfigError(f"{name}={value!r} must be {valid}{' or null' if optional else ''}")


def _resolve_report_to(value: Any) -> list[str]:
    """`report_to` as the HF Trainer takes it (a name, a list, "all", "none") -> backend names."""
    names = [value] if isinstance(value, str) else list(value or [])
    names = [n for v in names for n in str(v).replace(",", " ").split()]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        import importlib.util

        return [n for n in REPORT_CHOICES if importlib.util.find_spec(n) is not None]
    for name in names:
        if name not in REPORT_CHOICES:
            raise ConfigError(
                f"report_to={value!r}: {name!r} is not valid; choose from {list(REPORT_CHOICES)}, "
                f"'all' or 'none'"
            )
    return list(dict.fromkeys(names))


@dataclass
class ModelArguments:
    """Architecture (M2M100Config names) or an existing checkpoint to start from."""

    _argument_group_name = (
        "model: architecture (M2M100Config names) or a checkpoint to fine-tune"  # a section of `--help`
    )

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Hugging Face M2M100/NLLB directory to load and fine-tune."}
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={"help": "Existing tokenizer directory; default: train SentencePiece on the data."},
    )
    vocab_size: int = field(
        default=8000, metadata={"help": "SentencePiece vocabulary size to train (incl. tags)."}
    )
    d_model: int = field(default=256, metadata={"help": "Hidden size."})
    encoder_layers: int = field(default=3, metadata={"help": "Encoder layers."})
    decoder_layers: int = field(default=3, metadata={"help": "Decoder layers."})
    encoder_attention_heads: int = field(default=4, metadata={"help": "Encoder attention heads."})
    decoder_attention_heads: int = field(default=4, metadata={"help": "Decoder attention heads."})
    encoder_ffn_dim: int = field(default=1024, metadata={"help": "Encoder FFN width."})
    decoder_ffn_dim: int = field(default=1024, metadata={"help": "Decoder FFN width."})
    activation_function: str = field(default="relu", metadata={"help": "relu, gelu, gelu_new, silu."})
    dropout: float = field(default=0.1, metadata={"help": "Residual/embedding dropout."})
    attention_dropout: float = field(default=0.1, metadata={"help": "Attention-probability dropout."})
    activation_dropout: float = field(default=0.0, metadata={"help": "Dropout after the FFN activation."})
    max_position_embeddings: int = field(default=1024, metadata={"help": "Longest sequence."})
    scale_embedding: bool = field(default=True, metadata={"help": "Multiply embeddings by sqrt(d_model)."})
    init_std: float = field(default=0.02, metadata={"help": "Std of the normal init."})

    def model_config(self, vocab_size: int, special_ids: dict[str, int]) -> ModelConfig:
        """The ModelConfig for a tokenizer with `vocab_size` entries and these special ids."""
        arch = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("model_name_or_path", "tokenizer_name", "vocab_size")
        }
        return ModelConfig(vocab_size=vocab_size, **arch, **special_ids)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        # Sizes, heads vs d_model, activation and dropouts: ModelConfig.validate is their one home.
        _check_range(self, ("vocab_size",), 8)  # 4 specials + at least a few pieces and tags
        _check_range(self, ("init_std",), 0, low_open=True)
        try:
            self.model_config(self.vocab_size, {})
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class DataArguments:
    """Where the parallel text comes from and how it is cut into batches."""

    _argument_group_name = "data: corpora, directions, lengths, tokenizer training"  # a section of `--help`

    dataset_name: str | None = field(
        default=None, metadata={"help": "'builtin' for the embedded corpus, or any `datasets` name."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "`datasets` config name."})
    train_file: str | None = field(
        default=None,
        metadata={
            "help": "JSON lines / JSON / Parquet in HF translation format, or a text path with "
            "'{lang}' (e.g. data/train.{lang}.gz) for line-aligned files per language."
        },
    )
    validation_file: str | None = field(default=None, metadata={"help": "Same formats as train_file."})
    source_lang: str | None = field(default=None, metadata={"help": "Source language code (one direction)."})
    target_lang: str | None = field(default=None, metadata={"help": "Target language code (one direction)."})
    language_pairs: list[str] = field(
        default_factory=list, metadata={"help": "Directions for multilingual runs, e.g. en-de de-en en-fr."}
    )
    builtin_size: int = field(default=4000, metadata={"help": "Builtin corpus: source items per language."})
    max_source_length: int = field(default=128, metadata={"help": "Longer sources are skipped and counted."})
    max_target_length: int = field(default=128, metadata={"help": "Longer targets are skipped and counted."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: int | None = field(
        default=256, metadata={"help": "Truncate each evaluation direction."}
    )
    max_tokens_per_microbatch: int | None = field(
        default=None, metadata={"help": "Cap a micro-batch by padded tokens instead of sentence count."}
    )
    spm_model_type: str = field(
        default="bpe",
        metadata={
            "help": "SentencePiece model type: bpe (as M2M100 and NLLB) or unigram. Runs on stock M2M100 "
            "codes export an M2M100Tokenizer either way; others an NllbTokenizer honouring "
            "src_lang/tgt_lang/text_target (bpe) or a plain fast tokenizer (unigram)."
        },
    )
    spm_character_coverage: float = field(default=1.0, metadata={"help": "SentencePiece character coverage."})
    spm_input_sentence_size: int = field(default=200000, metadata={"help": "Sentences sampled to train SPM."})
    test_file: str | None = field(
        default=None,
        metadata={
            "help": "do_predict: test data, same formats as train_file (default: dataset_name's test split)."
        },
    )
    forced_bos_token: str | None = field(
        default=None,
        metadata={
            "help": "run_translation's name for the decoder's forced first token: a language code (de or "
            "__de__); it must be the target of every direction (each direction's decoder is always forced "
            "to its own target tag), so it only confirms the target."
        },
    )
    source_prefix: str | None = field(
        default=None,
        metadata={"help": "T5's task prefix (run_translation); M2M100/NLLB use tags: empty only."},
    )
    preprocessing_num_workers: int | None = field(
        default=None,
        metadata={"help": "Processes that tokenize the corpus (datasets num_proc; same result as one)."},
    )
    sampling_temperature: float = field(
        default=1.0,
        metadata={
            "help": "Direction d is drawn with probability p_d ~ w_d^(1/T), w_d its pair count (or its "
            "sampling_weights entry): 1 = proportional to the data, 5 = M2M100 / NLLB, large = uniform."
        },
    )
    sampling_weights: list[str] = field(
        default_factory=list,
        metadata={
            "help": "Weights replacing the pair counts w_d of every direction, e.g. 'en-de:2 de-en:1'; "
            "sampling_temperature still applies (T=1 keeps the weights' ratio as given)."
        },
    )
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "Where tokenized data is cached as memory-mapped Arrow files, keyed by a fingerprint "
            "of data, tokenizer and lengths (default: <output_dir>/data_cache)."
        },
    )
    max_bad_record_fraction: float = field(
        default=0.01,
        metadata={
            "help": "Unreadable lines (malformed JSON, not UTF-8) in a data file are skipped and counted; "
            "above this share of the file's lines the run fails naming the first ones."
        },
    )

    def __post_init__(self) -> None:
        _check_choice("spm_model_type", self.spm_model_type, ("unigram", "bpe"))
        _check_range(self, ("builtin_size", "max_source_length", "max_target_length"), 1)
        _check_range(self, ("spm_input_sentence_size",), 1)
        _check_range(self, ("max_train_samples", "max_eval_samples", "max_tokens_per_microbatch"), 1,
                     optional=True)  # fmt: skip
        _check_range(self, ("spm_character_coverage",), 0, 1, low_open=True)
        _check_range(self, ("max_bad_record_fraction",), 0, 1)
        if self.language_pairs is None:  # `--language_pairs null`
            self.language_pairs = []
        if isinstance(self.language_pairs, str):
            self.language_pairs = [p for p in self.language_pairs.replace(",", " ").split() if p]
        for pair in self.language_pairs:
            if pair.count("-") != 1 or not all(pair.split("-")):
                raise ConfigError(f"language_pairs entry {pair!r} is not of the form src-tgt (e.g. en-de)")
        _check_range(self, ("preprocessing_num_workers",), 1, optional=True)
        if self.source_prefix:
            raise ConfigError(
                f"source_prefix={self.source_prefix!r}: a T5 task prefix; M2M100/NLLB mark the direction "
                f"with language tags (source_lang/target_lang or language_pairs), so leave it empty"
            )
        self._check_sources()
        self._check_forced_bos()
        _check_range(self, ("sampling_temperature",), 0, low_open=True)
        self.sampling_weights = self._check_weights()

    def _check_forced_bos(self) -> None:
        """`forced_bos_token` must name the target language of every direction (tag or code)."""
        if not self.forced_bos_token or not (self.language_pairs or (self.source_lang and self.target_lang)):
            return
        code = self.forced_bos_token.strip("_")
        targets = sorted({t for _, t in self.directions()})
        if targets != [code]:
            raise ConfigError(
                f"forced_bos_token={self.forced_bos_token!r} conflicts with the run's target language(s) "
                f"{targets}: each direction's decoder is forced to its own target tag; remove it or set "
                f"it to the one target"
            )

    def _check_weights(self) -> list[str]:
        """`sampling_weights` as `src-tgt:w` entries, one per direction of the run, each w > 0."""
        given = self.sampling_weights or []
        given = [given] if isinstance(given, str) else given
        entries = [e for item in given for e in str(item).replace(",", " ").split()]  # 'en-de:2 de-en:1' too
        if not entries:
            return []
        weights = self.direction_weights(entries)
        names = ["-".join(d) for d in self.directions()]
        if sorted(weights) != sorted(names):
            raise ConfigError(
                f"sampling_weights name {sorted(weights)} but the run's directions are {names}; "
                "give one weight per direction"
            )
        return list(entries)

    @staticmethod
    def direction_weights(entries: list[str]) -> dict[str, float]:
        """`['en-de:2', 'de-en:1'] -> {'en-de': 2.0, 'de-en': 1.0}`.

        Raises:
            ConfigError: an entry not of the form `src-tgt:w` with a finite w > 0, or a repeated direction.
        """
        out: dict[str, float] = {}
        for entry in entries:
            name, _, text = entry.rpartition(":")
            try:
                w = float(text)
            except ValueError:
                w = math.nan
            if name.count("-") != 1 or not all(name.split("-")) or not (math.isfinite(w) and w > 0):
                raise ConfigError(
                    f"sampling_weights entry {entry!r} is not of the form src-tgt:w with w > 0 (e.g. en-de:2)"
                )
            if name in out:
                raise ConfigError(f"sampling_weights names {name!r} twice")
            out[name] = w
        return out

    def _check_sources(self) -> None:
        """One data source and one way of naming the directions, or an error naming both."""
        if self.dataset_name and (self.train_file or self.validation_file):
            given = "train_file" if self.train_file else "validation_file"
            raise ConfigError(
                f"dataset_name={self.dataset_name!r} and {given}={getattr(self, given)!r} are both set; "
                f"use one (on the command line `--dataset_name null` unsets a config file's dataset)"
            )
        one = [f"{self.source_lang}-{self.target_lang}"]
        if self.language_pairs and (self.source_lang or self.target_lang) and self.language_pairs != one:
            raise ConfigError(
                f"source_lang={self.source_lang!r} / target_lang={self.target_lang!r} conflict with "
                f"language_pairs={self.language_pairs}; set one of them (`--language_pairs null` or "
                f"`--source_lang null --target_lang null` unsets a config file's value)"
            )

    def directions(self) -> list[tuple[str, str]]:
        """The translation directions of the run."""
        if self.language_pairs:
            return [tuple(p.split("-")) for p in self.language_pairs]  # type: ignore[misc]
        if self.source_lang and self.target_lang:
            return [(self.source_lang, self.target_lang)]
        raise ConfigError("no direction given: set source_lang and target_lang, or language_pairs")


@dataclass
class ParallelArguments:
    """The (pp, dp, tp) mesh and the pipeline engine's knobs."""

    _argument_group_name = "parallel: the (pp, dp, tp) mesh and the pipeline engine"  # a section of `--help`

    pipeline_parallel_size: int = field(default=1, metadata={"help": "Pipeline stages (pp axis, outermost)."})
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "Tensor-parallel ranks (tp axis, innermost)."}
    )
    data_parallel_size: int = field(default=-1, metadata={"help": "Data-parallel replicas; -1 = inferred."})
    num_microbatches: int = field(default=1, metadata={"help": "Micro-batches per pipeline flush."})
    pipeline_schedule: str = field(default="1f1b", metadata={"help": f"One of {list(SCHEDULE_CHOICES)}."})
    virtual_pipeline_stages: int = field(
        default=2, metadata={"help": "Stages per rank for interleaved_1f1b."}
    )
    activation_checkpointing: str = field(default="none", metadata={"help": f"One of {list(REMAT_CHOICES)}."})
    partition_method: str = field(
        default="uniform",
        metadata={"help": f"One of {list(PARTITION_CHOICES)} or block counts per stage, e.g. '5,4,4,5'."},
    )
    sequence_parallel: bool = field(
        default=False, metadata={"help": "Split norms/dropout along the sequence."}
    )
    profile_activation_memory: bool = field(
        default=False,
        metadata={
            "help": "Count activation memory with saved-tensor hooks on CUDA too (host work on every "
            "logged micro-batch); by default CUDA reads the caching allocator and CPUs use the hooks."
        },
    )
    data_parallel_sharding: str = field(
        default="none", metadata={"help": f"One of {list(SHARDING_CHOICES)}."}
    )
    allow_tp_across_nodes: bool = field(default=False, metadata={"help": "Permit tp > LOCAL_WORLD_SIZE."})
    dist_timeout_s: int = field(default=600, metadata={"help": "Collective timeout in seconds."})
    hang_warning_s: float = field(
        default=0.0,
        metadata={
            "help": "Warn (naming the rank and what it waits for) when one communication wait lasts "
            "this many seconds; 0 = min(60, dist_timeout_s / 2), negative = no warning."
        },
    )

    def __post_init__(self) -> None:
        _check_choice("pipeline_schedule", self.pipeline_schedule, SCHEDULE_CHOICES)
        _check_choice("activation_checkpointing", self.activation_checkpointing, REMAT_CHOICES)
        _check_choice("data_parallel_sharding", self.data_parallel_sharding, SHARDING_CHOICES)
        if self.partition_method not in PARTITION_CHOICES:
            try:
                self.partition_balance()
            except ValueError:
                raise ConfigError(
                    f"partition_method={self.partition_method!r} is not valid; choose one of "
                    f"{list(PARTITION_CHOICES)} or a comma list of block counts like '5,4,4,5'"
                ) from None
        names = (
            "pipeline_parallel_size",
            "tensor_parallel_size",
            "num_microbatches",
            "virtual_pipeline_stages",
        )
        _check_range(self, names, 1)
        _check_range(self, ("dist_timeout_s",), 1)
        if not math.isfinite(self.hang_warning_s):  # any finite value: negative = no warning
            raise ConfigError(
                f"hang_warning_s={self.hang_warning_s!r} must be a finite number (negative: no warning)"
            )
        if self.data_parallel_size == 0 or self.data_parallel_size < -1:
            raise ConfigError(f"data_parallel_size={self.data_parallel_size} must be >= 1 or -1 (inferred)")

    def partition_balance(self) -> list[int] | None:
        """Explicit block counts per stage, or None for a named method."""
        if self.partition_method in PARTITION_CHOICES:
            return None
        return [int(x) for x in str(self.partition_method).replace(" ", "").strip("[]").split(",") if x]

    @property
    def virtual_stages(self) -> int:
        """Stages per pp rank: virtual_pipeline_stages for interleaved_1f1b, 2 for zbv (its V), else 1."""
        if self.pipeline_schedule == "interleaved_1f1b":
            return self.virtual_pipeline_stages
        return 2 if self.pipeline_schedule == "zbv" else 1


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
            "first removes the earlier run's checkpoints, metrics, summary, tokenizer, configs and logs."
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
            "predict_results.json (predict_bleu, predict_chrf per direction) in output_dir."
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
            "help": "An evaluation key (eval_loss, eval_bleu, eval_chrf, eval_bleu_en-de, ...; the eval_ "
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
        default=None, metadata={"help": "A checkpoint directory, or 'latest' for the newest in output_dir."}
    )
    seed: int = field(default=42, metadata={"help": "Seed for init, data order and dropout."})
    bf16: bool = field(
        default=False,
        metadata={"help": "bf16 working weights (cast once per step) over fp32 masters, bf16 autocast."},
    )
    fp16: bool = field(
        default=False, metadata={"help": "Not supported (no loss scaling in the pipeline); use bf16."}
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

    def __post_init__(self) -> None:
        self.report_to = _resolve_report_to(self.report_to)
        _check_choice("lr_scheduler_type", self.lr_scheduler_type, SCHEDULER_CHOICES)
        _check_choice("nan_policy", self.nan_policy, NAN_POLICIES)
        positive = ("per_device_train_batch_size", "per_device_eval_batch_size",
                    "gradient_accumulation_steps", "logging_steps", "generation_num_beams",
                    "generation_max_length", "nan_max_consecutive_skips")  # fmt: skip
        _check_range(self, positive, 1)
        _check_range(self, ("warmup_steps", "eval_steps", "save_steps"), 0)  # 0: none / only at the end
        _check_range(self, ("learning_rate", "weight_decay", "mfu_peak_tflops"), 0)
        _check_range(self, ("max_grad_norm",), 0)  # 0 disables clipping
        _check_range(self, ("adam_beta1", "adam_beta2", "label_smoothing_factor"), 0, 1, high_open=True)
        _check_range(self, ("adam_epsilon",), 0, low_open=True)
        _check_range(self, ("save_total_limit",), 1, optional=True)
        _check_range(self, ("seed",), 0, 2**32 - 1)  # numpy's seed range
        self._check_hf_fields()

    def _check_hf_fields(self) -> None:
        """The run_translation / Seq2SeqTrainingArguments fields: length, strategies, best model, fp16."""
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(f"max_steps={self.max_steps} must be >= 1, or -1 to train num_train_epochs")
        if self.max_steps == -1:
            _check_range(self, ("num_train_epochs",), 0, low_open=True)
        _check_choice("eval_strategy", self.eval_strategy, STRATEGY_CHOICES)
        _check_choice("save_strategy", self.save_strategy, STRATEGY_CHOICES)
        _check_range(self, ("early_stopping_patience",), 1, optional=True)
        _check_range(self, ("early_stopping_threshold",), 0)
        if self.fp16:
            raise ConfigError(
                "fp16=True is not supported (the pipeline has no loss scaling); use bf16: true "
                "(bf16 working weights over fp32 masters, on GPUs with bf16 and on CPUs)"
            )
        if not self.predict_with_generate:
            raise ConfigError(
                "predict_with_generate=False is not supported: evaluation and do_predict always decode "
                "(eval_bleu, predictions); remove it or set it to true"
            )
        if self.load_best_model_at_end or self.early_stopping_patience or self.metric_for_best_model:
            from trainer.strategies import check_best_model_args

            check_best_model_args(self)


@dataclass
class JobConfig:
    model: ModelArguments
    data: DataArguments
    parallel: ParallelArguments
    training: TrainingArguments

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for section in (self.model, self.data, self.parallel, self.training):
            out.update(asdict(section))
        return out

    def save(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


SECTIONS = (ModelArguments, DataArguments, ParallelArguments, TrainingArguments)


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
