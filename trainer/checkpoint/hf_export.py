"""Export a training checkpoint as a Hugging Face directory (the library of `python -m trainer.export`).

Reads the DCP checkpoint in one process, writes config.json, model.safetensors,
generation_config.json and the tokenizer files into a temporary directory renamed at the
end; the usage and the layout are in `trainer/export.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from models.config import ModelConfig
from models.hf import CheckpointMismatchError, save_hf_model
from models.m2m100 import M2M100Translation
from trainer.checkpoint.commit import COMMIT_MARKER, verify_checkpoint
from trainer.checkpoint.dcp import is_complete, list_checkpoints
from trainer.tokenizer.stock_m2m100 import permute_model, run_layout, save_m2m100_tokenizer
from trainer.tokenizer.vocab import SentencePieceTokenizer, Tokenizer


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


class ExportError(ValueError):
    """Bad command-line input; the message names the bad value and what is valid."""


def check_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory, if it exists, its save finished and its files match the marker.

    Raises:
        ExportError: missing, not a directory, without `COMMITTED`, without trainer_state.json,
            or damaged (a file's size or checksum differs from the marker's record).
    """
    p = Path(path)
    if not p.is_dir():
        raise ExportError(
            f"--checkpoint {str(path)!r} is not a directory; expected OUTPUT_DIR/checkpoint-<step>"
        )
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


def load_full_state(checkpoint: str | Path, config: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """The single-device model state (fqn -> plain tensor of logical shape) of a checkpoint from any mesh.

    Works without a process group (DCP's no-dist path); reads only the "model" entries.

    Raises:
        CheckpointMismatchError: the checkpoint does not hold this model's tensors.
    """
    path = Path(checkpoint)
    config = config or read_model_config(path)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    model = M2M100Translation(config)
    template = {k: p.detach().clone() for k, p in model.named_parameters()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": template}, checkpoint_id=str(path), no_dist=True)
    except (CheckpointException, Exception) as e:  # CheckpointException is a BaseException
        # Its message is a per-rank traceback; the last line names the problem (e.g. a missing key).
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        cause = lines[-1][:300] if lines else type(e).__name__
        raise CheckpointMismatchError(f"checkpoint {path} does not fit its model_config: {cause}") from e
    return template


def export(args: ExportArguments) -> Path:
    """Write the HF directory; returns its path.

    Raises:
        ExportError, CheckpointMismatchError, TokenizerError: bad input (nothing is written).
    """
    ckpt = check_checkpoint(args.checkpoint)
    tok_dir = find_tokenizer_dir(ckpt, args.tokenizer)
    out = check_output(args.output, args.overwrite)
    if args.num_beams < 1 or args.max_length < 2:
        raise ExportError(
            f"--num_beams {args.num_beams} must be >= 1 and --max_length {args.max_length} >= 2"
        )
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
    state = load_full_state(ckpt, config)
    generation: dict[str, Any] = {"num_beams": args.num_beams, "max_length": args.max_length}
    max_length = config.max_position_embeddings  # truncation=True cuts there
    own = tokenizer if isinstance(tokenizer, SentencePieceTokenizer) else None  # stock ones: as they are
    layout = run_layout(own, config.vocab_size) if own is not None else None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        if own is not None and layout is not None:  # M2M100-style tags, all stock codes: stock M2M100
            save_hf_model(*permute_model(state, config, layout), tmp, generation)
            save_m2m100_tokenizer(own.model_proto, layout, tmp, model_max_length=max_length)
        else:
            save_hf_model(state, config, tmp, generation)
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


def _default_permissions(directory: Path) -> None:
    """mkdtemp makes 0700 directories (and some writers 0600 files); give the export the umask's modes."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.rglob("*"):
        f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)
