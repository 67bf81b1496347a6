"""Translation with an exported model (the library of `python -m trainer.translate`).

Loading and checking the model directory, one-process decoding, and decoding on a
(pp, dp, tp) mesh under torchrun; the usage is in `trainer/translate.py`.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import torch

from models.hf import CheckpointMismatchError, read_hf_config
from models.m2m100 import M2M100Translation
from parallel.materialize import materialize, pretrained_fill
from trainer.checkpoint.commit import pass_a_checkpoint, run_directory
from trainer.checkpoint.directions import model_directions, untrained_warning
from trainer.errors import BadInputError
from trainer.eval.decode import translate, without_blanks
from trainer.progress import Progress
from trainer.tokenizer.vocab import Tokenizer

if TYPE_CHECKING:
    from models.config import ModelConfig
    from models.generate import SearchSettings
    from parallel.mesh import ParallelDims, ParallelMesh
    from parallel.parallelize import ParallelModel

logger = logging.getLogger("trainer.translate")

# transformers' names, then the short ones `trainer.export --dtype` takes
DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": None,
    "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
}  # fmt: skip


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
        default="auto",
        metadata={
            "help": "cpu, cuda, cuda:N, or auto (cuda when available). Under torchrun: auto, cuda "
            "(each rank on cuda:LOCAL_RANK) or cpu (gloo)."
        },
    )
    pipeline_parallel_size: int = field(
        default=1, metadata={"help": "Pipeline stages under torchrun (the model is cut uniformly by blocks)."}
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata={"help": "Tensor-parallel ranks under torchrun (must divide heads, FFN, d_model)."},
    )
    data_parallel_size: int = field(
        default=-1,
        metadata={"help": "Replicas sharing the lines under torchrun; -1: WORLD_SIZE / (pp * tp)."},
    )
    expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "NLLB-MoE under torchrun: experts spread over this many of the dp replicas (each "
            "rank reads only its experts); they decode the same lines together. Must divide "
            "data_parallel_size and num_experts."
        },
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": f"Weights and decoding in this precision, as transformers' `dtype` (`torch_dtype`): "
            f"one of {list(DTYPES)}; auto: the dtype config.json records (float32 if none)."
        },
    )


class TranslateError(BadInputError):
    """Bad command-line input; the message names the bad value and what is valid."""


class RankError(TranslateError):
    """An error met by one rank after the process group is up (the others may not meet it)."""


def pick_device(name: str) -> torch.device:
    """`auto` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def check_model_dir(path: str | Path) -> None:
    """Fail early and clearly on a wrong `--model`: a training checkpoint (or a run directory of
    them) is named as one, with the command that exports it, before the tokenizer files are looked
    for (AutoTokenizer's own message there was cut off and named neither).

    Raises:
        TranslateError: `path` is not a directory, or a training checkpoint / run directory.
    """
    p = Path(path)
    if not p.is_dir():
        raise TranslateError(
            f"--model {str(path)!r} is not a directory; expected an exported Hugging Face model directory "
            "(config.json, model.safetensors, tokenizer files)"
        )
    if (p / "config.json").is_file():
        return
    found = run_directory(p)
    if found == []:
        raise TranslateError(str(pass_a_checkpoint(p, "--model")))
    if (p / "trainer_state.json").is_file() or found:
        ckpt = found[-1] if found else p
        what = (
            f"a run directory; its latest complete checkpoint is {ckpt}" if found else "a training checkpoint"
        )
        raise TranslateError(
            f"--model {str(path)!r} is {what}, not a Hugging Face directory: export it first: python -m "
            f"trainer.export --checkpoint {ckpt} --output {ckpt.parent / 'hf_export'}, then --model "
            f"{ckpt.parent / 'hf_export'} (or score it as it is: python -m trainer.evaluate --model {ckpt} ...)"
        )


