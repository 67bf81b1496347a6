"""Score a model on a FLORES-style directory: `python -m trainer.evaluate`.

    python -m trainer.evaluate --model DIR --data_dir flores200_dataset \\
        --languages eng_Latn deu_Latn fra_Latn [--output_dir OUT] [--num_beams 4] [--batch_size 32]
    torchrun --nproc-per-node 4 -m trainer.evaluate --model OUT/checkpoint-STEP --data_dir DATA \\
        --file_pattern '{lang}.txt' --directions en-de de-en --pipeline_parallel_size 2 \\
        --tensor_parallel_size 2 --output_dir OUT/eval

DIR is an exported Hugging Face M2M100/NLLB directory (as `trainer.translate --model` takes) or a
training checkpoint (decoded on the mesh, one rank without torchrun). The data directory holds
one file per language, line i of every file the same sentence: FLORES-200's
`devtest/eng_Latn.devtest` is found by default, other layouts are named by --file_pattern.
--directions lists SRC-TGT pairs; --languages scores every ordered pair. A code may be the
model's (`en`, `eng_Latn`) or the same language's in the other convention: an M2M100 model reads
FLORES-200's `eng_Latn.devtest` for `en` (`trainer.tokenizer.lang_codes`). Directions the model's
record says it never trained are scored after one warning line.

Prints a markdown table (per direction: sentences, BLEU, chrF, chrF++, and spBLEU where sacreBLEU's
flores200 model is in its cache; then the averages into English, out of English, non-English and
over all directions) and, with --output_dir, writes it as scores.md and scores.json beside
predictions_<src>-<tgt>.txt. A progress bar on stderr counts sentences (--disable_tqdm). Bad
input (a missing language file, files of different line counts, a malformed direction, a
language the model has no tag for, a mesh that does not fit) fails with one line on stderr,
exit 2, before any weight is read; under torchrun rank 0 reports it.

This module parses the flags and calls the library: `trainer.eval.scoring`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TextIO

from trainer.config.flags import build_parser, parse_dataclasses
from trainer.errors import BAD_INPUT
from trainer.eval.hf_translate import utf8
from trainer.eval.scoring import EvaluateArguments, RankError, run


def parse_args(argv: Sequence[str] | None) -> EvaluateArguments:
    """The flags as `EvaluateArguments`.

    Raises:
        ConfigError: an unknown flag (with a hint), a bad value or a missing one, in one line.
    """
    parser = build_parser([EvaluateArguments], description=__doc__.splitlines()[0] if __doc__ else None)
    (args,) = parse_dataclasses(parser, list(sys.argv[1:] if argv is None else argv))
    return args


def main(argv: Sequence[str] | None = None, stdout: TextIO | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input, reported on stderr in one line)."""
    try:
        args = parse_args(argv)
        run(args, stdout or utf8(sys.stdout))
    except BAD_INPUT as e:
        if isinstance(e, RankError) or os.environ.get("RANK", "0") == "0":
            print(f"trainer.evaluate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
