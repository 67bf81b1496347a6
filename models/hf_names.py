"""Our parameter names <-> the `transformers` names of M2M100 and NLLB-MoE checkpoints.

Our names are the M2M100 ones without the leading `model.`, with two kinds of tensors made of
several HF tensors:

    ours                                         transformers (M2M100 | NllbMoe)
    self_attn.qkv_proj.weight (3H, H)            self_attn.{q,k,v}_proj.weight, rows fused by head
    encoder_attn.kv_proj.weight (2H, H)          encoder_attn.{k,v}_proj  | cross_attention.{k,v}_proj
    ffn.experts.fc1_weight (E, F, H)             -                        | ffn.experts.expert_<e>.fc1.weight

and, for NLLB-MoE only, the layer parts NllbMoe names differently (`NLLB_MOE_RENAMES`):

    fc1 / fc2 (dense layers)                     ffn.fc1 / ffn.fc2
    final_layer_norm                             ff_layer_norm
    encoder_attn / encoder_attn_layer_norm       cross_attention / cross_attention_layer_norm

The tied copies HF keeps (`model.encoder.embed_tokens`, `model.decoder.embed_tokens`,
`lm_head`) map to our one `shared.weight`. The mapping of a stacked expert parameter to its
per-expert names is `models.moe.names`' (the one home of it); this module only adds the prefix
and the renames.
"""

from __future__ import annotations

import re

from models.config import ModelConfig
from models.moe.names import expert_param_name, split_expert_name

HF_PREFIX = "model."
# HF keys that are tied copies of `model.shared.weight` (or positions, which are computed).
HF_ALIASES = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")
# Our fused attention projections and the HF tensors they hold, in row-group order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "kv_proj": ("k_proj", "v_proj")}
# NllbMoe's names for the first component after `layers.<i>.` (ours -> theirs).
NLLB_MOE_RENAMES = {
    "fc1": "ffn.fc1",
    "fc2": "ffn.fc2",
    "final_layer_norm": "ff_layer_norm",
    "encoder_attn": "cross_attention",
    "encoder_attn_layer_norm": "cross_attention_layer_norm",
}
_LAYER = re.compile(r"^(?P<stack>(?:encoder|decoder)\.layers\.\d+)\.(?P<rest>.+)$")


def is_moe(config: ModelConfig | None) -> bool:
    return config is not None and config.is_moe


def _rename(name: str, moe: bool, to_hf: bool) -> str:
    """Apply (or undo) NllbMoe's layer renames to an unfused, per-expert name."""
    m = _LAYER.match(name)
    if not moe or m is None:
        return name
    rest = m["rest"]
    table = NLLB_MOE_RENAMES if to_hf else {v: k for k, v in NLLB_MOE_RENAMES.items()}
    for src in sorted(table, key=len, reverse=True):  # `ffn.fc1` before `ffn`, longer names first
        if rest == src or rest.startswith(src + "."):
            rest = table[src] + rest[len(src) :]
            break
    return f"{m['stack']}.{rest}"


def hf_key(name: str, config: ModelConfig | None = None) -> str:
    """One of our unfused (per-expert) names -> its HF key (`shared.weight` -> `model.shared.weight`)."""
    return HF_PREFIX + _rename(name, is_moe(config), to_hf=True)


def hf_names(name: str, config: ModelConfig | None = None) -> list[str]:
    """The HF keys one of our tensors is made of: one; q/k/v (or k/v) for a fused projection; or
    E per-expert keys (expert order) for a stacked expert parameter.

    Raises:
        ValueError: a stacked expert parameter without an MoE `config` (E unknown).
    """
    prefix, _, leaf = name.rpartition(".")
    if prefix.endswith(".experts"):
        if config is None or not config.is_moe:
            raise ValueError(f"{name} is an expert parameter: its HF names need an NLLB-MoE config")
        return [hf_key(expert_param_name(name, e), config) for e in range(config.num_experts)]
    *parent, proj, leaf = name.split(".")
    if proj in FUSED:
        return [hf_key(".".join([*parent, part, leaf]), config) for part in FUSED[proj]]
    return [hf_key(name, config)]


def our_key(hf_name: str, config: ModelConfig | None = None) -> str | None:
    """HF parameter name -> ours (q/k/v map to their fused projection, an expert's tensor to the
    stacked parameter), or None for tied aliases and computed buffers."""
    if hf_name in HF_ALIASES or "embed_positions" in hf_name or not hf_name.startswith(HF_PREFIX):
        return None
    name = _rename(hf_name[len(HF_PREFIX) :], is_moe(config), to_hf=False)
    expert = split_expert_name(name)
    if expert is not None:
        return expert[0]
    *parent, proj, leaf = name.split(".")
    if parent and parent[-1] == "self_attn" and proj in FUSED["qkv_proj"]:
        proj = "qkv_proj"
    elif parent and parent[-1] == "encoder_attn" and proj in FUSED["kv_proj"]:
        proj = "kv_proj"
    return ".".join([*parent, proj, leaf])
