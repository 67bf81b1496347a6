"""Import from and export to Hugging Face `M2M100ForConditionalGeneration` directories.

Our parameter names are HF's without the leading `model.`, except the fused
attention projections: HF's `self_attn.{q,k,v}_proj` are our `self_attn.qkv_proj`
and `encoder_attn.{k,v}_proj` our `encoder_attn.kv_proj`, rows grouped by head
(`fuse_heads` / `split_heads`; see `models.m2m100.Attention`). The tied copies HF
keeps (`model.encoder.embed_tokens`, `model.decoder.embed_tokens`, `lm_head`) map
to our one `shared.weight`. Reading goes through `safetensors.safe_open`, key by
key, so a pipeline stage can load only the tensors it holds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.config import ModelConfig

HF_PREFIX = "model."
# HF keys that are tied copies of `model.shared.weight` (or positions, which are computed).
_HF_ALIASES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")
_CONFIG_KEYS = (
    "vocab_size",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "activation_function",
    "dropout",
    "attention_dropout",
    "activation_dropout",
    "max_position_embeddings",
    "scale_embedding",
    "init_std",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
)


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model (missing/unexpected keys or shapes)."""


def to_hf_config(config: ModelConfig) -> Any:
    """A `transformers.M2M100Config` equal to `config`."""
    from transformers import M2M100Config

    kw = {k: getattr(config, k) for k in _CONFIG_KEYS}
    return M2M100Config(
        **kw,
        tie_word_embeddings=True,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        use_cache=True,
        is_encoder_decoder=True,
    )


