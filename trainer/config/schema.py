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
from models.errors import ModelConfigError
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
        metadata={
            "help": "Existing tokenizer directory; default: model_name_or_path's, else the teacher's, "
            "else SentencePiece trained on the data."
        },
    )
    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Word-level distillation from this teacher: an M2M100/NLLB(-MoE) HF directory or hub "
            "name, or a checkpoint of this trainer (OUTPUT_DIR/checkpoint-<step>); it shares the "
            "student's vocabulary and tags (distillation_alpha, distillation_temperature)."
        },
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
    # NLLB-MoE architecture of a new model (NllbMoeConfig names); a checkpoint's are read as they are.
    num_experts: int = field(
        default=0, metadata={"help": "Experts per sparse FFN (NLLB-MoE); 0: a dense M2M100 model."}
    )
    encoder_sparse_step: int = field(
        default=4, metadata={"help": "Encoder layer i is sparse iff (i + 1) % step == 0 (0: none)."}
    )
    decoder_sparse_step: int = field(default=4, metadata={"help": "As encoder_sparse_step, decoder."})
    router_bias: bool = field(default=False, metadata={"help": "A bias in the router's classifier."})
    # NLLB-MoE routing (NllbMoeConfig names): how tokens reach experts, not weights, so a run sets them
    # over a checkpoint's too; None: the checkpoint's, else NllbMoeConfig's default (given after it).
    second_expert_policy: str | None = field(
        default=None,
        metadata={
            "help": "Second expert: all | sampling (Gumbel) | random (kept w.p. 2 g2); default: the "
            "checkpoint's, else all."
        },
    )
    normalize_router_prob_before_dropping: bool | None = field(
        default=None,
        metadata={
            "help": "Renormalise the two gates before capacity drops (else after); default: the "
            "checkpoint's, else false."
        },
    )
    batch_prioritized_routing: bool | None = field(
        default=None,
        metadata={
            "help": "Capacity goes to the tokens with the highest router probability; default: the "
            "checkpoint's, else false."
        },
    )
    moe_eval_capacity_token_fraction: float | None = field(
        default=None,
        metadata={
            "help": "Evaluation capacity = fraction x tokens (1.0: nothing dropped; <= 0: the training "
            "capacity); default: the checkpoint's, else 1.0."
        },
    )
    # NLLB-MoE: the run's choices (also over a checkpoint's values).
    moe_token_dropout: float | None = field(
        default=None,
        metadata={
            "help": "Expert output masking (fairseq's EOM): each (token, expert) output dropped with "
            "this probability; default: the checkpoint's, else 0.2 (NllbMoeConfig's)."
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of the load-balancing loss (0.01 in the NLLB recipe, 0 for fine-tuning); "
            "default: the checkpoint's, else 0.001 (NllbMoeConfig's)."
        },
    )
    moe_dropless: bool = field(
        default=False, metadata={"help": "NLLB-MoE: route without capacity (no token ever dropped)."}
    )
    moe_capacity_factor: float = field(
        default=1.0, metadata={"help": "NLLB-MoE training capacity C = f x 2 x ceil(tokens / experts)."}
    )

    def model_config(self, vocab_size: int, special_ids: dict[str, int]) -> ModelConfig:
        """The ModelConfig for a tokenizer with `vocab_size` entries and these special ids."""
        arch = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in (*SOURCE_FIELDS, "vocab_size", *MOE_RUN_FIELDS)
        }
        for name in LAYERDROP_FIELDS:
            arch[name] = arch[name] or 0.0  # None: no LayerDrop for a new model
        for name in MOE_SESSION_FIELDS:
            if arch[name] is None:  # None: NllbMoeConfig's default for a new model
                del arch[name]
        return ModelConfig(vocab_size=vocab_size, **arch, **special_ids)  # type: ignore[arg-type]

    def apply_session(self, mc: ModelConfig) -> ModelConfig:
        """`mc` (a checkpoint's architecture) with this run's regularisation and MoE choices (dropouts;
        LayerDrop, EOM, the aux loss weight and the routing options where the run sets them)."""
        for k in SESSION_DROPOUTS:
            setattr(mc, k, getattr(self, k))
        for k in (*LAYERDROP_FIELDS, *MOE_SESSION_FIELDS):  # the checkpoint's unless the run sets it
            if getattr(self, k) is not None:
                setattr(mc, k, getattr(self, k))
        mc.validate()
        return mc

    def check_moe(self, arch: ModelConfig) -> None:
        """The NLLB-MoE run fields fit `arch` (the model this run trains).

        Raises:
            ConfigError: an MoE field set for a dense model, naming the field; num_experts with no
                sparse layer (every FFN dense: the experts would do nothing).
        """
        if arch.is_moe and not arch.sparse_layers():
            raise ConfigError(
                f"num_experts={arch.num_experts} does nothing: encoder_sparse_step={arch.encoder_sparse_step} "
                f"and decoder_sparse_step={arch.decoder_sparse_step} make none of the {arch.encoder_layers} "
                f"encoder and {arch.decoder_layers} decoder layers sparse; set a step between 1 and the "
                "layer count, or num_experts: 0 for a dense model"
            )
        if arch.is_moe:
            return
        defaults = {f.name: f.default for f in fields(self)}
        for name in (*MOE_ARCH_FIELDS, *MOE_SESSION_FIELDS, *MOE_RUN_FIELDS):
            value, default = getattr(self, name), defaults[name]
            if value != default:
                raise ConfigError(
                    f"{name}={value} applies to NLLB-MoE models only, but this model is dense "
                    f"(num_experts=0); drop it, or set num_experts > 0 for a new MoE model"
                )

    def __post_init__(self) -> None:
        # Sizes, heads vs d_model, activation and dropouts: ModelConfig.validate is their one home.
        check_range(self, ("vocab_size",), 8)  # 4 specials + at least a few pieces and tags
        check_range(self, ("init_std",), 0, low_open=True)
        if not (self.moe_capacity_factor > 0 and math.isfinite(self.moe_capacity_factor)):
            raise ConfigError(
                f"moe_capacity_factor={self.moe_capacity_factor} must be > 0 "
                "(capacity = factor x 2 x ceil(tokens / experts)); moe_dropless: true drops nothing"
            )
        try:
            self.model_config(self.vocab_size, {})
        except ModelConfigError as e:
            raise ConfigError(str(e)) from None


