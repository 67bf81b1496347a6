"""Translate stdin to stdout with an exported model: `python -m trainer.translate`.

    python -m trainer.translate --model DIR --source_lang en --target_lang fr \\
        [--num_beams 4] [--max_length 128] [--batch_size 32] < in.txt > out.txt

DIR is a Hugging Face directory as `trainer.export` writes it (config.json,
model.safetensors, tokenizer files; stock M2M100/NLLB directories work too). The
weights load into our own `M2M100Translation` and decode with `models.generate`
(equal to `transformers`' `generate`); the tokenizer loads through
`trainer.tokenizer.Tokenizer.load`, i.e. `AutoTokenizer` for HF tokenizer files. One
output line per input line, in order; bad input fails with one line on stderr, exit 2.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from transformers import HfArgumentParser

from models.hf import CheckpointMismatchError, load_hf_weights, load_into, read_hf_config
from models.m2m100 import M2M100Translation
from trainer.evaluate import translate
from trainer.tokenizer import Tokenizer, TokenizerError


@dataclass
class TranslateArguments:
    """Command-line arguments of `python -m trainer.translate`."""

    model: str = field(
        metadata={
            "help": "Exported Hugging Face directory (config.json, model.safetensors, tokenizer files)."
        }
    )
    source_lang: str = field(
        metadata={
            "help": "Source language code; the tokenizer must have its tag "
            "(`en` -> `__en__`; NLLB codes such as `eng_Latn` are their own tag)."
        }
    )
    target_lang: str = field(metadata={"help": "Target language code; forced as the first generated token."})
    num_beams: int = field(default=4, metadata={"help": "Beam width; 1 is greedy search."})
    max_length: int = field(
        default=128,
        metadata={"help": "Most output tokens per line, the start token and language tag included."},
    )
    batch_size: int = field(default=32, metadata={"help": "Sentences decoded together (sorted by length)."})
    max_source_length: int | None = field(
        default=None, metadata={"help": "Cut longer sources to this many tokens (tag and </s> included)."}
    )
    device: str = field(
        default="auto", metadata={"help": "cpu, cuda, cuda:N, or auto (cuda when available)."}
    )


class TranslateError(ValueError):
    """Bad command-line input; the message names the bad value and what is valid."""


def pick_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_model_dir(path: str | Path) -> None:
    """Fail early and clearly on a wrong `--model`.

    Raises:
        TranslateError: `path` is not a directory.
    """
    if not Path(path).is_dir():
        raise TranslateError(
            f"--model {str(path)!r} is not a directory; expected an exported Hugging Face model directory "
            "(config.json, model.safetensors, tokenizer files)"
        )


def load_model(path: str | Path, device: torch.device) -> M2M100Translation:
    """Our model with the weights of an HF directory, in eval mode on `device`.

    Raises:
        TranslateError: `path` is not a directory.
        CheckpointMismatchError: no config.json / safetensors, or weights that do not fit.
    """
    check_model_dir(path)
    model = M2M100Translation(read_hf_config(path))
    load_into(model, load_hf_weights(path))
    return model.to(device).eval()


def parse_args(argv: Sequence[str] | None) -> TranslateArguments:
    parser = HfArgumentParser(TranslateArguments)  # type: ignore[arg-type]
    (args,) = parser.parse_args_into_dataclasses(args=None if argv is None else list(argv))
    return args


def utf8(stream: TextIO) -> TextIO:
    """The real stdin/stdout as UTF-8 whatever the locale says (translations are multilingual)."""
    if isinstance(stream, io.TextIOWrapper):
        stream.reconfigure(encoding="utf-8")
    return stream


def run(args: TranslateArguments, stdin: TextIO, stdout: TextIO) -> None:
    """Load, read every line of `stdin`, write one translation per line to `stdout`.

    Raises:
        TranslateError, CheckpointMismatchError, TokenizerError: bad model dir or language.
    """
    check_model_dir(args.model)
    # Tags first: a missing language should fail before the (slow) weight loading.
    tokenizer = Tokenizer.load(args.model, languages=[args.source_lang, args.target_lang])
    model = load_model(args.model, pick_device(args.device))
    lines = stdin.read().splitlines()
    hyps = translate(
        model,
        tokenizer,
        lines,
        args.source_lang,
        args.target_lang,
        num_beams=args.num_beams,
        max_length=args.max_length,
        batch_size=args.batch_size,
        max_source_length=args.max_source_length,
    )
    for hyp in hyps:
        stdout.write(hyp.replace("\n", " ") + "\n")  # keep lines aligned with the input
    stdout.flush()


def main(argv: Sequence[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input, reported on stderr in one line)."""
    args = parse_args(argv)
    try:
        run(args, stdin or utf8(sys.stdin), stdout or utf8(sys.stdout))
    except (TranslateError, CheckpointMismatchError, TokenizerError) as e:
        print(f"trainer.translate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
