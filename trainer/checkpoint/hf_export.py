"""Export a training checkpoint as a Hugging Face directory (the library of `python -m trainer.export`).

Reads the DCP checkpoint in one process a shard at a time (`export_weights`: planned from
DCP's metadata, each output shard's tensors loaded alone), writes config.json, the
safetensors shards (`models.hf_save`), generation_config.json and the tokenizer files into
a temporary directory renamed at the end; the usage and the layout are in `trainer/export.py`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.config import ModelConfig
from models.hf import CheckpointMismatchError, hf_tensors
from models.hf_save import (
    EXPORT_DTYPES,
    parse_shard_size,
    plan_shards,
    tensor_bytes,
    write_hf_config,
    write_shards,
)
from models.m2m100 import M2M100Translation
from models.moe import expert_param_name, is_expert_param
from trainer.checkpoint.commit import (
    COMMIT_MARKER,
    is_complete,
    list_checkpoints,
    pass_a_checkpoint,
    verify_checkpoint,
)
from trainer.checkpoint.directions import RECORD_KEY, run_directions
from trainer.errors import BadInputError
from trainer.progress import Progress, format_bytes
from trainer.tokenizer.stock_m2m100 import (
    StockLayout,
    generation_rules,
    permute_tensor,
    run_layout,
    save_m2m100_tokenizer,
    stock_config,
)
from trainer.tokenizer.vocab import SentencePieceTokenizer, Tokenizer

logger = logging.getLogger("trainer.export")

_MODEL = "model."  # DCP flattens {"model": {fqn: t}} to "model.<fqn>"
_SHARED = "shared.weight"


@dataclass
class ExportArguments:
    """Command-line arguments of `python -m trainer.export`."""

    checkpoint: str = field(
        metadata={"help": "A checkpoint directory `OUTPUT_DIR/checkpoint-<step>` (complete)."}
    )
    output: str = field(metadata={"help": "Destination Hugging Face directory (must not exist or be empty)."})
    num_beams: int = field(default=4, metadata={"help": "Beam width stored in generation_config.json."})
    max_length: int = field(
        default=128, metadata={"help": "Most generated tokens, stored in generation_config.json."}
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "Tokenizer directory; default: the run's `tokenizer/` beside the checkpoint."},
    )
    overwrite: bool = field(default=False, metadata={"help": "Replace a non-empty --output directory."})
    max_shard_size: str = field(
        default="5GB",
        metadata={
            "help": "Largest safetensors file, as in `save_pretrained`: '5GB', '500MB', '200MiB' or "
            "bytes; more weights than that are written as model-0000k-of-0000n.safetensors with "
            "model.safetensors.index.json, reading the checkpoint one shard at a time."
        },
    )
    dtype: str = field(
        default="fp32",
        metadata={"help": f"The exported weights' dtype: {' | '.join(EXPORT_DTYPES)}."},
    )


class ExportError(BadInputError):
    """Bad command-line input; the message names the bad value and what is valid."""


def check_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory, if it exists, its save finished and its files match the marker.

    Raises:
        ExportError: missing, not a directory, a run directory (naming its latest complete checkpoint),
            without `COMMITTED`, without trainer_state.json, or damaged (a file's size or checksum differs from the marker's record).
    """
    p = Path(path)
    if not p.is_dir():
        raise ExportError(
            f"--checkpoint {str(path)!r} is not a directory; expected OUTPUT_DIR/checkpoint-<step>"
        )
    run_dir = pass_a_checkpoint(p, "--checkpoint")  # the run's output_dir, not one of its checkpoints
    if run_dir is not None:
        raise ExportError(run_dir)
    if not is_complete(p):
        valid = [str(c) for c in list_checkpoints(p.parent)]
        raise ExportError(
            f"--checkpoint {str(path)!r} has no {COMMIT_MARKER} marker: its save did not finish "
            f"(incomplete checkpoint); complete ones beside it: {valid}"
        )
    if not (p / "trainer_state.json").is_file():
        raise ExportError(
            f"--checkpoint {str(path)!r} has no trainer_state.json; not a checkpoint of this trainer"
        )
    problem = verify_checkpoint(p)
    if problem is not None:
        raise ExportError(problem)
    return p


