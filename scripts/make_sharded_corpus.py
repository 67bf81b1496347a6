"""Write a sharded many-direction JSON-lines corpus of real text, for the data benchmark and tests.

    python scripts/make_sharded_corpus.py --out /tmp/corpus --pairs 1000000 [--directions 20]
        [--shard_pairs 100000] [--gzip] [--seed 0] [--data_dir DIR | --data_dir builtin]

Texts are multi30k sentences (en, de, fr, cs) and a fifth pseudo-language `xx` (the English
sentence with its words reversed), so 5 languages give up to 20 directions. `--data_dir` is a
folder of multi30k's task-1 raw files (`train.{en,de,fr,cs}.gz`; MULTI30K_SOURCE); by
default the `../shared/data/multi30k` beside the clone. `--data_dir builtin` takes the sentences
from the built-in corpus instead (trainer/data/corpus.py: numbers, dates, CLDR names; offline).
A pair is one aligned sentence, joined to a second one a third of the time (longer pairs).
Shards are `train-<src>-<tgt>-<k>.jsonl[.gz]`, the same number of pairs per direction, records
`{"translation": {"<src>": ..., "<tgt>": ...}}`. Deterministic given the arguments.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # trainer.data.corpus, for --data_dir builtin, without an install
BESIDE_CLONE = ROOT.parent / "shared" / "data" / "multi30k"  # where CI keeps a copy
MULTI30K_SOURCE = "https://github.com/multi30k/dataset, data/task1/raw"
BUILTIN = "builtin"
BUILTIN_ITEMS = 5_000  # sentences per language when --data_dir builtin (multi30k has 29,000)
LANGUAGES = ("en", "de", "fr", "cs", "xx")


def multi30k_dir(data_dir: str | None, files: Sequence[str], hint: str = "") -> Path:
    """The multi30k folder a script reads: `data_dir`, else the copy beside the clone.

    Args:
        data_dir: the `--data_dir` value, or None for the default.
        files: the file names the script needs there.
        hint: appended to the error line (another way out, if the script has one).

    Returns:
        The folder.

    Raises:
        SystemExit: exit status 2, after one line naming the folder, the missing file and where
            multi30k comes from.
    """
    path = Path(data_dir) if data_dir is not None else BESIDE_CLONE
    missing = [name for name in files if not (path / name).is_file()]
    if missing:
        flag = (
            f"--data_dir {data_dir}"
            if data_dir is not None
            else f"no --data_dir, and {path} (beside the clone)"
        )
        print(
            f"{Path(sys.argv[0]).name}: {flag} has no {missing[0]}: get multi30k's files "
            f"({MULTI30K_SOURCE}) and pass their folder as --data_dir{hint}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return path


def sentences(data: Path | str) -> dict[str, list[str]]:
    """Aligned sentences per language (multi30k train, or the built-in corpus), `xx` from English."""
    if str(data) == BUILTIN:
        from trainer.data.corpus import SPLITS, build_builtin_corpus

        corpus = build_builtin_corpus(LANGUAGES[:4], BUILTIN_ITEMS, seed=0)
        records = [r for split in SPLITS for r in corpus[split]]
        out = {lang: [r[lang] for r in records] for lang in LANGUAGES[:4]}
    else:
        out = {
            lang: gzip.open(Path(data) / f"train.{lang}.gz", "rt").read().splitlines()
            for lang in LANGUAGES[:4]
        }
    out["xx"] = [" ".join(reversed(s.split())) for s in out["en"]]
    return out


def directions(n: int) -> list[tuple[str, str]]:
    pairs = [(a, b) for a, b in itertools.permutations(LANGUAGES, 2)]
    if n > len(pairs):
        raise SystemExit(f"--directions {n}: at most {len(pairs)}")
    return pairs[:n]


def write_corpus(out: Path, pairs: int, data: Path | str, n_directions: int = 20, shard_pairs: int = 100_000,
                 compress: bool = False, seed: int = 0) -> list[Path]:  # fmt: skip
    """Write the corpus from `data` (a multi30k folder, or `builtin`); returns the shard paths."""
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
    parser.add_argument(
        "--data_dir", default=None,
        help=f"multi30k's train.{{en,de,fr,cs}}.gz ({MULTI30K_SOURCE}); default: ../shared/data/multi30k "
        f"beside the clone; '{BUILTIN}': the built-in corpus",
    )  # fmt: skip
    args = parser.parse_args()
    files = [f"train.{lang}.gz" for lang in LANGUAGES[:4]]
    data = (
        BUILTIN
        if args.data_dir == BUILTIN
        else multi30k_dir(args.data_dir, files, f" (or --data_dir {BUILTIN})")
    )
    paths = write_corpus(
        Path(args.out), args.pairs, data, args.directions, args.shard_pairs, args.gzip, args.seed
    )
    size = sum(p.stat().st_size for p in paths)
    print(f"{args.out}: {len(paths)} shard(s), {args.pairs} pairs, {size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
