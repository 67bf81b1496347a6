"""Import from and export to Hugging Face `M2M100ForConditionalGeneration` and
`NllbMoeForConditionalGeneration` directories.

The names are `models.hf_names`': HF's without the leading `model.`, except the fused
attention projections (rows grouped by head: `fuse_heads` / `split_heads`; see
`models.attention.Attention`), the stacked experts of NLLB-MoE (E per-expert tensors stacked
along a new dim 0) and NllbMoe's own layer names. Reading goes through
`safetensors.safe_open`, slice by slice (`read_hf_slices`), so a pipeline stage's tp shard
reads only the rows and columns it holds, and a rank holding experts [a, b) (a part sliced
along dim 0 of a stacked expert parameter) reads only those experts' tensors;
`pytorch_model*.bin` files are memory-mapped and sliced alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.config import ModelConfig
from models.errors import CheckpointMismatchError, ModelConfigError
from models.hf_names import FUSED as FUSED  # re-exported: importers name them from here
from models.hf_names import HF_ALIASES, hf_names, our_key
from models.hf_names import hf_key as hf_key
from models.init import LocalSlice

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
    "encoder_layerdrop",
    "decoder_layerdrop",
    "max_position_embeddings",
    "scale_embedding",
    "init_std",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
)
# NllbMoeConfig's fields beyond M2M100's (ModelConfig has them all, same names).
MOE_CONFIG_KEYS = (
    "num_experts",
    "encoder_sparse_step",
    "decoder_sparse_step",
    "expert_capacity",
    "router_bias",
    "router_dtype",
    "router_ignore_padding_tokens",
    "second_expert_policy",
    "normalize_router_prob_before_dropping",
    "batch_prioritized_routing",
    "moe_eval_capacity_token_fraction",
    "moe_token_dropout",
    "router_aux_loss_coef",
    "router_z_loss_coef",
)
MOE_MODEL_TYPE = "nllb-moe"


def to_hf_config(config: ModelConfig) -> Any:
    """A `transformers.M2M100Config` (or `NllbMoeConfig` for an MoE model) equal to `config`."""
    from transformers import M2M100Config

    kw = {k: getattr(config, k) for k in _CONFIG_KEYS}
    if config.is_moe:
        from transformers import NllbMoeConfig

        kw.update({k: getattr(config, k) for k in MOE_CONFIG_KEYS})
        return NllbMoeConfig(**kw, tie_word_embeddings=True, use_cache=True, is_encoder_decoder=True)
    return M2M100Config(
        **kw,
        tie_word_embeddings=True,
        use_cache=True,
        is_encoder_decoder=True,
    )


def from_hf_config(hf_config: dict[str, Any]) -> ModelConfig:
    """Our ModelConfig from an HF `config.json` dict.

    Raises:
        CheckpointMismatchError: the directory is not an M2M100/NLLB model.
    """
    model_type = hf_config.get("model_type")
    if model_type not in ("m2m_100", "nllb", MOE_MODEL_TYPE):
        raise CheckpointMismatchError(
            f"model_type={model_type!r} is not supported; expected 'm2m_100' (M2M100/NLLB checkpoints) "
            f"or {MOE_MODEL_TYPE!r} (NLLB-MoE)"
        )
    keys = _CONFIG_KEYS + (MOE_CONFIG_KEYS if model_type == MOE_MODEL_TYPE else ())
    kw = {k: hf_config[k] for k in keys if k in hf_config and hf_config[k] is not None}
    if model_type == MOE_MODEL_TYPE:
        kw.setdefault("num_experts", 128)  # NllbMoeConfig's default
        if int(kw["num_experts"]) < 2:
            raise CheckpointMismatchError(
                f"num_experts={kw['num_experts']} in an {MOE_MODEL_TYPE} config; valid: >= 2 (top-2 routing)"
            )
    return ModelConfig(**kw)


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


def hf_tensors(name: str, tensor: Tensor, config: ModelConfig) -> list[tuple[str, Tensor]]:
    """One of our tensors -> its HF (key, tensor) pairs: itself, q/k/v split from a fused
    projection, or one per expert of a stacked expert parameter."""
    keys = hf_names(name, config)
    if len(keys) == 1:
        return [(keys[0], tensor)]
    if _is_stacked(name):
        return list(zip(keys, tensor.unbind(0)))
    return list(zip(keys, split_heads(tensor, len(keys), _heads_of(name, config))))


def _is_stacked(name: str) -> bool:
    return name.rpartition(".")[0].endswith(".experts")


def to_hf_state_dict(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Our full state dict (or gradients) -> HF's: fused projections split, plus the tied
    `lm_head.weight` when the embedding is there."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        out.update(hf_tensors(name, tensor, config))
    if "shared.weight" in state:
        out["lm_head.weight"] = state["shared.weight"]
    return out


def read_hf_config(path: str | Path) -> ModelConfig:
    """Our ModelConfig from the HF directory `path`'s config.json.

    Raises:
        CheckpointMismatchError: no config.json, not an M2M100/NLLB model, or an invalid architecture.
    """
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise CheckpointMismatchError(f"{path} has no config.json; expected a Hugging Face model directory")
    try:
        return from_hf_config(json.loads(cfg_file.read_text()))
    except ModelConfigError as e:
        raise CheckpointMismatchError(f"{cfg_file}: {e}") from None


def hf_tensor_shape(path: str | Path, name: str) -> tuple[int, ...]:
    """The stored shape of our tensor `name` (`shared.weight`: under its tied aliases too) in the HF
    directory `path`, read from the files' headers (nothing else is read).

    Raises:
        CheckpointMismatchError: no weight files, or no tensor of that name.
    """
    ckpt = _Checkpoint(Path(path))
    try:
        key = ckpt.key(hf_key(name))
        if key is None:
            raise CheckpointMismatchError(f"{path} holds no {hf_key(name)} (or a tied alias of it)")
        return ckpt.shape(key)
    finally:
        ckpt.close()


# Weight files of an HF directory, in the order looked for: (index, single file).
_LAYOUTS = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)


class _Checkpoint:
    """The tensors of an HF directory by key, each file opened once and read slice by slice:
    safetensors through `safe_open(...).get_slice`, `.bin` through a memory-mapped `torch.load`
    (nothing is read until a slice is copied out)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.where: dict[str, Path] = {}
        self._files: dict[Path, Any] = {}
        self._stack = ExitStack()
        for index, single in _LAYOUTS:
            if (path / index).is_file():
                weight_map = json.loads((path / index).read_text())["weight_map"]
                self.where = {k: path / f for k, f in weight_map.items()}
                return
            if (path / single).is_file():
                self.where = dict.fromkeys(self._open(path / single).keys(), path / single)
                return
        raise CheckpointMismatchError(
            f"{path} holds no model.safetensors, pytorch_model.bin or their .index.json; "
            "expected a Hugging Face model directory"
        )

    def _open(self, file: Path) -> Any:
        if file not in self._files:
            if file.suffix == ".safetensors":
                from safetensors import safe_open

                self._files[file] = self._stack.enter_context(safe_open(str(file), framework="pt"))
            else:
                try:
                    self._files[file] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
                except RuntimeError as e:  # the pre-1.6 (non-zip) format cannot be memory-mapped
                    raise CheckpointMismatchError(
                        f"{file} cannot be memory-mapped ({str(e).splitlines()[0]}); re-save it with "
                        "torch.save (zip format) or as safetensors"
                    ) from e
        return self._files[file]

    def key(self, hf_name: str) -> str | None:
        """`hf_name` as stored: the shared embedding may be stored only under a tied alias."""
        if hf_name in self.where:
            return hf_name
        if hf_name == hf_key("shared.weight"):
            return next((a for a in HF_ALIASES if a in self.where), None)
        return None

    def shape(self, key: str) -> tuple[int, ...]:
        f = self._open(self.where[key])
        return tuple(f[key].shape) if isinstance(f, dict) else tuple(f.get_slice(key).get_shape())

    def read(self, key: str, bounds: Sequence[tuple[int, int]]) -> Tensor:
        """The block `bounds` ([lo, hi) per dim) of tensor `key`, a fresh tensor of just that size."""
        index = tuple(slice(lo, hi) for lo, hi in bounds)
        f = self._open(self.where[key])
        view = f[key][index] if isinstance(f, dict) else f.get_slice(key)[index]
        # A copy of just the block: the view may pin the whole tensor's (mapped) storage.
        return view.clone(memory_format=torch.contiguous_format)

    def close(self) -> None:
        self._stack.close()
        self._files.clear()


