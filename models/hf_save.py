"""Write Hugging Face `M2M100ForConditionalGeneration` (or, for an MoE config,
`NllbMoeForConditionalGeneration`) directories: config, safetensors shards, index.

One writer for both paths: `save_hf_model` (a state dict in memory) and the streaming export
(`trainer.checkpoint.hf_export`, a checkpoint read a shard at a time). The files are the ones
`save_pretrained` writes: `config.json`, `generation_config.json`, and `model.safetensors`, or
`model-0000k-of-0000n.safetensors` plus `model.safetensors.index.json` (`metadata.total_size`,
`weight_map`) when the weights exceed `max_shard_size`. The shared embedding is stored once,
as `model.shared.weight`: its tied copies (`encoder/decoder.embed_tokens`, `lm_head`) are
left out, as `save_pretrained` does, and `tie_word_embeddings` restores them on load.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from models.config import ModelConfig
from models.hf import hf_tensors, to_hf_config

# The --dtype names of an export and the torch dtypes they write.
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def parse_shard_size(value: int | str) -> int:
    """`max_shard_size` in bytes, with `transformers`' semantics ("5GB" = 5 * 10**9, "200MiB" =
    200 * 2**20, "8Mb" megabits; a bare integer is bytes).

    Raises:
        ValueError: not a positive size, naming the value and the valid forms.
    """
    from transformers.utils.hub import convert_file_size_to_int

    text = str(value).strip()
    try:
        size = int(text) if text.isdigit() else convert_file_size_to_int(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise ValueError(
            f"max_shard_size {str(value)!r} is not a size; valid: a positive number of bytes or an "
            "integer with a unit, e.g. '5GB', '500MB', '200MiB' (KB/MB/GB = 10^3/10^6/10^9, "
            "KiB/MiB/GiB = 2^10/2^20/2^30)"
        )
    return size


def plan_shards(sizes: Iterable[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Group tensors (name, bytes), in order, into shards of at most `max_bytes` each, as
    `save_pretrained` does: a tensor that would overflow the current shard starts the next;
    one larger than `max_bytes` has a shard of its own."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards if shards[0] else []


def shard_file(index: int, count: int) -> str:
    """The file name of shard `index` (0-based) of `count`, as `save_pretrained` names them."""
    return SINGLE_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_shards(
    out_dir: str | Path,
    groups: Sequence[Sequence[str]],
    make_shard: Callable[[Sequence[str]], dict[str, Tensor]],
) -> None:
    """Write one safetensors file per group, then the index; one shard is held at a time.

    Args:
        out_dir: an existing directory.
        groups: the shards' tensors (`plan_shards`), in file order.
        make_shard: a group -> its HF-named tensors (contiguous CPU tensors). It is called for
            a group only after the previous shard is written and dropped, so at most one
            shard's tensors are alive (safetensors writes them from their own memory).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    weight_map: dict[str, str] = {}
    total = 0
    for i, group in enumerate(groups):
        name = shard_file(i, len(groups))
        tensors = make_shard(group)
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors  # before the next shard is made
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_hf_config(
    config: ModelConfig,
    out_dir: str | Path,
    generation: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write config.json (recording the weights' `dtype`, and the `extra` keys, which
    `transformers` keeps as attributes of the config) and generation_config.json (the config's
    special ids plus `generation`: num_beams, max_length, ...)."""
    import transformers
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_cfg = to_hf_config(config)
    hf_cfg.architectures = [
        "NllbMoeForConditionalGeneration" if config.is_moe else "M2M100ForConditionalGeneration"
    ]
    # transformers 5.x names the weights' dtype "dtype" (and warns on "torch_dtype"), 4.x "torch_dtype".
    setattr(hf_cfg, "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype", dtype)
    for key, value in (extra or {}).items():
        setattr(hf_cfg, key, value)
    hf_cfg.save_pretrained(str(out))
    gen = GenerationConfig(
        decoder_start_token_id=config.decoder_start_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        **(generation or {}),
    )
    gen.save_pretrained(str(out))


def tensor_bytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of `shape` in `dtype` (a fused q/k/v tensor: its HF parts together)."""
    return math.prod(int(d) for d in shape) * dtype.itemsize


def save_hf_model(
    state: dict[str, Tensor],
    config: ModelConfig,
    out_dir: str | Path,
    generation: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "5GB",
) -> None:
    """Write an HF directory (config.json, safetensors weights, generation_config.json).

    Args:
        state: our full (unsharded, unpadded) state dict.
        config: the model config.
        out_dir: destination, created if needed.
        generation: extra generation-config fields (num_beams, max_length, ...).
        dtype: the weights' dtype in the files.
        max_shard_size: the largest safetensors file (`parse_shard_size`).
    """
    out = Path(out_dir)
    write_hf_config(config, out, generation, dtype)
    sizes = [(n, tensor_bytes(t.shape, dtype)) for n, t in state.items()]
    groups = plan_shards(sizes, parse_shard_size(max_shard_size))

    def make_shard(group: Sequence[str]) -> dict[str, Tensor]:
        return {
            k: v.detach().to("cpu", dtype).contiguous()
            for n in group
            for k, v in hf_tensors(n, state[n], config)
        }

    write_shards(out, groups, make_shard)
