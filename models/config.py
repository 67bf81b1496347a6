"""Model hyper-parameters, named as in `transformers.M2M100Config` and `NllbMoeConfig`.

The dataclass is the single source of truth for the architecture; `models.hf`
converts it to and from a Hugging Face `M2M100Config` (`num_experts` 0: a dense model)
or `NllbMoeConfig` (`num_experts` > 0) so exported directories load in stock `transformers`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from models.errors import ModelConfigError


@dataclass
class ModelConfig:
    """M2M100/NLLB encoder-decoder hyper-parameters (pre-layer-norm Transformer)."""

    vocab_size: int = 8000
    d_model: int = 256
    encoder_layers: int = 3
    decoder_layers: int = 3
    encoder_attention_heads: int = 4
    decoder_attention_heads: int = 4
    encoder_ffn_dim: int = 1024
    decoder_ffn_dim: int = 1024
    activation_function: str = "relu"
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation_dropout: float = 0.0
    encoder_layerdrop: float = 0.0  # LayerDrop (Fan et al. 2019): a layer skipped per step with p
    decoder_layerdrop: float = 0.0
    max_position_embeddings: int = 1024
    scale_embedding: bool = True
    init_std: float = 0.02
    pad_token_id: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 2
    unk_token_id: int = 3
    decoder_start_token_id: int = 2
    # NLLB-MoE (`transformers.NllbMoeConfig`, read as it is); num_experts 0: a dense M2M100 model.
    num_experts: int = 0
    encoder_sparse_step: int = 4  # layer i is sparse iff step > 0 and (i + 1) % step == 0
    decoder_sparse_step: int = 4
    expert_capacity: int = 64  # kept for export; our training capacity is models.moe's formula
    router_bias: bool = False
    router_dtype: str = "float32"
    router_ignore_padding_tokens: bool = False  # transformers' meaning: False keeps padding out of routing
    second_expert_policy: str = "all"
    normalize_router_prob_before_dropping: bool = False
    batch_prioritized_routing: bool = False
    moe_eval_capacity_token_fraction: float = 1.0
    moe_token_dropout: float = 0.2
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.001  # read and written back; unused (as in transformers' NllbMoe)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ModelConfigError naming the bad value and what would be valid."""
        for name in (
            "vocab_size",
            "d_model",
            "encoder_layers",
            "decoder_layers",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "max_position_embeddings",
        ):
            if int(getattr(self, name)) <= 0:
                raise ModelConfigError(f"{name}={getattr(self, name)} must be a positive integer")
        for heads_name in ("encoder_attention_heads", "decoder_attention_heads"):
            heads = getattr(self, heads_name)
            if self.d_model % heads != 0:
                raise ModelConfigError(
                    f"d_model={self.d_model} is not divisible by {heads_name}={heads}; "
                    f"valid head counts divide d_model (e.g. {_divisors(self.d_model)})"
                )
        if self.activation_function not in ACTIVATIONS:
            raise ModelConfigError(
                f"activation_function={self.activation_function!r} is unknown; valid: {sorted(ACTIVATIONS)}"
            )
        for name in (
            "dropout",
            "attention_dropout",
            "activation_dropout",
            "encoder_layerdrop",
            "decoder_layerdrop",
        ):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ModelConfigError(f"{name}={p} must be in [0, 1)")
        for name in (
            "pad_token_id",
            "bos_token_id",
            "eos_token_id",
            "unk_token_id",
            "decoder_start_token_id",
        ):
            tid = getattr(self, name)
            if not 0 <= tid < self.vocab_size:
                raise ModelConfigError(f"{name}={tid} is outside the vocabulary [0, {self.vocab_size})")
        self._validate_moe()

    def _validate_moe(self) -> None:
        if self.num_experts < 0 or self.num_experts == 1:
            raise ModelConfigError(
                f"num_experts={self.num_experts} must be 0 (dense) or >= 2 (top-2 routing)"
            )
        for name in ("encoder_sparse_step", "decoder_sparse_step"):
            if getattr(self, name) < 0:
                raise ModelConfigError(f"{name}={getattr(self, name)} must be >= 0 (0: no sparse layer)")
        if self.second_expert_policy not in SECOND_EXPERT_POLICIES:
            raise ModelConfigError(
                f"second_expert_policy={self.second_expert_policy!r} is unknown; valid: {list(SECOND_EXPERT_POLICIES)}"
            )
        if self.router_dtype not in ROUTER_DTYPES:
            raise ModelConfigError(
                f"router_dtype={self.router_dtype!r} is unknown; valid: {list(ROUTER_DTYPES)}"
            )
        if not 0.0 <= self.moe_token_dropout < 1.0:  # NaN fails too
            raise ModelConfigError(f"moe_token_dropout={self.moe_token_dropout} must be in [0, 1)")
        frac = self.moe_eval_capacity_token_fraction
        if not (frac <= 1.0 and math.isfinite(frac)):
            raise ModelConfigError(
                f"moe_eval_capacity_token_fraction={frac} must be <= 1 (<= 0: the training capacity)"
            )
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ModelConfigError(f"{name}={getattr(self, name)} must be a finite number >= 0")

    @property
    def is_moe(self) -> bool:
        """An NLLB-MoE model (`num_experts` > 0; its layers may still all be dense)."""
        return self.num_experts > 0

    def is_sparse(self, decoder: bool, index: int) -> bool:
        """Whether layer `index` of the encoder (or decoder) is sparse, where transformers puts it."""
        step = self.decoder_sparse_step if decoder else self.encoder_sparse_step
        return self.num_experts > 0 and step > 0 and (index + 1) % step == 0

    def sparse_layers(self) -> list[str]:
        """Block names of the sparse layers, encoder first (`encoder.layers.3`, ...)."""
        enc = [f"encoder.layers.{i}" for i in range(self.encoder_layers) if self.is_sparse(False, i)]
        dec = [f"decoder.layers.{i}" for i in range(self.decoder_layers) if self.is_sparse(True, i)]
        return enc + dec

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def num_parameters(self) -> int:
        """Parameter count (tied embedding counted once)."""
        d, v = self.d_model, self.vocab_size
        attn = 4 * (d * d + d)
        ln = 2 * d
        enc = self.encoder_layers * (
            attn + 2 * ln + d * self.encoder_ffn_dim + self.encoder_ffn_dim + self.encoder_ffn_dim * d + d
        )
        dec = self.decoder_layers * (
            2 * attn + 3 * ln + d * self.decoder_ffn_dim + self.decoder_ffn_dim + self.decoder_ffn_dim * d + d
        )
        for name in self.sparse_layers():  # E experts and a router instead of one FFN
            f = self.decoder_ffn_dim if name.startswith("decoder") else self.encoder_ffn_dim
            ffn = 2 * d * f + f + d
            router = d * self.num_experts + (self.num_experts if self.router_bias else 0)
            if name.startswith("decoder"):
                dec += (self.num_experts - 1) * ffn + router
            else:
                enc += (self.num_experts - 1) * ffn + router
        return v * d + enc + dec + 2 * ln


SECOND_EXPERT_POLICIES = ("all", "sampling", "random")
ROUTER_DTYPES = ("float32", "float16", "bfloat16")
ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu", "swish")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, min(n, 64) + 1) if n % k == 0]
