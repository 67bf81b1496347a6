"""Translate stdin to stdout with an exported model: `python -m trainer.translate`.

    python -m trainer.translate --model DIR --source_lang en --target_lang fr \\
        [--num_beams 4] [--max_length 128] [--batch_size 32] < in.txt > out.txt
    torchrun --nproc-per-node 4 -m trainer.translate --model DIR --source_lang en \\
        --target_lang fr --pipeline_parallel_size 2 --tensor_parallel_size 2 < in.txt > out.txt

DIR is a Hugging Face directory as `trainer.export` writes it (config.json,
model.safetensors, tokenizer files; stock M2M100/NLLB directories work too); the
tokenizer loads through `trainer.tokenizer.vocab.Tokenizer.load`, i.e. `AutoTokenizer` for HF
tokenizer files. One output line per input line, in order (a blank line gives an empty
one); bad input fails with one line on stderr, exit 2. A direction the export's record
(`trained_language_pairs` in config.json) lacks is translated after one warning line on stderr.
The directory's generation_config.json `bad_words_ids` (one token each) and
`renormalize_logits` apply, as in `generate`: an export keeps the stock M2M100 rows its run
never had out of decoding with them. Progress goes to stderr (rank 0 under torchrun): what is translated, then a
bar over the lines (`TQDM_DISABLE=1`: a line every 30 s).

One process: our own `M2M100Translation` is built on the meta device and each tensor of the
directory read once into it on one device (`parallel.materialize`); it decodes with
`models.generate` (equal to `transformers`' `generate`).

Under torchrun (WORLD_SIZE > 1) no device holds the whole model: the ranks form the
(pp, dp, tp) mesh of `parallel.mesh`, the model is cut into pp stages (uniform by
blocks) and split over tp by `parallel.parallelize.build_parallel_model`, and decodes
with `parallel.generate.pipeline_generate` (per-stage KV caches, the same tokens as one
device) through `trainer.eval.runner.translate_on_mesh`: the dp replicas share
the length-sorted batches. Rank 0 reads stdin, writes stdout and logs the mesh on
stderr; the other ranks write nothing. Bad sizes or flags fail on every rank before
the process group exists.

This module parses the flags and calls the library: `trainer.eval.hf_translate`.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from models.hf import CheckpointMismatchError
from trainer.config.flags import build_parser, parse_dataclasses
from trainer.errors import ConfigError, TokenizerError
from trainer.eval.hf_translate import RankError, TranslateArguments, TranslateError, run, utf8


def parse_args(argv: Sequence[str] | None) -> TranslateArguments:
    """The flags as `TranslateArguments`.

    Raises:
        ConfigError: an unknown flag (with a hint), a bad value or a missing one, in one line.
    """
    parser = build_parser([TranslateArguments], description=__doc__.splitlines()[0] if __doc__ else None)
    (args,) = parse_dataclasses(parser, list(sys.argv[1:] if argv is None else argv))
    return args


def main(argv: Sequence[str] | None = None, stdin: TextIO | None = None, stdout: TextIO | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input, reported on stderr in one line).

    Under torchrun an error every rank meets alike (flags, files, languages) is printed by
    rank 0 only; a `RankError` by the rank that met it.
    """
    rank0 = os.environ.get("RANK", "0") == "0"  # the others say nothing but their errors
    logging.basicConfig(level=logging.INFO if rank0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    try:
        args = parse_args(argv)
        run(args, stdin or utf8(sys.stdin), stdout or utf8(sys.stdout))
    except (ConfigError, TranslateError, CheckpointMismatchError, TokenizerError) as e:
        if isinstance(e, RankError) or os.environ.get("RANK", "0") == "0":
            print(f"trainer.translate: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
