"""Write the small en-de JSON-lines sample behind configs/run_translation_style.yaml.

    python scripts/make_sample_translation_data.py [--out configs/data/en-de_sample] [--size 1200]

Train / validation / test files in the Hugging Face translation format
(`{"translation": {"en": "...", "de": "..."}}`), drawn from the built-in corpus
(`trainer.data.corpus`: numbers, dates, CLDR names), so they need no download; the items
of the three splits never overlap. The committed files are this script's output with
the defaults.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainer.data.corpus import build_builtin_corpus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="configs/data/en-de_sample")
    parser.add_argument("--size", type=int, default=1200, help="items over all splits (~90/5/5%%)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = build_builtin_corpus(["en", "de"], args.size, args.seed)
    for split, records in corpus.items():
        lines = [json.dumps({"translation": r}, ensure_ascii=False) for r in records]
        (out / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{out / split}.jsonl: {len(lines)} pairs")


if __name__ == "__main__":
    main()