def resolve_dtype(name: str, path: str | Path) -> torch.dtype:
    """`--dtype` as a torch dtype; `auto` reads config.json's `dtype` (transformers 5) or
    `torch_dtype` (4.x), float32 where it records none.

    Raises:
        TranslateError: a name not in DTYPES, or an auto dtype we do not decode in.
    """
    import json

    if name not in DTYPES:
        raise TranslateError(f"--dtype {name!r} is not valid; choose one of {list(DTYPES)}")
    if name != "auto":
        return DTYPES[name]  # type: ignore[return-value]
    config = Path(path) / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    recorded = str(hf.get("dtype") or hf.get("torch_dtype") or "float32")
    if DTYPES.get(recorded) is None:
        raise TranslateError(f"--dtype auto: {config} records dtype {recorded!r}; pass one of {list(DTYPES)}")
    return DTYPES[recorded]  # type: ignore[return-value]


def load_model(
    path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32
) -> M2M100Translation:
    """Our model with the weights of an HF directory, in eval mode on `device`, every weight
    and buffer in `dtype` (as transformers' `from_pretrained(dtype=...)`).

    Built on the meta device and given memory on `device` once, each tensor read into it in
    turn (`parallel.materialize`): no initial weights drawn, no second copy of the weights.

    Raises:
        TranslateError: `path` is not a directory.
        CheckpointMismatchError: no config.json / safetensors, or weights that do not fit.
    """
    check_model_dir(path)
    with torch.device("meta"):
        model = M2M100Translation(read_hf_config(path))
    materialize(model, device, pretrained_fill(path, model))
    return model.to(dtype=dtype).eval()


def utf8(stream: TextIO) -> TextIO:
    """The real stdin/stdout as UTF-8 whatever the locale says (translations are multilingual)."""
    if isinstance(stream, io.TextIOWrapper):
        stream.reconfigure(encoding="utf-8")
    return stream


def write_lines(stdout: TextIO, hyps: Sequence[str]) -> None:
    """One line per hypothesis (newlines inside one are spaces: lines stay aligned with the input)."""
    for hyp in hyps:
        stdout.write(hyp.replace("\n", " ") + "\n")
    stdout.flush()


def run(args: TranslateArguments, stdin: TextIO, stdout: TextIO) -> None:
    """Load, read every line of `stdin`, write one translation per line to `stdout`.

    Under torchrun (WORLD_SIZE > 1) see `run_on_mesh`.

    Raises:
        TranslateError, CheckpointMismatchError, TokenizerError: bad model dir, language or sizes.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dims = mesh_dims(args, world)
    if world > 1:
        run_on_mesh(args, dims, stdin, stdout)
        return
    check_model_dir(args.model)
    settings = with_generation_config(search_settings(args), args.model)
    # Tags first: a missing language should fail before the (slow) weight loading.
    tokenizer = Tokenizer.load(args.model, languages=[args.source_lang, args.target_lang])
    warn_untrained(args)
    device = pick_device(args.device)
    model = load_model(args.model, device, resolve_dtype(args.dtype, args.model))
    lines = stdin.read().splitlines()
    logger.info(
        "%d lines %s -> %s, %d beam(s), batches of %d, on %s", len(lines), args.source_lang,
        args.target_lang, args.num_beams, args.batch_size, device,
    )  # fmt: skip
    with Progress(len(without_blanks(lines)[0]), "translate", "line", logger=logger) as bar:
        hyps = translate(
            model, tokenizer, lines, args.source_lang, args.target_lang, settings, args.batch_size,
            args.max_source_length, on_batch=bar.update,
        )  # fmt: skip
    write_lines(stdout, hyps)


def warn_untrained(args: TranslateArguments) -> None:
    """One line on stderr if the model's record (`trainer.checkpoint.directions`) lacks the direction."""
    warning = untrained_warning([(args.source_lang, args.target_lang)], model_directions(args.model))
    if warning is not None:
        print(f"trainer.translate: {warning}", file=sys.stderr, flush=True)


