"""Job configuration: typed dataclasses, one per concern, parsed by `HfArgumentParser`.

    python -m trainer.train --config configs/tiny.yaml --max_steps 20 --tensor_parallel_size 2

The file (YAML or JSON) gives defaults, CLI flags override it, unknown keys in
either are an error naming the key; `--field null` unsets a value the file set
(e.g. `--dataset_name null --train_file my.jsonl` over a config with a dataset). Field names follow `Seq2SeqTrainingArguments`
and `run_translation.py` where one exists; model fields follow `M2M100Config`.
Each component receives only its own section.

Here: the model and parallel sections and `JobConfig`; the data and training sections are
`data_args.py` and `training_args.py`, their shared checks `checks.py`, parsing `parse.py`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from models.config import ModelConfig
from trainer.config.checks import (
    PARTITION_CHOICES,
    REMAT_CHOICES,
    SCHEDULE_CHOICES,
    SHARDING_CHOICES,
    check_choice,
    check_range,
)
from trainer.config.data_args import DataArguments
from trainer.config.training_args import TrainingArguments
from trainer.errors import ConfigError


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
    encoder_layerdrop: float | None = field(
        default=None,
        metadata={
            "help": "LayerDrop: each encoder layer skipped with this probability, one draw per step; "
            "default: the pretrained config's (published M2M100 configs: 0.05), else 0."
        },
    )
    decoder_layerdrop: float | None = field(
        default=None,
        metadata={"help": "LayerDrop of the decoder layers (as encoder_layerdrop)."},
    )
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
        for name in LAYERDROP_FIELDS:
            arch[name] = arch[name] or 0.0  # None: no LayerDrop for a new model
        return ModelConfig(vocab_size=vocab_size, **arch, **special_ids)  # type: ignore[arg-type]

    def __post_init__(self) -> None:
        # Sizes, heads vs d_model, activation and dropouts: ModelConfig.validate is their one home.
        check_range(self, ("vocab_size",), 8)  # 4 specials + at least a few pieces and tags
        check_range(self, ("init_std",), 0, low_open=True)
        try:
            self.model_config(self.vocab_size, {})
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclass
class ParallelArguments:
    """The (pp, dp, tp) mesh and the pipeline engine's knobs."""

    _argument_group_name = "parallel: the (pp, dp, tp) mesh and the pipeline engine"  # a section of `--help`

    pipeline_parallel_size: int = field(default=1, metadata={"help": "Pipeline stages (pp axis, outermost)."})
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "Tensor-parallel ranks (tp axis, innermost)."}
    )
    data_parallel_size: int = field(default=-1, metadata={"help": "Data-parallel replicas; -1 = inferred."})
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Expert-parallel ranks (ep, a sub-group of the dp axis): each sparse layer's experts "
            "spread over ep replicas, E / ep per rank; must divide data_parallel_size and num_experts."
        },
    )
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
        check_choice("pipeline_schedule", self.pipeline_schedule, SCHEDULE_CHOICES)
        check_choice("activation_checkpointing", self.activation_checkpointing, REMAT_CHOICES)
        check_choice("data_parallel_sharding", self.data_parallel_sharding, SHARDING_CHOICES)
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
            "expert_parallel_size",
            "num_microbatches",
            "virtual_pipeline_stages",
        )
        check_range(self, names, 1)
        check_range(self, ("dist_timeout_s",), 1)
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


LAYERDROP_FIELDS = ("encoder_layerdrop", "decoder_layerdrop")


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
