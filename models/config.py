"""Model hyper-parameters, named as in `transformers.M2M100Config`.

The dataclass is the single source of truth for the architecture; `models.hf`
converts it to and from a Hugging Face `M2M100Config` so exported directories
load in stock `transformers`.
"""

from __future__ import annotations

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
        return v * d + enc + dec + 2 * ln


ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu", "swish")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, min(n, 64) + 1) if n % k == 0]
