"""What the docs' commands need that this machine lacks, made small: run by doc-test markers.

    python -m tests.dist.doc_fixtures hf download REPO_ID [--local-dir DIR]
        the `hf` command of the doc tests (no network): a tiny model of REPO_ID's family with
        random weights (NLLB-MoE where the name says "moe", else dense NLLB-200), NLLB's codes
        as its tags, written where huggingface_hub's cache (HF_HUB_CACHE) keeps REPO_ID's
        snapshot, so `model_name_or_path: REPO_ID` with HF_HUB_OFFLINE=1 finds it, or to DIR.
        With DOC_TEST_HF_SHAPE=configs/X.yaml: that config's architecture in config.json and no
        weights (a model too large to build here, for `check:` blocks, which read no weights)
    python -m tests.dist.doc_fixtures jsonl DIR CODE [CODE ...]
        DIR/train.jsonl and DIR/valid.jsonl in the HF translation format, keys CODE (`eng_Latn`,
        `en`), text from the built-in corpus
    python -m tests.dist.doc_fixtures texts DIR CODE [CODE ...]
        multi30k's layout: DIR/train.CODE.gz and DIR/val.CODE.gz, line i of each the same
        sentence, text from the built-in corpus (scripts/distill_recipe.py's --data)
    python -m tests.dist.doc_fixtures flores DIR CODE [CODE ...] [--pattern '{lang}.txt']
        a FLORES-style directory: DIR/devtest/CODE.devtest (or DIR/<pattern>), line i of each the
        same sentence

The tiny architecture mirrors tests/dist/rehearsal.py's cut (d_model 32, 2 + 2 layers, FFN 64).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from pathlib import Path

NLLB_CODES = ("eng_Latn", "deu_Latn", "fra_Latn", "ces_Latn")  # the shipped NLLB configs' languages
CORPUS_SIZE = 120
VOCAB = 256


def _iso(code: str) -> str:
    from tests.dist.rehearsal import builtin_language

    return builtin_language(code)


def _corpus(codes: list[str]) -> dict[str, list[dict[str, str]]]:
    from trainer.data.corpus import build_builtin_corpus

    iso = {code: _iso(code) for code in codes}
    corpus = build_builtin_corpus(sorted(set(iso.values())), CORPUS_SIZE, 1)
    return {split: [{c: rec[iso[c]] for c in codes} for rec in recs] for split, recs in corpus.items()}


def tiny_nllb(out: Path, moe: bool) -> None:
    """A tiny NLLB (or NLLB-MoE) directory: our NllbTokenizer files and random weights."""
    from models.config import ModelConfig
    from models.hf_save import save_hf_model
    from models.m2m100 import M2M100Translation
    from trainer.tokenizer.vocab import train_tokenizer

    texts = [t for rec in _corpus(list(NLLB_CODES))["train"] for t in rec.values()]
    tok = train_tokenizer(texts, list(NLLB_CODES), VOCAB, seed=0)
    tok.save_pretrained(out)
    arch = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                max_position_embeddings=128)  # fmt: skip
    if moe:
        arch.update(num_experts=4, encoder_sparse_step=2, decoder_sparse_step=2)
    mc = ModelConfig(vocab_size=tok.vocab_size, **arch, **tok.special_ids())  # type: ignore[arg-type]
    save_hf_model(M2M100Translation(mc).state_dict(), mc, out)


def shape_only(out: Path, config: Path) -> None:
    """config.json with `config`'s architecture (its model fields), tiny NLLB tokenizer files, no weights."""
    from dataclasses import fields

    import yaml

    from models.config import ModelConfig
    from models.hf_save import write_hf_config
    from trainer.tokenizer.vocab import train_tokenizer

    texts = [t for rec in _corpus(list(NLLB_CODES))["train"] for t in rec.values()]
    tok = train_tokenizer(texts, list(NLLB_CODES), VOCAB, seed=0)
    tok.save_pretrained(out)
    file = yaml.safe_load(config.read_text())
    names = {f.name for f in fields(ModelConfig)} - set(tok.special_ids())
    write_hf_config(ModelConfig(**{k: v for k, v in file.items() if k in names and v is not None}), out)


def hf_download(repo_id: str, local_dir: str | None) -> Path:
    """`hf download REPO_ID`: the snapshot layout huggingface_hub's cache uses, offline."""
    if local_dir:
        out = Path(local_dir)
    else:
        from huggingface_hub import constants

        repo = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
        commit = hashlib.sha1(repo_id.encode()).hexdigest()
        out = repo / "snapshots" / commit
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    out.mkdir(parents=True, exist_ok=True)
    shape = os.environ.get("DOC_TEST_HF_SHAPE")
    if shape:
        shape_only(out, Path(shape))
    else:
        tiny_nllb(out, moe="moe" in repo_id.lower())
    print(out)
    return out


def write_jsonl(out: Path, codes: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    corpus = _corpus(codes)
    for split, name in (("train", "train.jsonl"), ("validation", "valid.jsonl")):
        rows = [json.dumps({"translation": r}, ensure_ascii=False) for r in corpus[split]]
        (out / name).write_text("\n".join(rows) + "\n")


def write_texts(out: Path, codes: list[str]) -> None:
    """multi30k's layout: train.CODE.gz, val.CODE.gz (line-aligned)."""
    import gzip

    out.mkdir(parents=True, exist_ok=True)
    corpus = _corpus(codes)
    for split, name in (("train", "train"), ("validation", "val")):
        for code in codes:
            with gzip.open(out / f"{name}.{code}.gz", "wt", encoding="utf-8") as f:
                f.write("".join(r[code] + "\n" for r in corpus[split]))


def write_flores(out: Path, codes: list[str], pattern: str = "devtest/{lang}.devtest") -> None:
    recs = _corpus(codes)["validation"][:8]
    for code in codes:
        path = out / pattern.format(lang=code)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(r[code] + "\n" for r in recs))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="doc_fixtures", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    hf = sub.add_parser("hf")
    hf.add_argument("command", choices=["download"])
    hf.add_argument("repo_id")
    hf.add_argument("--local-dir", "--local_dir", dest="local_dir")
    for name in ("jsonl", "texts", "flores"):
        p = sub.add_parser(name)
        p.add_argument("dir")
        p.add_argument("codes", nargs="+")
    p.add_argument("--pattern", default="devtest/{lang}.devtest")
    args = parser.parse_args(argv)
    if args.what == "hf":
        hf_download(args.repo_id, args.local_dir)
    elif args.what == "jsonl":
        write_jsonl(Path(args.dir), args.codes)
    elif args.what == "texts":
        write_texts(Path(args.dir), args.codes)
    else:
        write_flores(Path(args.dir), args.codes, args.pattern)


if __name__ == "__main__":
    main()