DEFAULT_VIRTUAL_STAGES = 2  # interleaved_1f1b's stages per rank when virtual_pipeline_stages is unset


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
    virtual_pipeline_stages: int | None = field(
        default=None,
        metadata={
            "help": f"Stages per rank for interleaved_1f1b (unset: {DEFAULT_VIRTUAL_STAGES}); refused with "
            "any other schedule, where it would do nothing (zbv always places 2 stages per rank)."
        },
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
        )
        check_range(self, names, 1)
        check_range(self, ("virtual_pipeline_stages",), 1, optional=True)
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
        """Stages per pp rank: virtual_pipeline_stages for interleaved_1f1b (unset: DEFAULT_VIRTUAL_STAGES),
        2 for zbv (its V), else 1."""
        if self.pipeline_schedule == "interleaved_1f1b":
            return self.virtual_pipeline_stages or DEFAULT_VIRTUAL_STAGES
        return 2 if self.pipeline_schedule == "zbv" else 1


LAYERDROP_FIELDS = ("encoder_layerdrop", "decoder_layerdrop")
SOURCE_FIELDS = ("model_name_or_path", "tokenizer_name", "teacher_model_name_or_path")  # where from, not what
SESSION_DROPOUTS = ("dropout", "attention_dropout", "activation_dropout")
# NLLB-MoE architecture fields of a new model (besides num_experts, which decides it): the weights'.
MOE_ARCH_FIELDS = ("encoder_sparse_step", "decoder_sparse_step", "router_bias")
# NLLB-MoE model fields a run may set over a checkpoint's (None: the checkpoint's): EOM, the aux loss
# weight and the routing options, which the sparse layers read when built (`models.moe.layer`).
MOE_SESSION_FIELDS = (
    "moe_token_dropout",
    "router_aux_loss_coef",
    "second_expert_policy",
    "normalize_router_prob_before_dropping",
    "batch_prioritized_routing",
    "moe_eval_capacity_token_fraction",
)
# NLLB-MoE options of the run alone (not in the model config), with their defaults.
MOE_RUN_DEFAULTS: dict[str, object] = {"moe_dropless": False, "moe_capacity_factor": 1.0}
MOE_RUN_FIELDS = tuple(MOE_RUN_DEFAULTS)


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
