"""Sequence-level distillation data (the library of `python -m trainer.distill_data`).

Kim & Rush (2016): the student trains on the teacher's beam-search translations instead of the
references. A sharded JSON-lines corpus (docs/data.md's streaming layout) is decoded by the
teacher on a mesh into shards of the same layout, one output shard per input shard, under the
same name in `--output_dir`; `streaming: true` then trains on them as they are.

    check_inputs    every check that needs no peer and reads no weight (one line each, on every
                    rank alike): flags, mesh, directions, the shards (JSON lines), the output
                    directory, the teacher (`trainer.eval.scoring.model_source`: an HF directory
                    or a checkpoint of this trainer) and its tags
    distill_corpus  on the mesh (`trainer.eval.scoring`'s loading): rank 0 lists the shards whose
                    output is missing; for each, every rank reads its records, each direction's
                    sources are decoded by `trainer.eval.runner.translate_on_mesh` (the dp replicas
                    share the batches) and rank 0 writes the records {src: source, tgt: translation}
                    to `.<name>.tmp`, renamed to `<name>` when complete

A shard whose output exists is finished and never redone, so a killed run reruns from the first
unfinished shard and a rerun of a finished one does nothing; a half-written temporary file is
overwritten. A record yields one pair per direction whose two languages it holds (a record
{en, de} under `--directions en-de de-en` gives en -> de' and de -> en'); unreadable lines are
skipped and counted (`trainer.data.shards.PieceReader`), records without a direction's source
or target skipped (the target marks the pairs the corpus has for that direction). An empty
translation (an untrained teacher's end-of-sentence first) is left out and counted, as training
would skip the pair; a shard left with no pair is not written, and a run
that wrote nothing but empty translations fails in one line.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.data.shards import JSON_SUFFIXES, PieceReader, Shard, resolve_shards, split_pieces
from trainer.errors import BadInputError
from trainer.eval.flores import languages_of, parse_directions
from trainer.eval.hf_translate import TranslateArguments, check_model_fits, mesh_dims, search_settings
from trainer.progress import Progress
from trainer.tokenizer.vocab import Tokenizer

if TYPE_CHECKING:
    from parallel.parallelize import ParallelModel
    from trainer.eval.scoring import Plan


def _like_translate(name: str) -> Any:
    f = next(f for f in fields(TranslateArguments) if f.name == name)
    return field(default=f.default, metadata=f.metadata)


@dataclass
class DistillDataArguments:
    """Command-line arguments of `python -m trainer.distill_data`."""

    model: str = field(
        metadata={
            "help": "The teacher: an exported Hugging Face M2M100/NLLB(-MoE) directory, or a training "
            "checkpoint OUTPUT_DIR/checkpoint-<step> (its tokenizer: the run's, unless --tokenizer)."
        }
    )
    train_file: list[str] = field(
        metadata={"help": "The corpus: JSON-lines shards (.jsonl / .jsonl.gz), paths or globs."}
    )
    output_dir: str = field(metadata={"help": "Where the output shards go, under the input shards' names."})
    directions: list[str] = field(
        metadata={"help": "Directions to distil, SRC-TGT in the model's codes: en-de de-en ..."}
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "A checkpoint's tokenizer directory; default: the run's tokenizer/ beside it."},
    )
    max_bad_record_fraction: float = field(
        default=0.01, metadata={"help": "Stop on a shard with more unreadable lines than this share."}
    )
    num_beams: int = _like_translate("num_beams")
    max_length: int = _like_translate("max_length")
    batch_size: int = _like_translate("batch_size")
    max_source_length: int | None = _like_translate("max_source_length")
    dtype: str = _like_translate("dtype")
    device: str = _like_translate("device")
    pipeline_parallel_size: int = _like_translate("pipeline_parallel_size")
    tensor_parallel_size: int = _like_translate("tensor_parallel_size")
    data_parallel_size: int = _like_translate("data_parallel_size")
    expert_parallel_size: int = _like_translate("expert_parallel_size")
    disable_tqdm: bool = field(default=False, metadata={"help": "No progress bar (on stderr)."})

    def evaluate_args(self) -> Any:
        """The same flags as `trainer.evaluate` takes them (its model loading and checks)."""
        from trainer.eval.scoring import EvaluateArguments

        shared = {f.name: getattr(self, f.name) for f in fields(EvaluateArguments) if hasattr(self, f.name)}
        return EvaluateArguments(**{**shared, "data_dir": "", "directions": self.directions})


class DistillDataError(BadInputError):
    """Bad input to `python -m trainer.distill_data`; the message names the bad value."""


def check_shards(spec: Sequence[str], languages: Sequence[str]) -> list[Shard]:
    """The input shards, JSON lines only (the output keeps each one's name and compression).

    Raises:
        DataError: a missing, empty or unreadable shard (`resolve_shards`).
        DistillDataError: a shard that is not JSON lines.
    """
    shards = resolve_shards(list(spec), languages, "--train_file")
    for shard in shards:
        if not shard.path.endswith(JSON_SUFFIXES):
            raise DistillDataError(
                f"--train_file: {shard.path!r} is not JSON lines; distill_data reads and writes "
                f"{list(JSON_SUFFIXES)} shards"
            )
    names = [Path(s.path).name for s in shards]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise DistillDataError(f"--train_file: shards of the same name in different directories: {twice}")
    return shards


def check_inputs(args: DistillDataArguments, world: int) -> tuple[Plan, list[Shard]]:
    """Every check that needs no peer and reads no weight (module docstring).

    Raises:
        BadInputError subclasses, CheckpointMismatchError, ParallelConfigError: one line each.
    """
    import torch

    from trainer.eval.hf_translate import resolve_dtype
    from trainer.eval.scoring import Plan, model_code, model_source

    decode = args.evaluate_args().decoding()
    dims, settings = mesh_dims(decode, world), search_settings(decode)
    directions = parse_directions(args.directions, None)
    shards = check_shards(args.train_file, languages_of(directions))
    out = Path(args.output_dir)
    if out.exists() and not out.is_dir():
        raise DistillDataError(f"--output_dir {args.output_dir!r} exists and is not a directory")
    inputs = {Path(s.path).resolve().parent for s in shards}
    if out.resolve() in inputs:
        raise DistillDataError(
            f"--output_dir {args.output_dir!r} holds the input shards: it would overwrite them"
        )
    checkpoint, config, tok_dir = model_source(args.evaluate_args())
    dtype = resolve_dtype(args.dtype, args.model) if checkpoint is None else torch.float32
    balance = check_model_fits(dims, config)
    tokenizer = Tokenizer.load(tok_dir, languages=languages_of(directions))
    codes = {lang: model_code(tokenizer, lang, tok_dir) for lang in languages_of(directions)}
    plan = Plan(directions, codes, {}, args.train_file[0], False, checkpoint, config, tokenizer, dims,
                balance, settings, dtype)  # fmt: skip
    return plan, shards


def output_path(out: Path, shard: Shard) -> Path:
    return out / Path(shard.path).name


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


def read_records(shard: Shard, max_bad: float) -> list[dict[str, Any]]:
    """The shard's records ({lang: text}), unreadable lines skipped and counted."""
    records = []
    for piece in split_pieces([shard]):
        reader = PieceReader(shard, piece, max_bad)
        records += list(reader)
        reader.finish()
    return records


def write_shard(path: Path, pairs: list[tuple[str, str, str, str]]) -> None:
    """Records {"translation": {src: source, tgt: translation}} to `path`, whole or not at all
    (a temporary file renamed when complete); gzip where the name ends in .gz."""
    tmp = _temporary(path)
    opener: Any = gzip.open if path.name.endswith(".gz") else open
    with opener(tmp, "wt", encoding="utf-8") as f:
        for src, tgt, source, hyp in pairs:
            f.write(json.dumps({"translation": {src: source, tgt: hyp}}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def distill_shard(
    pm: ParallelModel, plan: Plan, args: DistillDataArguments, shard: Shard, bar: Progress
) -> tuple[list[tuple[str, str, str, str]] | None, int, int]:
    """One shard decoded on the mesh (collective): its pairs on rank 0 (None elsewhere), the
    records no direction could use, and the empty translations left out (rank 0's count)."""
    from trainer.eval.runner import translate_on_mesh

    records = read_records(shard, args.max_bad_record_fraction)
    pairs: list[tuple[str, str, str, str]] = []
    used = [False] * len(records)
    mine = True
    empty = 0
    for src, tgt in plan.directions:
        rows = [i for i, r in enumerate(records) if _text(r, src) and _text(r, tgt)]
        sources = [_text(records[i], src) for i in rows]
        for i in rows:
            used[i] = True
        hyps = translate_on_mesh(
            pm, plan.tokenizer, sources, plan.model_codes[src], plan.model_codes[tgt], plan.settings, args.batch_size, dst=0,
            max_source_length=args.max_source_length, on_batch=bar.update,
        )  # fmt: skip
        if hyps is None:
            mine = False
            continue
        kept = [(src, tgt, s, h.strip()) for s, h in zip(sources, hyps) if h.strip()]
        pairs += kept
        empty += len(sources) - len(kept)
    return (pairs if mine else None), used.count(False), empty


def _text(record: dict[str, Any], lang: str) -> str:
    value = record.get(lang)
    return value.strip() if isinstance(value, str) else ""


def distill_corpus(
    args: DistillDataArguments, plan: Plan, shards: list[Shard], pm: ParallelModel
) -> dict[str, int]:
    """Decode every unfinished shard (collective); returns the counts on every rank (rank 0's)."""
    import torch.distributed as dist

    out = Path(args.output_dir)
    rank = dist.get_rank()
    todo: list[Any] = [None]
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        todo[0] = [i for i, s in enumerate(shards) if not output_path(out, s).is_file()]
    dist.broadcast_object_list(todo, src=0)
    counts = {
        "shards": len(shards),
        "done_before": len(shards) - len(todo[0]),
        "pairs": 0,
        "unused_records": 0,
        "empty_translations": 0,
        "shards_not_written": 0,
    }
    if rank == 0:
        print(
            f"trainer.distill_data: {len(todo[0])} of {len(shards)} shard(s) to decode "
            f"({counts['done_before']} finished before), directions {[f'{s}-{t}' for s, t in plan.directions]}, "
            f"{plan.settings.num_beams} beam(s), on (pp, dp, tp) = {plan.dims.shape}",
            file=sys.stderr,
            flush=True,
        )
    total = sum(shards[i].records for i in todo[0]) * len(plan.directions)
    with Progress(total, "distill", "pair", enabled=rank == 0, bar=not args.disable_tqdm) as bar:
        for i in todo[0]:
            pairs, unused, empty = distill_shard(pm, plan, args, shards[i], bar)
            counts["unused_records"] += unused
            counts["empty_translations"] += empty
            if pairs:
                write_shard(output_path(out, shards[i]), pairs)
                counts["pairs"] += len(pairs)
            elif pairs is not None:  # no pair: an empty shard would stop the trainer's reader
                counts["shards_not_written"] += 1
    if rank == 0 and todo[0] and not counts["pairs"] and counts["empty_translations"]:
        raise DistillDataError(
            f"--model {args.model!r}: all {counts['empty_translations']} of the teacher's translations "
            "are empty, nothing was written: is it a trained teacher (its checkpoint, with the tokenizer "
            "it was trained with)?"
        )
    return counts


def run(args: DistillDataArguments) -> dict[str, int]:
    """Check, load the teacher on the mesh, decode every unfinished shard; returns the counts.

    Raises:
        See `check_inputs`; `RankError` for a failure one rank meets after the group is up.
    """
    import torch.distributed as dist

    from models.hf import CheckpointMismatchError
    from parallel.mesh import build_mesh, init_distributed
    from trainer.eval.hf_translate import RankError, load_on_mesh, mesh_device
    from trainer.eval.scoring import load_checkpoint_on_mesh

    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan, shards = check_inputs(args, world)
    device = mesh_device(args.device)
    owned = not dist.is_initialized()
    init_distributed("nccl" if device.type == "cuda" else "gloo")
    try:
        mesh = build_mesh(plan.dims, device.type)
        if plan.checkpoint is None:
            pm = load_on_mesh(args.model, plan.config, mesh, plan.balance, device, plan.dtype)
        else:
            pm = load_checkpoint_on_mesh(plan.checkpoint, plan.config, mesh, plan.balance, device, plan.dtype)
        return distill_corpus(args, plan, shards, pm)
    except CheckpointMismatchError as e:
        raise RankError(f"rank {dist.get_rank()}: {e}") from e
    finally:
        if owned:
            dist.destroy_process_group()