def _read_part(ckpt: _Checkpoint, name: str, part: LocalSlice | None, config: ModelConfig) -> Tensor:
    """Our tensor `name`'s `part` (None: whole) read from the checkpoint, q/k/v fused by head,
    experts stacked (only those in the part's dim-0 range read)."""
    keys = [ckpt.key(k) or k for k in hf_names(name, config)]
    if _is_stacked(name):
        return _read_experts(ckpt, name, keys, part)
    shapes = [ckpt.shape(k) for k in keys]
    full = (sum(s[0] for s in shapes), *shapes[0][1:])
    if part is None:
        part = LocalSlice.whole(full)
    if full != part.full_shape or any(s != shapes[0] for s in shapes):
        raise CheckpointMismatchError(
            f"{name}: checkpoint shape {full if len(keys) == 1 else shapes} does not fit the model's "
            f"{part.full_shape}"
        )
    bounds = [part.bounds(d) for d in range(len(full))]
    if any(lo == hi for lo, hi in bounds):  # a tp chunk of vocab padding only: nothing to read
        return torch.zeros(part.local_shape)
    if len(keys) == 1:
        return part.pad(ckpt.read(keys[0], bounds))
    heads = _heads_of(name, config)
    group = full[0] // heads  # rows per head: n parts of d rows
    lo, hi = bounds[0]
    if lo % group or hi % group:
        raise ValueError(f"{name}: rows [{lo}, {hi}) split a head group of {group} rows")
    d = group // len(keys)
    pieces = [ckpt.read(k, [(lo // group * d, hi // group * d), *bounds[1:]]) for k in keys]
    return part.pad(fuse_heads(pieces, (hi - lo) // group))


def _read_experts(ckpt: _Checkpoint, name: str, keys: list[str], part: LocalSlice | None) -> Tensor:
    """A stacked expert parameter's part: expert e's tensor is `keys[e]`; a part sliced along
    dim 0 reads only its experts, one along another dim reads each expert's slice of it."""
    shape = ckpt.shape(keys[0])
    full = (len(keys), *shape)
    part = LocalSlice.whole(full) if part is None else part
    if full != part.full_shape or any(ckpt.shape(keys[e]) != shape for e in range(*part.bounds(0))):
        raise CheckpointMismatchError(
            f"{name}: checkpoint experts of shape {len(keys)} x {shape} do not fit the model's {part.full_shape}"
        )
    lo, hi = part.bounds(0)
    inner = [part.bounds(d) for d in range(1, len(full))]
    return part.pad(torch.stack([ckpt.read(keys[e], inner) for e in range(lo, hi)]))


def read_hf_slices(
    path: str | Path, parts: Mapping[str, LocalSlice | None], config: ModelConfig | None = None
) -> Iterator[tuple[str, Tensor]]:
    """Yield (our name, this rank's part) for each of `parts`, one tensor at a time.

    Only the rows/columns of each part are read from the files (q/k/v fused by head, the
    padded vocabulary zero-filled), so a pipeline stage's tp shard reads just its own
    slices and never holds more than the tensor being yielded.

    Args:
        path: an HF directory: model.safetensors, pytorch_model.bin, or a sharded one
            with its `.index.json`.
        parts: our name -> the part held (`LocalSlice`), or None for the whole tensor.
        config: the model config (head counts for fused projections); default: config.json's.

    Raises:
        CheckpointMismatchError: a tensor is absent or its shape differs from the part's full shape.
    """
    config = read_hf_config(path) if config is None else config
    ckpt = _Checkpoint(Path(path))
    try:
        missing = sorted(n for n in parts if any(ckpt.key(k) is None for k in hf_names(n, config)))
        if missing:
            raise CheckpointMismatchError(f"{path} lacks {missing[:5]} (model/checkpoint mismatch)")
        for name, part in parts.items():
            yield name, _read_part(ckpt, name, part, config)
    finally:
        ckpt.close()


def load_hf_weights(path: str | Path, wanted: Iterable[str] | None = None) -> dict[str, Tensor]:
    """Read our-named tensors from an HF directory (q/k/v fused); only `wanted` names if given.

    Raises:
        CheckpointMismatchError: a wanted tensor is absent.
    """
    if wanted is None:
        config = read_hf_config(path)
        ckpt = _Checkpoint(Path(path))
        keys = set(ckpt.where)
        ckpt.close()
        wanted = {n for n in (our_key(k, config) for k in keys) if n is not None}
        if any(a in keys for a in HF_ALIASES):
            wanted.add("shared.weight")
    return dict(read_hf_slices(path, dict.fromkeys(wanted)))


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


@torch.no_grad()
def load_hf_into(model: torch.nn.Module, path: str | Path) -> None:
    """Copy the HF weights at `path` into `model`, reading only the tensors `model` holds,
    one at a time (`read_hf_slices`); a pipeline stage after `keep_only` reads its blocks' only.

    Raises:
        CheckpointMismatchError: a tensor `model` needs is absent, or its shape differs.
    """
    own = model.state_dict()
    parts = {n: LocalSlice.whole(t.shape) for n, t in own.items()}
    config = getattr(model, "config", None)
    for name, value in read_hf_slices(path, parts, config if isinstance(config, ModelConfig) else None):
        own[name].copy_(value)
