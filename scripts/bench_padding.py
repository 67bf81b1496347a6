"""What `pad_to_multiple_of` costs and buys: padding share and distinct micro-batch shapes.

    python scripts/bench_padding.py          # about 2 minutes: writes benchmarks/padding_cpu.{md,json}

The map-style sampler (`GlobalBatchSampler`, the streaming one cuts windows alike) over two
corpora, 300 global batches of 4 micro-batches each, for k in 1, 2, 4, 8, 16, 32: multi30k
(20k aligned sentences of en, de, fr, cs from ../shared/data, 4 directions, a SentencePiece of
8000 pieces) and the built-in corpus of `configs/tiny.yaml`. Micro-batches of 8 pairs, 32 pairs,
and at most 1,024 padded tokens. Shapes are distinct (B, S, T) of the micro-batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from trainer.config.data_args import DataArguments  # noqa: E402
from trainer.data.batching import BatchLayout, GlobalBatchSampler, bucket  # noqa: E402
from trainer.data.sources import load_raw_datasets, training_texts  # noqa: E402
from trainer.data.tokenization import tokenize_datasets  # noqa: E402
from trainer.tokenizer.vocab import train_tokenizer  # noqa: E402

PAIRS = ["en-de", "de-en", "en-fr", "fr-en"]
MULTIPLES = (1, 2, 4, 8, 16, 32)
LAYOUTS = {"8 pairs": {"per_device_batch_size": 8}, "32 pairs": {"per_device_batch_size": 32},
           "<= 1,024 tokens": {"per_device_batch_size": 1, "max_tokens_per_microbatch": 1024}}  # fmt: skip


def multi30k(tmp: Path) -> Any:
    import gzip

    from make_sharded_corpus import sentences

    text = {lang: lines[:20000] for lang, lines in sentences().items() if lang in ("en", "de", "fr", "cs")}
    for lang, lines in text.items():
        with gzip.open(tmp / f"train.{lang}.gz", "wt", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    tok = train_tokenizer([t for lines in text.values() for t in lines[:3000]], list(text), 8000, seed=0)
    args = DataArguments(train_file=str(tmp / "train.{lang}.gz"), language_pairs=PAIRS)
    return tokenize_datasets(load_raw_datasets(args, seed=0), tok, args).train


def builtin() -> Any:
    args = DataArguments(dataset_name="builtin", builtin_size=1500, language_pairs=PAIRS, max_source_length=64,
                         max_target_length=64)  # fmt: skip
    raw = load_raw_datasets(args, seed=0)
    tok = train_tokenizer(list(training_texts(raw.train))[:20000], ["en", "de", "fr"], 1000, seed=0)
    return tokenize_datasets(raw, tok, args).train


def measure(train: Any, layout: dict[str, Any], k: int) -> dict[str, Any]:
    sampler = GlobalBatchSampler(
        train, BatchLayout(num_microbatches=4, pad_to_multiple_of=k, **layout), 0, 1, 2
    )
    real = padded = 0
    shapes = set()
    for _ in range(300):
        gb = next(sampler)
        real += gb.num_tokens + gb.num_src_tokens
        padded += gb.padded_tokens
        for s in gb.slots:
            shapes.add((len(s), bucket(int(gb.src_len[s].max()), k), bucket(int(gb.tgt_len[s].max()), k)))
    return {"padding_fraction": 1 - real / padded, "shapes": len(shapes)}


def main() -> None:
    import tempfile

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for corpus, train in (("multi30k", multi30k(Path(tmp))), ("built-in", builtin())):
            for name, layout in LAYOUTS.items():
                out[f"{corpus}, {name}"] = {k: measure(train, layout, k) for k in MULTIPLES}
    lines = ["# Padding to buckets: padding share / distinct shapes", "",
             "`scripts/bench_padding.py`: 300 global batches of 4 micro-batches per row.", "",
             "| corpus, micro-batch | " + " | ".join(f"k = {k}" for k in MULTIPLES) + " |",
             "|---|" + "---|" * len(MULTIPLES)]  # fmt: skip
    for row, by_k in out.items():
        cells = [f"{v['padding_fraction']:.1%} / {v['shapes']}" for v in by_k.values()]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    (ROOT / "benchmarks" / "padding_cpu.md").write_text(text)
    (ROOT / "benchmarks" / "padding_cpu.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