def with_generation_config(settings: SearchSettings, model_dir: str | Path) -> SearchSettings:
    """`settings` with what the directory's generation_config.json says of the vocabulary: its
    one-token `bad_words_ids` (never generated) and `renormalize_logits`, which an export in the
    stock M2M100 vocabulary sets for the rows its run never had (`trainer.tokenizer.stock_m2m100`),
    so that it decodes as its checkpoint. Beams and lengths stay the flags'.

    Raises:
        TranslateError: generation_config.json is unreadable or its bad_words_ids malformed.
    """
    import json
    from dataclasses import replace

    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return settings
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise TranslateError(f"{path} is unreadable: {e}") from None
    words = config.get("bad_words_ids") or []
    if not isinstance(words, list) or not all(
        isinstance(w, list) and w and all(isinstance(i, int) and i >= 0 for i in w) for w in words
    ):
        raise TranslateError(
            f"{path}: bad_words_ids must be a list of lists of token ids, got {words!r:.200}"
        )
    if any(len(w) > 1 for w in words):
        logger.warning("%s: bad_words_ids of more than one token are not applied", path)
    return replace(
        settings,
        suppress_tokens=tuple(w[0] for w in words if len(w) == 1),
        renormalize_logits=bool(config.get("renormalize_logits", False)),
    )


def mesh_dims(args: TranslateArguments, world: int) -> ParallelDims:
    """The (pp, dp, tp) sizes checked against the world size (pure; before any process group).

    Raises:
        TranslateError: naming the flag, e.g. `pipeline_parallel_size(2) * data_parallel_size(1) *
            tensor_parallel_size(1) = 2 != WORLD_SIZE(4); valid: ...`.
    """
    from parallel.mesh import ParallelDims

    # No LOCAL_WORLD_SIZE check: tp across nodes is slow but correct, and decoding moves little over tp.
    dims = ParallelDims(
        args.pipeline_parallel_size,
        args.data_parallel_size,
        args.tensor_parallel_size,
        world,
        ep=args.expert_parallel_size,
    )
    try:
        return dims.validate()
    except ValueError as e:
        raise TranslateError(str(e)) from None


def check_model_fits(dims: ParallelDims, config: ModelConfig) -> list[int]:
    """tp vs heads/FFN/d_model, ep vs experts and pp vs blocks; returns the uniform block counts per stage.

    Raises:
        TranslateError: naming the size that does not fit (pure; before any process group).
    """
    from models.m2m100 import block_specs
    from parallel.mesh import check_ep_divides_model, check_tp_divides_model
    from parallel.pipeline.partition import uniform_partition

    try:
        check_tp_divides_model(config, dims.tp)
        check_ep_divides_model(config, dims.ep)
    except ValueError as e:
        raise TranslateError(str(e)) from None
    n_blocks = len(block_specs(config))
    if dims.pp > n_blocks:
        raise TranslateError(
            f"pipeline_parallel_size={dims.pp} but the model has only {n_blocks} blocks "
            f"({config.encoder_layers} encoder + {config.decoder_layers} decoder layers + 4); "
            f"valid: 1..{n_blocks}"
        )
    return uniform_partition(n_blocks, dims.pp)


def search_settings(args: TranslateArguments) -> SearchSettings:
    """--num_beams, --max_length and --batch_size, checked before any process group.

    Raises:
        TranslateError: naming the bad value.
    """
    from models.generate import SearchSettings

    if args.batch_size < 1:
        raise TranslateError(f"--batch_size {args.batch_size} must be >= 1")
    try:
        return SearchSettings(num_beams=args.num_beams, max_length=args.max_length).validate()
    except ValueError as e:
        raise TranslateError(str(e)) from None


def mesh_device(name: str) -> torch.device:
    """This rank's device: cuda:LOCAL_RANK for `cuda` (and `auto` with CUDA), else cpu.

    Raises:
        TranslateError: a device naming one GPU (`cuda:1`), which every rank would share.
    """
    kind = pick_device(name)
    if kind.type == "cuda" and kind.index is not None:
        raise TranslateError(
            f"--device {name!r} names one GPU, but under torchrun each rank uses cuda:LOCAL_RANK; "
            "valid: auto, cuda, cpu"
        )
    if kind.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return kind