def from_hf_config(hf_config: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig from an HF `config.json` dict.

    Raises:
        CheckpointMismatchError: the directory is not an M2M100/NLLB model.
    """
    model_type = hf_config.get("model_type")
    if model_type not in ("m2m_100", "nllb"):
        raise CheckpointMismatchError(
            f"model_type={model_type!r} is not supported; expected 'm2m_100' (M2M100/NLLB checkpoints)"
        )
    kw = {k: hf_config[k] for k in _CONFIG_KEYS if k in hf_config and hf_config[k] is not None}
    return ModelConfig(**kw)


# Our fused attention projections and the HF tensors they hold, in row-group order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "kv_proj": ("k_proj", "v_proj")}


def hf_key(name: str) -> str:
    """Our (unfused) parameter name -> HF's (`shared.weight` -> `model.shared.weight`)."""
    return HF_PREFIX + name


def hf_names(name: str) -> list[str]:
    """The HF keys one of our tensors is made of: one, or q/k/v for a fused projection."""
    *parent, proj, leaf = name.split(".")
    if proj in FUSED:
        return [hf_key(".".join([*parent, part, leaf])) for part in FUSED[proj]]
    return [hf_key(name)]


def our_key(hf_name: str) -> str | None:
    """HF parameter name -> ours (q/k/v map to their fused projection), or None for tied
    aliases and computed buffers."""
    if hf_name in _HF_ALIASES or "embed_positions" in hf_name:
        return None
    if not hf_name.startswith(HF_PREFIX):
        return None
    *parent, proj, leaf = hf_name[len(HF_PREFIX) :].split(".")
    if parent and parent[-1] == "self_attn" and proj in FUSED["qkv_proj"]:
        proj = "qkv_proj"
    elif parent and parent[-1] == "encoder_attn" and proj in FUSED["kv_proj"]:
        proj = "kv_proj"
    return ".".join([*parent, proj, leaf])


def _heads_of(name: str, config: ModelConfig) -> int:
    return config.encoder_attention_heads if name.startswith("encoder.") else config.decoder_attention_heads


def fuse_heads(parts: list[Tensor], num_heads: int) -> Tensor:
    """[q, k, v] (each (h d, ...)) -> (h n d, ...) with rows grouped by head (see `Attention`)."""
    grouped = torch.stack([p.reshape(num_heads, -1, *p.shape[1:]) for p in parts], dim=1)  # (h, n, d, ...)
    return grouped.reshape(-1, *parts[0].shape[1:])


def split_heads(fused: Tensor, n: int, num_heads: int) -> list[Tensor]:
    """Inverse of `fuse_heads`: (h n d, ...) -> n tensors of (h d, ...)."""
    grouped = fused.reshape(num_heads, n, -1, *fused.shape[1:])
    return [grouped[:, i].reshape(-1, *fused.shape[1:]) for i in range(n)]


def to_hf_state_dict(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Our full state dict (or gradients) -> HF's: fused projections split, plus the tied
    `lm_head.weight` when the embedding is there."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        keys = hf_names(name)
        parts = [tensor] if len(keys) == 1 else split_heads(tensor, len(keys), _heads_of(name, config))
        out.update(zip(keys, parts))
    if "shared.weight" in state:
        out["lm_head.weight"] = state["shared.weight"]
    return out


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / f for f in files]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointMismatchError(f"{path} holds no model.safetensors (or index); export with safetensors")


def read_hf_config(path: str | Path) -> ModelConfig:
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointMismatchError(f"{path} has no config.json; expected a Hugging Face model directory")
    return from_hf_config(json.loads(cfg_file.read_text()))


def load_hf_weights(path: str | Path, wanted: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Read our-named tensors from an HF directory (q/k/v fused); only `wanted` names if given.

    Raises:
        CheckpointMismatchError: a wanted tensor is absent.
    """
    from safetensors import safe_open

    want = None if wanted is None else set(wanted)
    found: dict[str, Tensor] = {}  # HF name (tied aliases as model.shared.weight) -> tensor
    for f in _weight_files(Path(path)):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118 - safe_open is not a dict
                ours = our_key(k)
                if ours is None and k in _HF_ALIASES and hf_key("shared.weight") not in found:
                    ours, k_as = "shared.weight", hf_key("shared.weight")  # some exports keep only an alias
                else:
                    k_as = k
                if ours is not None and (want is None or ours in want):
                    found[k_as] = sf.get_tensor(k)
    names = want if want is not None else {n for n in (our_key(k) for k in found) if n is not None}
    missing = sorted(n for n in names if not all(k in found for k in hf_names(n)))
    if missing:
        raise CheckpointMismatchError(f"{path} lacks {missing[:5]} (model/checkpoint mismatch)")
    config = read_hf_config(path)
    out: dict[str, Tensor] = {}
    for name in names:
        parts = [found[k] for k in hf_names(name)]
        out[name] = parts[0] if len(parts) == 1 else fuse_heads(parts, _heads_of(name, config))
    return out


def load_into(model: torch.nn.Module, weights: dict[str, Tensor]) -> None:
    """Copy `weights` into `model` (names must match exactly, shapes too).

    Raises:
        CheckpointMismatchError: naming missing/unexpected keys or the first shape mismatch.
    """
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for k, v in weights.items():
        if own[k].shape != v.shape:
            raise CheckpointMismatchError(
                f"{k}: checkpoint shape {tuple(v.shape)} != model {tuple(own[k].shape)}"
            )
    model.load_state_dict(weights, strict=True)


def load_hf_into(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the HF weights at `path` into `model`, reading only the tensors `model` holds.

    A pipeline stage after `keep_only` reads just its own blocks' tensors from the
    safetensors files, never the whole checkpoint.

    Raises:
        CheckpointMismatchError: a tensor `model` needs is absent, or its shape differs.
    """
    load_into(model, load_hf_weights(path, model.state_dict().keys()))


def save_hf_model(
    state: dict[str, Tensor],
    config: ModelConfig,
    out_dir: str | Path,
    generation: dict[str, Any] | None = None,
) -> None:
    """Write an HF directory (config.json, model.safetensors, generation_config.json).

    Args:
        state: our full (unsharded, unpadded) state dict.
        config: the model config.
        out_dir: destination, created if needed.
        generation: extra generation-config fields (num_beams, max_length, ...).
    """
    from transformers import GenerationConfig, M2M100ForConditionalGeneration

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = to_hf_config(config)
    with torch.device("meta"):
        model = M2M100ForConditionalGeneration(hf_cfg)
    model.load_state_dict(
        {k: v.detach().cpu().contiguous() for k, v in to_hf_state_dict(state, config).items()},
        strict=False,
        assign=True,
    )
    model.tie_weights()
    gen = GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        **(generation or {}),
    )
    model.generation_config = gen
    model.save_pretrained(str(out), safe_serialization=True)