def find_tokenizer_dir(checkpoint: Path, explicit: str | None) -> Path:
    """`explicit`, else `<checkpoint>/../tokenizer`.

    Raises:
        ExportError: the directory does not exist.
    """
    tok_dir = Path(explicit) if explicit else checkpoint.parent / "tokenizer"
    if not tok_dir.is_dir():
        raise ExportError(
            f"no tokenizer found at {str(tok_dir)!r} (the run's output_dir/tokenizer); pass --tokenizer DIR"
        )
    return tok_dir


def check_output(path: str | Path, overwrite: bool) -> Path:
    """The output path, if it is absent, empty, or `overwrite` is set.

    Raises:
        ExportError: it is a file, or a non-empty directory without --overwrite.
    """
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ExportError(f"--output {str(path)!r} exists and is not a directory")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        raise ExportError(f"--output {str(path)!r} is not empty; pass --overwrite to replace it")
    return p


def read_model_config(checkpoint: Path) -> ModelConfig:
    """The model config saved with the checkpoint.

    Raises:
        ExportError: trainer_state.json is unreadable or lacks "model_config".
    """
    try:
        state = json.loads((checkpoint / "trainer_state.json").read_text())
        return ModelConfig.from_dict(state["model_config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{checkpoint / 'trainer_state.json'} has no usable model_config: {e}") from None


def export_options(args: ExportArguments) -> tuple[torch.dtype, int]:
    """--dtype and --max_shard_size, checked (the dtype and the shard size in bytes).

    Raises:
        ExportError: an unknown dtype or a size that does not parse, naming what is valid.
    """
    if args.num_beams < 1 or args.max_length < 2:
        raise ExportError(
            f"--num_beams {args.num_beams} must be >= 1 and --max_length {args.max_length} >= 2"
        )
    if args.dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {args.dtype!r} is not supported; valid: {', '.join(EXPORT_DTYPES)}")
    try:
        max_bytes = parse_shard_size(args.max_shard_size)
    except ValueError as e:
        raise ExportError(f"--{e}") from None
    return EXPORT_DTYPES[args.dtype], max_bytes


def export(args: ExportArguments) -> Path:
    """Write the HF directory; returns its path.

    Raises:
        ExportError, CheckpointMismatchError, TokenizerError: bad input (nothing is written).
    """
    dtype, max_bytes = export_options(args)
    ckpt = check_checkpoint(args.checkpoint)
    tok_dir = find_tokenizer_dir(ckpt, args.tokenizer)
    out = check_output(args.output, args.overwrite)
    config = read_model_config(ckpt)
    tokenizer = Tokenizer.load(tok_dir)
    if tokenizer.vocab_size > config.vocab_size:
        raise ExportError(
            f"tokenizer at {str(tok_dir)!r} has {tokenizer.vocab_size} entries but the model "
            f"only {config.vocab_size}; wrong --tokenizer?"
        )
    save_pretrained = getattr(
        tokenizer, "save_pretrained", None
    )  # our SentencePiece and HF tokenizers have it
    if save_pretrained is None:
        raise ExportError(f"tokenizer at {str(tok_dir)!r} ({type(tokenizer).__name__}) cannot write HF files")
    check_stored(stored_model_tensors(ckpt), config, ckpt)  # before anything is written
    generation: dict[str, Any] = {"num_beams": args.num_beams, "max_length": args.max_length}
    max_length = config.max_position_embeddings  # truncation=True cuts there
    own = tokenizer if isinstance(tokenizer, SentencePieceTokenizer) else None  # stock ones: as they are
    layout = run_layout(own, config.vocab_size) if own is not None else None
    trained = run_directions(ckpt)
    record = {} if trained is None else {RECORD_KEY: [f"{s}-{t}" for s, t in trained]}
    logger.info("reading %s -> %s", ckpt, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        export_weights(ckpt, config, tmp, dtype, max_bytes, layout)
        if own is not None and layout is not None:  # M2M100-style tags, all stock codes: stock M2M100
            rules = generation_rules(layout)  # the rows the run never had: never generated
            write_hf_config(stock_config(config, layout), tmp, {**generation, **rules}, dtype, record)
            save_m2m100_tokenizer(own.model_proto, layout, tmp, model_max_length=max_length)
        else:
            write_hf_config(config, tmp, generation, dtype, record)
            save_pretrained(tmp, model_max_length=max_length)
        _default_permissions(tmp)
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of the checkpoint's "model" part as its metadata records it (logical shape)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def stored_model_tensors(checkpoint: Path) -> dict[str, StoredTensor]:
    """fqn -> shape and dtype of every "model" tensor, from DCP's `.metadata` alone (no tensor read).

    Raises:
        CheckpointMismatchError: the metadata is unreadable.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = FileSystemReader(str(checkpoint)).read_metadata()
    except Exception as e:  # a missing or damaged .metadata: pickle, OSError, ...
        raise CheckpointMismatchError(f"checkpoint {checkpoint} has no readable DCP metadata: {e}") from e
    return {
        key.removeprefix(_MODEL): StoredTensor(tuple(md.size), md.properties.dtype)
        for key, md in metadata.state_dict_metadata.items()
        if key.startswith(_MODEL) and isinstance(md, TensorStorageMetadata)
    }


_MODEL = "model."  # DCP flattens {"model": {fqn: t}} to "model.<fqn>"


def expected_entries(config: ModelConfig, stored: dict[str, StoredTensor]) -> dict[str, tuple[int, ...]]:
    """The model's tensors as the checkpoint names them, in model order: NLLB-MoE's stacked
    expert parameters as one entry per expert under its transformers name when the checkpoint
    holds them so (expert parallelism saves them that way, to reshard across ep sizes), else
    stacked."""
    with torch.device("meta"):
        params = [(n, tuple(p.shape)) for n, p in M2M100Translation(config).named_parameters()]
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in params:
        if is_expert_param(name) and name not in stored:
            out.update((expert_param_name(name, e), shape[1:]) for e in range(shape[0]))
        else:
            out[name] = shape
    return out


def check_stored(stored: dict[str, StoredTensor], config: ModelConfig, checkpoint: Path) -> None:
    """The checkpoint holds exactly the model's tensors, each of the model's shape (the shared
    embedding may carry vocabulary padding rows, cut on export).

    Raises:
        CheckpointMismatchError: naming the missing / unexpected tensors or the first wrong shape.
    """
    expected = expected_entries(config, stored)
    missing, unexpected = sorted(set(expected) - set(stored)), sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise CheckpointMismatchError(
            f"checkpoint {checkpoint} does not fit its model_config: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    for name, shape in expected.items():
        got = stored[name].shape
        padded = name == _SHARED and got[1:] == shape[1:] and got[0] >= shape[0]
        if got != shape and not padded:
            raise CheckpointMismatchError(
                f"checkpoint {checkpoint} does not fit its model_config: {name} has shape {got}, "
                f"the model {shape}"
            )


_SHARED = "shared.weight"


def read_model_tensors(
    checkpoint: Path, names: list[str], stored: dict[str, StoredTensor], vocab_size: int
) -> dict[str, torch.Tensor]:
    """Just `names` of the checkpoint's "model" part (plain tensors of logical shape, any saving
    mesh), read by DCP without a process group; the shared embedding's padding rows cut.

    Raises:
        CheckpointMismatchError: DCP cannot read them (a damaged or foreign checkpoint).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    template = {n: torch.empty(stored[n].shape, dtype=stored[n].dtype) for n in names}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": template}, checkpoint_id=str(checkpoint), no_dist=True)
    except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
        # Its message is a per-rank traceback; the last line names the problem (e.g. a missing key).
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        cause = lines[-1][:300] if lines else type(e).__name__
        raise CheckpointMismatchError(f"checkpoint {checkpoint} cannot be read: {cause}") from e
    if _SHARED in template and template[_SHARED].shape[0] > vocab_size:
        template[_SHARED] = template[_SHARED][:vocab_size].clone()  # (V, d): the padding dropped
    return template


def load_full_state(checkpoint: str | Path, config: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """The single-device model state (fqn -> plain tensor of logical shape) of a checkpoint from any mesh.

    Works without a process group (DCP's no-dist path); reads only the "model" entries.

    Raises:
        CheckpointMismatchError: the checkpoint does not hold this model's tensors.
    """
    path = Path(checkpoint)
    config = config or read_model_config(path)
    stored = stored_model_tensors(path)
    check_stored(stored, config, path)
    state = read_model_tensors(path, list(stored), stored, config.vocab_size)
    with torch.device("meta"):
        stacked = [
            (n, p.shape[0]) for n, p in M2M100Translation(config).named_parameters() if is_expert_param(n)
        ]
    for name, experts in stacked:  # per-expert entries (expert parallelism's) back to the stacked parameter
        if name not in state:
            state[name] = torch.stack([state.pop(expert_param_name(name, e)) for e in range(experts)])
    return state


# Checkpoint bytes one DCP read brings in while a shard is cast to another dtype (a tensor larger
# than this is read alone): the cast copies join the shard, the read tensors are dropped.
READ_BATCH_BYTES = 64 * 2**20


def export_weights(
    checkpoint: Path,
    config: ModelConfig,
    out: Path,
    dtype: torch.dtype,
    max_shard_bytes: int,
    layout: StockLayout | None,
) -> None:
    """Stream the checkpoint's weights into HF safetensors shards of at most `max_shard_bytes`.

    The shards are planned from DCP's metadata (output bytes per tensor: the stock layout's
    rows for the embedding, `dtype`'s size); then each shard is made alone: its tensors read
    (`READ_BATCH_BYTES` at a time where the cast to `dtype` copies them) and converted
    (vocabulary padding cut, stock permutation, q/k/v split, cast) as they arrive, the shard
    written and dropped before the next is read. The peak holds one output shard (plus one
    read batch), not the model.

    Raises:
        CheckpointMismatchError: the checkpoint does not hold `config`'s tensors.
    """
    stored = stored_model_tensors(checkpoint)
    check_stored(stored, config, checkpoint)
    order = list(expected_entries(config, stored))
    out_config = stock_config(config, layout) if layout is not None else config

    def out_shape(name: str) -> tuple[int, ...]:
        shape = stored[name].shape
        return (out_config.vocab_size, *shape[1:]) if name == _SHARED else shape

    sizes = {n: tensor_bytes(out_shape(n), dtype) for n in order}
    groups = plan_shards(list(sizes.items()), max_shard_bytes)
    logger.info(
        "%d tensors, %s as %s, in %d shard(s)", len(order),
        format_bytes(sum(sizes.values())), str(dtype).removeprefix("torch."), len(groups),
    )  # fmt: skip
    bar = Progress(sum(sizes.values()), "export", "B", logger=logger)
    made = 0

    def make_shard(group: Sequence[str]) -> dict[str, torch.Tensor]:
        nonlocal made
        made += 1
        shard: dict[str, torch.Tensor] = {}
        read_sizes = [(n, tensor_bytes(stored[n].shape, stored[n].dtype)) for n in group]
        # Batches where the cast copies (the read tensors then die as their copies join the
        # shard); a shard already in the stored dtype is the read tensors themselves: one read.
        same = all(stored[n].dtype == dtype for n in group)
        for batch in plan_shards(read_sizes, sum(b for _, b in read_sizes) if same else READ_BATCH_BYTES):
            tensors = read_model_tensors(checkpoint, batch, stored, config.vocab_size)
            for name in batch:
                ours = tensors.pop(name)  # dropped as soon as converted
                if layout is not None:
                    ours = permute_tensor(name, ours, layout)
                shard.update((k, v.to(dtype).contiguous()) for k, v in hf_tensors(name, ours, config))
                bar.update(sizes[name], shard=f"{made}/{len(groups)}")
        return shard

    with bar:  # bytes converted (the shard's file is written after its last tensor)
        write_shards(out, groups, make_shard)


def _default_permissions(directory: Path) -> None:
    """mkdtemp makes 0700 directories (and some writers 0600 files); give the export the umask's modes."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.rglob("*"):
        f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)
