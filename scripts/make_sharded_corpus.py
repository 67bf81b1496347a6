"""Write a sharded many-direction JSON-lines corpus of real text, for the data benchmark and tests.

    python scripts/make_sharded_corpus.py --out /tmp/corpus --pairs 1000000 [--directions 20]
        [--shard_pairs 100000] [--gzip] [--seed 0]

Texts are multi30k sentences (en, de, fr, cs: ../shared/data/multi30k) and a fifth pseudo-language
`xx` (the English sentence with its words reversed), so 5 languages give up to 20 directions.
A pair is one aligned multi30k sentence, joined to a second one a third of the time (longer pairs).
Shards are `train-<src>-<tgt>-<k>.jsonl[.gz]`, the same number of pairs per direction, records
`{"translation": {"<src>": ..., "<tgt>": ...}}`. Deterministic given the arguments.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
from pathlib import Path

import numpy as np

# multi30k beside the clone (../shared/data), else the machine's copy
_CANDIDATES = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k",
    Path("/work/shared/data/multi30k"),
)
DATA = next((p for p in _CANDIDATES if p.is_dir()), _CANDIDATES[0])
LANGUAGES = ("en", "de", "fr", "cs", "xx")


def sentences(data: Path = DATA) -> dict[str, list[str]]:
    """Aligned sentences per language (multi30k train), `xx` derived from English."""
    out = {lang: gzip.open(data / f"train.{lang}.gz", "rt").read().splitlines() for lang in LANGUAGES[:4]}
    out["xx"] = [" ".join(reversed(s.split())) for s in out["en"]]
    return out


def directions(n: int) -> list[tuple[str, str]]:
    pairs = [(a, b) for a, b in itertools.permutations(LANGUAGES, 2)]
    if n > len(pairs):
        raise SystemExit(f"--directions {n}: at most {len(pairs)}")
    return pairs[:n]


def write_corpus(out: Path, pairs: int, n_directions: int = 20, shard_pairs: int = 100_000,
                 compress: bool = False, seed: int = 0, data: Path = DATA) -> list[Path]:  # fmt: skip
    """Write the corpus; returns the shard paths."""
    text = sentences(data)
    encoded = {lang: [json.dumps(s, ensure_ascii=False) for s in lines] for lang, lines in text.items()}
    n = len(text["en"])
    out.mkdir(parents=True, exist_ok=True)
    per_direction = pairs // n_directions
    paths = []
    for d, (src, tgt) in enumerate(directions(n_directions)):
        rng = np.random.default_rng([seed, d])
        for k, start in enumerate(range(0, per_direction, shard_pairs)):
            count = min(shard_pairs, per_direction - start)
            first = rng.integers(0, n, count)
            second = np.where(rng.random(count) < 1 / 3, rng.integers(0, n, count), -1)
            lines = []
            for i, j in zip(first.tolist(), second.tolist()):
                s, t = encoded[src][i], encoded[tgt][i]
                if j >= 0:  # two sentences in one pair: join inside the JSON strings
                    s, t = s[:-1] + " " + encoded[src][j][1:], t[:-1] + " " + encoded[tgt][j][1:]
                lines.append(f'{{"translation": {{"{src}": {s}, "{tgt}": {t}}}}}\n')
            path = out / f"train-{src}-{tgt}-{k:05d}.jsonl{'.gz' if compress else ''}"
            payload = "".join(lines).encode()
            if compress:
                with gzip.open(path, "wb", compresslevel=1) as f:
                    f.write(payload)
            else:
                path.write_bytes(payload)
            paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--pairs", type=int, required=True, help="pairs over all directions")
    parser.add_argument("--directions", type=int, default=20)
    parser.add_argument("--shard_pairs", type=int, default=100_000)
    parser.add_argument("--gzip", action="store_true", help="write .jsonl.gz shards")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    paths = write_corpus(Path(args.out), args.pairs, args.directions, args.shard_pairs, args.gzip, args.seed)
    size = sum(p.stat().st_size for p in paths)
    print(f"{args.out}: {len(paths)} shard(s), {args.pairs} pairs, {size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
