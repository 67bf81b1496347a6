"""The rehearsal of a shipped config: its own flags, only its sizes cut (tests/dist/test_rehearsal.py).

`plan(path)` reads `configs/X.yaml` and returns the command-line flags a user would add to run it
on one 8-rank CPU box, derived from the file itself, so a config added later is rehearsed without
an entry here:

- mesh: pp and the virtual stages (interleaved's `virtual_pipeline_stages`, zbv's V) are kept;
  tp is cut to 2 (sequence parallelism keeps a split); dp to 2 where the config shards over dp
  (zero1, fsdp), names dp > 1 or spreads experts over it, else 1; `data_parallel_size: -1` stays -1
  (the world infers it); `expert_parallel_size` is cut to what dp' holds. pp x tp x dp <= 8;
- the schedule, remat policy, partition method (an explicit block list rescaled to the cut model,
  same shape), dp sharding, precision, sequence parallelism, LayerDrop, dropout, label smoothing,
  lr schedule, beams, evaluation / save strategies, best model, early stopping, predict, async
  save and report_to are the config's;
- sizes: d_model 32, at most 4 heads, FFN 64, the fewest layers that give every stage a block
  (at least 2 per side, two blocks to spare under an explicit balance, one sparse layer per side
  for MoE), at most 4 experts, vocabulary 256, sentences of 16 tokens, micro-batches of 2 pairs
  or 64 tokens, m cut to pp, 4 optimizer steps (or 2 epochs of 2 steps), a save every 2 where the
  config saves every N, evaluation before and after training on at most 8 sentences per
  direction, decoding 12 tokens;
- data the box does not have (`/data/...`) becomes small JSON-lines files written by the test
  from the built-in corpus, keyed by the config's own codes (`eng_Latn` <- `en` through ISO 639-3);
  `dataset_name: builtin` stays, with fewer items;
- fine-tunes (`model_name_or_path` set, or the config's recipe in docs/recipes.md: `FINE_TUNE_RECIPES`) start
  from a tiny directory of the config's family made by `make_pretrained` (weights by
  `models.hf_save`, tokenizer by our own `save_pretrained`, the form `trainer.export` writes).

The rehearsal itself (train with evaluation, SIGTERM at step 3, resume `latest`, export, translate)
is `tests/dist/rehearsal_workers.py` and the test.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
MAX_WORLD = 8
STEPS, SAVE_EVERY, TERM_AT = 4, 2, 3
EPOCHS, STEPS_PER_EPOCH = 2, 2
D_MODEL, MAX_HEADS, FFN, VOCAB, MAX_EXPERTS = 32, 4, 64, 256, 4
MAX_LEN, GEN_LEN, EVAL_SAMPLES = 16, 12, 8
PAIRS_PER_MICROBATCH, TOKENS_PER_MICROBATCH = 2, 64
BUILTIN_SIZE = 80
# Configs whose header documents fine-tuning a published model (docs/recipes.md "NLLB-200" and
# "NLLB-MoE-54B"): rehearsed as that recipe, from a tiny directory of the family.
# nllb200_1.3b (same mesh as the 600M one) stays from scratch, so NLLB codes are rehearsed both ways.
FINE_TUNE_RECIPES = frozenset({"nllb200_distilled_600m", "nllb200_3.3b", "nllb_moe_54b"})


@dataclass
class Rehearsal:
    """One config's rehearsal: the world it runs on and the flags over the file (values as typed)."""

    name: str
    config: Path
    world: int
    mesh: dict[str, int]  # the (pp, dp, tp) it must run on, as run_summary.json records it
    flags: dict[str, Any]
    directions: list[tuple[str, str]]
    fine_tune: bool
    data_files: dict[str, str] = field(default_factory=dict)  # split -> path the test writes
    cut: list[str] = field(default_factory=list)  # what was cut, for docs/development.md's table

    def argv(self, **extra: Any) -> list[str]:
        """`--config FILE --field value ...`, the command line a user would type."""
        out = ["--config", str(self.config)]
        for key, value in {**self.flags, **extra}.items():
            out.append(f"--{key}")
            if isinstance(value, (list, tuple)):
                out.extend(str(v) for v in value)
            elif isinstance(value, bool):
                out.append(str(value).lower())
            else:
                out.append("null" if value is None else str(value))
        return out

    @property
    def evaluates(self) -> bool:
        """Whether the config evaluates (`do_eval`, on by default)."""
        return bool(load(self.config).get("do_eval", True))

    @property
    def half(self) -> str | None:
        """The run's 16-bit dtype for export and translation, or None for fp32."""
        file = load(self.config)
        return "bfloat16" if file.get("bf16") else "float16" if file.get("fp16") else None


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def shipped_configs() -> list[Path]:
    return sorted(CONFIGS.glob("*.yaml"))


