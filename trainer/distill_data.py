"""Sequence-level distillation data: `python -m trainer.distill_data`.

    python -m trainer.distill_data --model TEACHER --train_file 'data/shards/train-*.jsonl' \\
        --directions en-de --output_dir data/seqkd [--num_beams 4] [--max_length 128] [--batch_size 32]
    torchrun --nproc-per-node 4 -m trainer.distill_data --model OUT/checkpoint-STEP \\
        --train_file 'data/shards/*.jsonl.gz' --directions en-de de-en --output_dir data/seqkd \\
        --pipeline_parallel_size 2 --tensor_parallel_size 2

The teacher (an exported HF directory, or a training checkpoint decoded on the mesh) translates
the source side of every record of every shard for each direction; each input shard becomes an
output shard of the same name in --output_dir, records `{"translation": {src: source, tgt:
teacher's translation}}`, which `trainer.train --streaming true --train_file 'data/seqkd/*'`
trains on as they are. A shard's output is written to a temporary name and renamed when complete:
a finished shard is never redone, so a killed run is rerun as it was, and a rerun of a finished one
does nothing. Bad input (flags, shards, directions, a language without a tag, a mesh that does not
fit) fails with one line on stderr, exit 2, before any weight is read; under torchrun rank 0
reports it.

This module parses the flags and calls the library: `trainer.eval.seqkd`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from transformers import HfArgumentParser

from trainer.errors import BAD_INPUT
from trainer.eval.seqkd import DistillDataArguments, run


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input, reported on stderr in one line)."""
    parser = HfArgumentParser(DistillDataArguments)  # type: ignore[arg-type]
    (args,) = parser.parse_args_into_dataclasses(args=None if argv is None else list(argv))
    try:
        counts = run(args)
    except BAD_INPUT as e:
        from trainer.eval.hf_translate import RankError

        if isinstance(e, RankError) or os.environ.get("RANK", "0") == "0":
            print(f"trainer.distill_data: error: {e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(
            f"trainer.distill_data: {counts['pairs']} pairs written to {args.output_dir}; "
            f"{counts['done_before']} of {counts['shards']} shard(s) were finished before; "
            f"{counts['unused_records']} record(s) held no direction's pair",
            file=sys.stderr,
        )
        if counts["empty_translations"] or counts["shards_not_written"]:
            print(
                f"trainer.distill_data: warning: {counts['empty_translations']} of the teacher's translations "
                f"were empty and are left out (training would skip them); "
                f"{counts['shards_not_written']} shard(s) held no pair and were not written",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