def load_on_mesh(
    path: str,
    config: ModelConfig,
    mesh: ParallelMesh,
    balance: list[int],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> ParallelModel:
    """This rank's pipeline stage and tp shard of the HF weights at `path`, on `device`, in eval
    mode, every weight in `dtype` (cast once here: decoding, `ParallelModel.evaluating`, then has
    nothing left to cast and passes `dtype` hidden states between stages).

    Built stage-local (`parallel.materialize`): the model is created on the meta device,
    cut to this rank's blocks and tp-sharded there, and only this rank's slice of each
    tensor is read from the HF files (`models.hf.read_hf_slices`, a tensor at a time), so
    neither the host nor `device` ever holds more than this rank's shard. The pipeline
    schedule is unused by decoding (GPipe, one micro-batch).

    Raises:
        CheckpointMismatchError: a tensor of this rank's blocks is absent or misshapen.
    """
    from parallel.parallelize import build_parallel_model

    pm = build_parallel_model(
        config, mesh, balance, 1, "gpipe", 1, "none", 0.0, device=device, pretrained=path,
        eval_dtype=None if dtype == torch.float32 else dtype,
    )  # fmt: skip
    pm.model.to(dtype).eval()
    return pm


def share_lines(stdin: TextIO) -> list[str]:
    """Rank 0 reads every line of `stdin`; every rank gets them (collective)."""
    import torch.distributed as dist

    payload: list[list[str] | None] = [stdin.read().splitlines() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    assert payload[0] is not None
    return payload[0]


def run_on_mesh(args: TranslateArguments, dims: ParallelDims, stdin: TextIO, stdout: TextIO) -> None:
    """Translate on the (pp, dp, tp) mesh of this torchrun job (see the module docstring).

    Every check that needs no peer runs first, identically on every rank, so bad input
    fails everywhere before any collective could wait on a rank that left. A rank that
    fails later (a tensor of its stage missing from the files) raises `RankError`, and
    torchrun stops the others.

    Raises:
        TranslateError, CheckpointMismatchError, TokenizerError: before the process group.
        RankError: after it.
    """
    import torch.distributed as dist

    from models.hf import read_hf_config
    from parallel.mesh import build_mesh, init_distributed
    from trainer.eval.runner import replica_share, translate_on_mesh

    check_model_dir(args.model)
    config = read_hf_config(args.model)
    balance = check_model_fits(dims, config)
    settings = with_generation_config(search_settings(args), args.model)
    dtype = resolve_dtype(args.dtype, args.model)
    device = mesh_device(args.device)
    tokenizer = Tokenizer.load(args.model, languages=[args.source_lang, args.target_lang])
    if int(os.environ.get("RANK", "0")) == 0:
        warn_untrained(args)
    owned = not dist.is_initialized()
    init_distributed("nccl" if device.type == "cuda" else "gloo")
    try:
        mesh = build_mesh(dims, device.type)
        pm = load_on_mesh(args.model, config, mesh, balance, device, dtype)
        lines = share_lines(stdin)
        if dist.get_rank() == 0:
            print(
                f"trainer.translate: {len(lines)} lines on (pp, dp, tp) = {dims.shape}, "
                f"{f'ep {dims.ep}, ' if dims.ep > 1 else ''}"
                f"{device.type}, stages of {balance} blocks",
                file=sys.stderr,
                flush=True,
            )
        # Rank 0's replica's share of the lines to decode (blank ones are not): its bar.
        mine = replica_share(len(without_blanks(lines)[0]), args.batch_size, mesh)
        desc = "translate" if mesh.size("edp") == 1 else f"translate (replica 0 of {mesh.size('edp')})"
        with Progress(mine, desc, "line", enabled=dist.get_rank() == 0, logger=logger) as bar:
            hyps = translate_on_mesh(
                pm, tokenizer, lines, args.source_lang, args.target_lang, settings, args.batch_size,
                dst=0, max_source_length=args.max_source_length, on_batch=bar.update,
            )  # fmt: skip
        if hyps is not None:
            write_lines(stdout, hyps)
    except CheckpointMismatchError as e:
        raise RankError(f"rank {dist.get_rank()}: {e}") from e
    finally:
        if owned:
            dist.destroy_process_group()