def directions(file: dict[str, Any]) -> list[tuple[str, str]]:
    pairs = file.get("language_pairs") or []
    if pairs:
        return [tuple(p.split("-")) for p in pairs]  # type: ignore[misc]
    return [(file["source_lang"], file["target_lang"])]


def mesh_flags(file: dict[str, Any]) -> tuple[dict[str, int], dict[str, Any], list[str]]:
    """(mesh, parallel flags, what was cut): pp and virtual stages kept, tp / dp / ep cut to fit."""
    pp = int(file.get("pipeline_parallel_size", 1))
    tp_cfg = int(file.get("tensor_parallel_size", 1))
    dp_cfg = int(file.get("data_parallel_size", -1))
    ep_cfg = int(file.get("expert_parallel_size", 1))
    sharded = file.get("data_parallel_sharding", "none") != "none"
    tp = min(tp_cfg, 2)
    dp = 2 if (sharded or dp_cfg > 1 or ep_cfg > 1) else 1
    if pp * tp * dp > MAX_WORLD:
        dp = 1
    if pp * tp * dp > MAX_WORLD or (sharded and dp < 2):
        raise ValueError(f"cannot fit pp={pp} x tp={tp} x dp={dp} (sharding {sharded}) in {MAX_WORLD} ranks")
    flags: dict[str, Any] = {}
    cut = []
    if tp != tp_cfg:
        flags["tensor_parallel_size"] = tp
        cut.append(f"tp {tp_cfg}->{tp}")
    if dp_cfg != -1 and dp != dp_cfg:
        flags["data_parallel_size"] = dp
        cut.append(f"dp {dp_cfg}->{dp}")
    elif dp_cfg == -1 and dp > 1:
        cut.append(f"dp -1 (inferred {dp})")
    mesh = {"pp": pp, "dp": dp, "tp": tp}
    if ep_cfg > 1:
        ep = math.gcd(ep_cfg, dp)
        flags["expert_parallel_size"] = ep
        cut.append(f"ep {ep_cfg}->{ep}")
        if ep > 1:  # run_summary.json names ep where experts are spread
            mesh["ep"] = ep
    m = int(file.get("num_microbatches", 1))
    if pp > 1 and m > pp:
        flags["num_microbatches"] = pp
        cut.append(f"m {m}->{pp}")
    return mesh, flags, cut


def stages(file: dict[str, Any]) -> int:
    pp = int(file.get("pipeline_parallel_size", 1))
    schedule = file.get("pipeline_schedule", "1f1b")
    v = int(file.get("virtual_pipeline_stages", 2)) if schedule == "interleaved_1f1b" else 2 if schedule == "zbv" else 1
    return pp * v


def rescale_balance(balance: list[int], n_blocks: int) -> list[int]:
    """Block counts per stage for `n_blocks` blocks, in proportion to `balance` (each >= 1)."""
    k = len(balance)
    extra = n_blocks - k  # every stage keeps one block; the rest go by largest remainder
    share = [(b - 1) * extra / max(1, sum(balance) - k) for b in balance]
    out = [1 + int(s) for s in share]
    order = sorted(range(k), key=lambda i: (int(share[i]) - share[i], i))
    for i in order[: n_blocks - sum(out)]:
        out[i] += 1
    return out


