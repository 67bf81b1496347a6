"""Export a training checkpoint as a Hugging Face directory: `python -m trainer.export`.

    python -m trainer.export --checkpoint OUT/checkpoint-STEP --output DIR \\
        [--num_beams 4] [--max_length 128] [--tokenizer OUT/tokenizer] [--overwrite] \\
        [--max_shard_size 5GB] [--dtype fp32|bf16|fp16]

Reads a DCP checkpoint written on any (pp, dp, tp) mesh in one process, with no
process group, a shard at a time: DCP's metadata gives every "model" tensor's logical
shape (tp shards were saved as DTensors of logical shape), the tensors are grouped into
output shards of at most --max_shard_size bytes (`transformers` semantics), and each
shard's tensors alone are loaded by DCP into empty tensors of those shapes, converted and
written before the next is read, so host memory holds about a shard, never the model.
Optimizer state is ignored.

DIR receives config.json (with the weights' --dtype), model.safetensors (or
model-0000k-of-0000n.safetensors and model.safetensors.index.json), generation_config.json
(decoder_start / eos / pad / bos ids, num_beams, max_length) and the tokenizer
files that stock `AutoTokenizer` loads (from the run's `tokenizer/`, by default
the checkpoint's parent directory's; `model_max_length` is the model's
`max_position_embeddings`). A run whose tags are all stock M2M100 codes (`__en__`)
becomes a stock M2M100 checkpoint: `M2M100Tokenizer` (`tok.src_lang = "en"`) and the
vocabulary permuted to its ids (`trainer.tokenizer.stock_m2m100`); other runs keep their ids (an
`NllbTokenizer`, see `trainer.tokenizer.hf_format`). transformers 4.46+ and 5.x load both
(checked by `tests/unit/test_hf_tokenizer.py` with `scripts/check_hf_export.py`). Everything is written into a temporary
directory beside DIR and renamed at the end, so a failure leaves no half-written
export. Bad input fails with one line on stderr and exit status 2. Progress goes to stderr: what
is read and written, then a bar over the bytes converted (`TQDM_DISABLE=1`: a line every 30 s).

This module parses the flags and calls the library: `trainer.checkpoint.hf_export`.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from trainer.checkpoint.hf_export import ExportArguments, export
from trainer.config.flags import build_parser, parse_dataclasses
from trainer.errors import BAD_INPUT


def parse_args(argv: Sequence[str] | None) -> ExportArguments:
    """The flags as `ExportArguments`.

    Raises:
        ConfigError: an unknown flag (with a hint), a bad value or a missing one, in one line.
    """
    parser = build_parser([ExportArguments], description=__doc__.splitlines()[0] if __doc__ else None)
    (args,) = parse_dataclasses(parser, list(sys.argv[1:] if argv is None else argv))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input, reported on stderr in one line)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        args = parse_args(argv)
        out = export(args)
    except BAD_INPUT as e:  # ExportError, ConfigError (flags), CheckpointMismatchError, TokenizerError, ...
        print(f"trainer.export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