def model_flags(file: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Sizes cut: width, heads, FFN, layers (every stage a block), experts, vocabulary."""
    n_stages = stages(file)
    sparse_steps = [int(file.get(f"{side}_sparse_step", 0) or 0) for side in ("encoder", "decoder")]
    moe = int(file.get("num_experts", 0) or 0) > 0
    balance = str(file.get("partition_method", "uniform"))
    spare = 2 if "," in balance else 0  # an explicit balance keeps its shape: two blocks to spare
    layers = max(2, math.ceil((n_stages + spare - 4) / 2), *(sparse_steps if moe else []))
    flags: dict[str, Any] = {"d_model": D_MODEL, "vocab_size": VOCAB}
    cut = [f"d_model {file.get('d_model', 256)}->{D_MODEL}", f"vocab {file.get('vocab_size', 8000)}->{VOCAB}"]
    for side in ("encoder", "decoder"):
        flags[f"{side}_layers"] = layers
        flags[f"{side}_attention_heads"] = min(int(file.get(f"{side}_attention_heads", 4)), MAX_HEADS)
        flags[f"{side}_ffn_dim"] = FFN
    cut.append(f"layers {file.get('encoder_layers', 3)}+{file.get('decoder_layers', 3)}->{layers}+{layers}")
    if moe:
        experts = min(int(file["num_experts"]), MAX_EXPERTS)
        flags["num_experts"] = experts
        cut.append(f"experts {file['num_experts']}->{experts}")
    if "," in balance:
        counts = [int(x) for x in balance.strip("[]").split(",")]
        flags["partition_method"] = ",".join(map(str, rescale_balance(counts, 2 * layers + 4)))
        cut.append(f"partition {balance}->{flags['partition_method']}")
    return flags, cut


def training_flags(file: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Steps, saves, evaluation and batch sizes cut; every strategy and flag kept."""
    flags: dict[str, Any] = {"logging_steps": 1, "warmup_steps": min(int(file.get("warmup_steps", 0)), 1)}
    cut = []
    by_epoch = int(file.get("max_steps", -1)) <= 0
    if by_epoch:
        flags["num_train_epochs"] = EPOCHS
        cut.append(f"epochs {file.get('num_train_epochs', 3)}->{EPOCHS}")
    else:
        flags["max_steps"] = STEPS
        cut.append(f"steps {file['max_steps']}->{STEPS}")  # 2 -> 4 too: a SIGTERM at 3 and a resume
    # A cadence of 0 (only at the end) stays 0; a preemption saves whatever the cadence.
    if file.get("save_strategy", "steps") == "steps" and file.get("save_steps", 0):
        flags["save_steps"] = SAVE_EVERY
    if file.get("eval_strategy", "steps") == "steps" and file.get("eval_steps", 0):
        flags["eval_steps"] = STEPS  # evaluation before training (fresh start) and at the end
    if file.get("max_tokens_per_microbatch"):
        flags["max_tokens_per_microbatch"] = TOKENS_PER_MICROBATCH
    flags["per_device_train_batch_size"] = PAIRS_PER_MICROBATCH
    flags["per_device_eval_batch_size"] = EVAL_SAMPLES
    flags["generation_max_length"] = GEN_LEN
    return flags, cut


def data_flags(file: dict[str, Any], tmp: Path, world_dp: int) -> tuple[dict[str, Any], dict[str, str], list[str]]:
    """Data that exists here stays (fewer items); `/data/...` becomes JSON lines the test writes."""
    flags: dict[str, Any] = {
        "max_source_length": MAX_LEN,
        "max_target_length": MAX_LEN,
        "max_eval_samples": EVAL_SAMPLES,
    }
    files: dict[str, str] = {}
    cut = []
    if file.get("dataset_name") == "builtin":
        flags["builtin_size"] = BUILTIN_SIZE
        cut.append(f"builtin corpus {file.get('builtin_size', 4000)}->{BUILTIN_SIZE} items")
    for split, key in (("train", "train_file"), ("validation", "validation_file"), ("test", "test_file")):
        given = file.get(key)
        if given and not (ROOT / given).exists():
            files[split] = str(tmp / "data" / f"{split}.jsonl")
            flags[key] = files[split]
        elif given:
            flags[key] = str(ROOT / given)
    if files:
        cut.append("data: JSON lines written from the built-in corpus")
    if int(file.get("max_steps", -1)) <= 0:  # epochs: STEPS_PER_EPOCH global batches of training data
        pairs = PAIRS_PER_MICROBATCH * world_dp * max(1, int(file.get("num_microbatches", 1)))
        flags["max_train_samples"] = STEPS_PER_EPOCH * pairs * int(file.get("gradient_accumulation_steps", 1))
    return flags, files, cut


def plan(path: Path, tmp: Path) -> Rehearsal:
    """The rehearsal of `path` with its outputs under `tmp` (nothing is written here)."""
    file = load(path)
    mesh, flags, cut = mesh_flags(file)
    model, model_cut = model_flags(file)
    train, train_cut = training_flags(file)
    data, data_files, data_cut = data_flags({**file, **flags}, tmp, mesh["dp"])
    flags.update({**model, **train, **data, "output_dir": str(tmp / "run")})
    fine_tune = bool(file.get("model_name_or_path")) or path.stem in FINE_TUNE_RECIPES
    if fine_tune:
        flags["model_name_or_path"] = flags["tokenizer_name"] = str(tmp / "pretrained")
        cut.append("fine-tune of a tiny pretrained directory")
    world = mesh["pp"] * mesh["dp"] * mesh["tp"]
    cuts = cut + model_cut + train_cut + data_cut
    return Rehearsal(path.stem, path, world, mesh, flags, directions(file), fine_tune, data_files, cuts)


def write_data(rehearsal: Rehearsal, seed: int = 1) -> None:
    """The JSON-lines files of `rehearsal.data_files`: built-in corpus text under the config's codes."""
    from trainer.data.corpus import build_builtin_corpus

    codes = sorted({lang for d in rehearsal.directions for lang in d})
    iso = {code: builtin_language(code) for code in codes}
    corpus = build_builtin_corpus(sorted(set(iso.values())), BUILTIN_SIZE, seed)
    for split, name in rehearsal.data_files.items():
        path = Path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [{"translation": {code: rec[iso[code]] for code in codes}} for rec in corpus[split]]
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def builtin_language(code: str) -> str:
    """The built-in corpus language of a config's code: `en` as is, NLLB's `eng_Latn` through ISO 639-3
    (`trainer.tokenizer.lang_codes`, which `trainer.evaluate` maps FLORES codes with)."""
    from trainer.tokenizer.lang_codes import code_key

    if "_" not in code:
        return code
    lang = code_key(code).language
    if len(lang) != 2:
        raise ValueError(f"no ISO 639-1 code for {code!r}: the built-in corpus cannot stand in for it")
    return lang


def training_texts(rehearsal: Rehearsal) -> list[str]:
    """The texts a fine-tune's tokenizer is trained on: the run's training data, every language."""
    from trainer.data.corpus import build_builtin_corpus

    train = rehearsal.flags.get("train_file")
    if train and Path(train).exists():
        rows = [json.loads(line)["translation"] for line in Path(train).read_text().splitlines() if line]
        return [text for row in rows for text in row.values()]
    langs = sorted({builtin_language(lang) for d in rehearsal.directions for lang in d})
    return [t for rec in build_builtin_corpus(langs, BUILTIN_SIZE, 1)["train"] for t in rec.values()]


def make_pretrained(rehearsal: Rehearsal) -> Path:
    """A tiny pretrained directory of the config's family at `model_name_or_path`: its SentencePiece
    tokenizer with the config's codes as tags (`save_pretrained`: NllbTokenizer files, as
    `trainer.export` writes them) and random weights of the cut architecture (`models.hf_save`:
    an M2M100, or an NLLB-MoE where the config has experts), every other architecture field the
    config's (dropouts, LayerDrop, activation, experts' routing)."""
    from dataclasses import fields

    from models.config import ModelConfig
    from models.hf_save import save_hf_model
    from models.m2m100 import M2M100Translation
    from trainer.tokenizer.vocab import train_tokenizer

    out = Path(rehearsal.flags["model_name_or_path"])
    codes = sorted({lang for d in rehearsal.directions for lang in d})
    tok = train_tokenizer(training_texts(rehearsal), codes, VOCAB, seed=0)
    tok.save_pretrained(out)
    names = {f.name for f in fields(ModelConfig)} - {"vocab_size", *tok.special_ids()}
    file = load(rehearsal.config)
    arch = {k: v for k, v in {**file, **rehearsal.flags}.items() if k in names and v is not None}
    mc = ModelConfig(vocab_size=tok.vocab_size, **arch, **tok.special_ids())
    save_hf_model(M2M100Translation(mc).state_dict(), mc, out)
    return out
