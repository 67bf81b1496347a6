"""Score a model on a FLORES-style directory (the library of `python -m trainer.evaluate`).

    check_inputs   every check that needs no peer and no weights: flags, mesh sizes, directions,
                   the language files, spBLEU's model, the model directory or checkpoint, the
                   tokenizer's language tags (one line each, on every rank alike); a language
                   is the model's tag of the same language where the code given is not one
                   (`en` -> `eng_Latn` and back, `trainer.tokenizer.lang_codes`), and so is its
                   file (`flores.find_file`); directions the model's record says it never
                   trained get one warning line (`trainer.checkpoint.directions`)
    one process    an exported HF directory: `hf_translate.load_model` and `decode.translate`
    on a mesh      under torchrun, or for a training checkpoint: the ranks form the (pp, dp, tp)
                   mesh; an HF directory is read stage-local (`hf_translate.load_on_mesh`), a
                   checkpoint is built stage-local and loaded by DCP (any saving mesh); decoding is
                   `runner.translate_on_mesh` (the dp replicas share the batches), whose hypotheses
                   equal the one-process ones
    scoring        rank 0 scores each direction (`trainer.eval.metrics`) and writes the table
                   (`trainer.eval.report`) and the hypotheses; the markdown goes to stdout

The usage is in `trainer/evaluate.py`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import torch
from tqdm.auto import tqdm

from models.config import ModelConfig
from models.hf import CheckpointMismatchError, read_hf_config
from trainer.checkpoint.directions import model_directions, untrained_warning
from trainer.errors import TokenizerError
from trainer.eval.flores import (
    EvaluateError,
    languages_of,
    parse_directions,
    read_language_files,
    resolve_pattern,
)
from trainer.eval.hf_translate import (
    RankError,
    TranslateArguments,
    check_model_fits,
    mesh_dims,
    search_settings,
    with_generation_config,
)
from trainer.eval.metrics import (
    check_spbleu_model,
    compute_metrics,
    metric_names,
    spbleu_available,
    spbleu_model_path,
    spbleu_model_url,
)
from trainer.eval.report import build_result, to_markdown, write_report
from trainer.tokenizer.lang_codes import matching_codes
from trainer.tokenizer.vocab import Tokenizer, lang_tag

if TYPE_CHECKING:
    from models.generate import SearchSettings
    from parallel.mesh import ParallelDims, ParallelMesh
    from parallel.parallelize import ParallelModel

# decode(sources, src, tgt, on_batch) -> hypotheses (None on ranks that do not hold them);
# on_batch(n): n more sentences decoded (the progress bar)
Decode = Callable[[Sequence[str], str, str, Callable[[int], None]], list[str] | None]


def _like_translate(name: str) -> Any:
    """The `trainer.translate` flag of that name: the same default and help."""
    f = next(f for f in fields(TranslateArguments) if f.name == name)
    return field(default=f.default, metadata=f.metadata)


@dataclass
class EvaluateArguments:
    """Command-line arguments of `python -m trainer.evaluate`."""

    model: str = field(
        metadata={
            "help": "An exported Hugging Face M2M100/NLLB directory (config.json, safetensors, tokenizer "
            "files), or a training checkpoint OUTPUT_DIR/checkpoint-<step> (decoded on a mesh; its "
            "tokenizer is the run's OUTPUT_DIR/tokenizer unless --tokenizer)."
        }
    )
    data_dir: str = field(
        metadata={
            "help": "A FLORES-style directory: one file per language, line i of every file the same "
            "sentence (FLORES-200: flores200_dataset, or its devtest/ or dev/)."
        }
    )
    directions: list[str] | None = field(
        default=None, metadata={"help": "Directions to score, SRC-TGT in the model's codes: en-de de-en ..."}
    )
    languages: list[str] | None = field(
        default=None,
        metadata={"help": "Score every ordered pair of these languages (instead of --directions)."},
    )
    file_pattern: str | None = field(
        default=None,
        metadata={
            "help": "The files' names under --data_dir, with {lang}: '{lang}.txt', 'test.{lang}', ... "
            "Default: FLORES' {lang}.devtest, devtest/{lang}.devtest, {lang}.dev, dev/{lang}.dev (the "
            "first that has the first language's file)."
        },
    )
    max_samples: int | None = field(
        default=None, metadata={"help": "Score only the first N lines of each file (a quick look)."}
    )
    output_dir: str | None = field(
        default=None,
        metadata={
            "help": "Write scores.json, scores.md and predictions_<src>-<tgt>.txt here (created if "
            "absent); default: only print the table."
        },
    )
    spbleu: bool | None = field(
        default=None,
        metadata={
            "help": "spBLEU (sacreBLEU's flores200 SentencePiece tokenization). Default: where its model "
            "is in sacreBLEU's cache; true: refuse to start without it (never downloaded); false: off."
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "A checkpoint's tokenizer directory; default: the run's tokenizer/ beside it."},
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

    def decoding(self) -> TranslateArguments:
        """The decoding and mesh flags as `trainer.translate` has them (checked by its functions)."""
        shared = {f.name: getattr(self, f.name) for f in fields(TranslateArguments) if hasattr(self, f.name)}
        return TranslateArguments(**{**shared, "source_lang": "", "target_lang": ""})


@dataclass
class Plan:
    """What `check_inputs` found: everything the work needs, checked."""

    directions: list[tuple[str, str]]  # as asked
    model_codes: dict[str, str]  # each language asked -> the model's code of it (`en` or `eng_Latn`)
    texts: dict[str, list[str]]
    data: str  # data_dir / pattern
    spbleu: bool
    checkpoint: Path | None  # a training checkpoint, else None (an HF directory)
    config: ModelConfig
    tokenizer: Tokenizer
    dims: ParallelDims
    balance: list[int]  # blocks per pipeline stage (uniform), for the mesh
    settings: SearchSettings
    dtype: torch.dtype


def check_inputs(args: EvaluateArguments, world: int) -> Plan:
    """Every check that needs no peer and reads no weights, in the order a user fixes them.

    Raises:
        EvaluateError, TranslateError, CheckpointMismatchError, TokenizerError, SpBleuModelMissingError:
            one line naming the bad value.
    """
    from trainer.eval.hf_translate import resolve_dtype

    decode = args.decoding()
    dims, settings = mesh_dims(decode, world), search_settings(decode)
    dtype = resolve_dtype(args.dtype, args.model) if Path(args.model).is_dir() else torch.float32
    directions = parse_directions(args.directions, args.languages)
    langs = languages_of(directions)
    pattern = resolve_pattern(args.data_dir, args.file_pattern, langs)
    texts = read_language_files(args.data_dir, pattern, langs, args.max_samples)
    if args.spbleu:
        check_spbleu_model("--spbleu")
    spbleu = spbleu_available() if args.spbleu is None else args.spbleu
    if args.output_dir is not None and Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        raise EvaluateError(f"--output_dir {args.output_dir!r} exists and is not a directory")
    checkpoint, config, tok_dir = model_source(args)
    balance = check_model_fits(dims, config)
    if checkpoint is None:
        settings = with_generation_config(settings, args.model)
    tokenizer = Tokenizer.load(tok_dir)
    # A language without a tag of its own or of the same language fails here.
    codes = {lang: model_code(tokenizer, lang, tok_dir) for lang in langs}
    data = str(Path(args.data_dir) / pattern)
    return Plan(
        directions, codes, texts, data, spbleu, checkpoint, config, tokenizer, dims, balance, settings, dtype
    )


def model_code(tokenizer: Tokenizer, lang: str, where: Path) -> str:
    """The model's code of `lang`: `lang` if the tokenizer has its tag, else the one tag of the
    same language (`en` for `eng_Latn` on an M2M100 model, and back).

    Raises:
        TokenizerError: no tag of that language, or several (naming them).
    """
    found = matching_codes(lang, tokenizer.languages)
    if len(found) == 1:
        return found[0]
    if found:
        raise TokenizerError(f"language {lang!r} could be any of the model's {found}; name one of them")
    raise TokenizerError(
        f"tokenizer at {where} has no tag {lang_tag(lang)}; it has {tokenizer.available_tags()}"
    )


def warn_untrained(args: EvaluateArguments, plan: Plan) -> None:
    """One line on stderr (rank 0) naming the directions the model's record says it never trained."""
    asked = [(plan.model_codes[s], plan.model_codes[t]) for s, t in plan.directions]
    warning = untrained_warning(asked, model_directions(args.model))
    if warning is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"trainer.evaluate: {warning}", file=sys.stderr, flush=True)


def model_source(args: EvaluateArguments) -> tuple[Path | None, ModelConfig, Path]:
    """(the checkpoint or None, the model config, the tokenizer directory) of `--model`.

    Raises:
        EvaluateError: neither an HF directory nor a complete checkpoint of this trainer.
        CheckpointMismatchError: an HF directory without a usable config.json.
    """
    from trainer.checkpoint.commit import pass_a_checkpoint
    from trainer.checkpoint.hf_export import (
        ExportError,
        check_checkpoint,
        find_tokenizer_dir,
        read_model_config,
    )

    path = Path(args.model)
    run_dir = pass_a_checkpoint(path, "--model")
    if run_dir is not None:
        raise EvaluateError(run_dir)
    if (path / "trainer_state.json").is_file():
        try:
            ckpt = check_checkpoint(path)
            return ckpt, read_model_config(ckpt), find_tokenizer_dir(ckpt, args.tokenizer)
        except ExportError as e:
            raise EvaluateError(str(e).replace("--checkpoint", "--model")) from None
    if not (path / "config.json").is_file():
        raise EvaluateError(
            f"--model {args.model!r} is neither an exported Hugging Face directory (config.json) nor a "
            "training checkpoint (OUTPUT_DIR/checkpoint-<step> with trainer_state.json)"
        )
    if args.tokenizer is not None:
        raise EvaluateError("--tokenizer is for a training checkpoint; an HF directory brings its own")
    return None, read_hf_config(path), path


def run(args: EvaluateArguments, stdout: TextIO) -> dict[str, Any] | None:
    """Check, decode every direction, score, write; returns the result (JSON content) on rank 0.

    Raises:
        See `check_inputs`; `RankError` for a failure one rank meets after the group is up.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    plan = check_inputs(args, world)
    warn_untrained(args, plan)
    if plan.checkpoint is None and world == 1:
        return evaluate_one_process(args, plan, stdout)
    return evaluate_on_mesh(args, plan, stdout)


def evaluate_one_process(args: EvaluateArguments, plan: Plan, stdout: TextIO) -> dict[str, Any]:
    """An HF directory on one device (`hf_translate.load_model`, `models.generate`)."""
    from trainer.eval.decode import translate
    from trainer.eval.hf_translate import load_model, pick_device

    device = pick_device(args.device)
    model = load_model(args.model, device, plan.dtype)

    def decode(sources: Sequence[str], src: str, tgt: str, on_batch: Callable[[int], None]) -> list[str]:
        return translate(
            model, plan.tokenizer, sources, src, tgt, plan.settings, args.batch_size, args.max_source_length,
            on_batch,
        )  # fmt: skip

    result = score_all(decode, args, plan, f"one process, {device.type}", 1, stdout)
    assert result is not None
    return result


def evaluate_on_mesh(args: EvaluateArguments, plan: Plan, stdout: TextIO) -> dict[str, Any] | None:
    """On the (pp, dp, tp) mesh of this torchrun job (one rank for a checkpoint without torchrun)."""
    import torch.distributed as dist

    from parallel.mesh import build_mesh, init_distributed
    from trainer.eval.hf_translate import load_on_mesh, mesh_device
    from trainer.eval.runner import translate_on_mesh

    device, balance = mesh_device(args.device), plan.balance
    owned = not dist.is_initialized()
    init_distributed("nccl" if device.type == "cuda" else "gloo")
    try:
        mesh = build_mesh(plan.dims, device.type)
        if plan.checkpoint is None:
            pm = load_on_mesh(args.model, plan.config, mesh, balance, device, plan.dtype)
        else:
            pm = load_checkpoint_on_mesh(plan.checkpoint, plan.config, mesh, balance, device, plan.dtype)

        def decode(
            sources: Sequence[str], src: str, tgt: str, on_batch: Callable[[int], None]
        ) -> list[str] | None:
            return translate_on_mesh(
                pm, plan.tokenizer, sources, src, tgt, plan.settings, args.batch_size, dst=0,
                max_source_length=args.max_source_length, on_batch=on_batch,
            )  # fmt: skip

        where = f"(pp, dp, tp) = {plan.dims.shape}, {device.type}, stages of {balance} blocks"
        return score_all(decode, args, plan, where, mesh.size("edp"), stdout)
    except CheckpointMismatchError as e:
        raise RankError(f"rank {dist.get_rank()}: {e}") from e
    finally:
        if owned:
            dist.destroy_process_group()


def load_checkpoint_on_mesh(
    checkpoint: Path,
    config: ModelConfig,
    mesh: ParallelMesh,
    balance: list[int],
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> ParallelModel:
    """This rank's stage and tp shard of a training checkpoint (saved on any mesh), in eval mode:
    built stage-local with nothing drawn, then DCP reads this rank's slices into it (as resume
    does), every weight then cast to `dtype` once (see `hf_translate.load_on_mesh`).

    Raises:
        CheckpointMismatchError: the checkpoint does not fit the model.
    """
    from parallel.parallelize import build_parallel_model
    from trainer.checkpoint.dcp import load_checkpoint

    pm = build_parallel_model(
        config, mesh, balance, 1, "gpipe", 1, "none", 0.0, device=device, from_checkpoint=True,
        eval_dtype=None if dtype == torch.float32 else dtype,
    )  # fmt: skip
    load_checkpoint(checkpoint, [pm.model], None, to_logical=pm.to_logical, restore_rng=False)
    pm.model.to(dtype).eval()
    return pm


class Progress:
    """A tqdm bar over sentences on rank 0 (stderr). On a mesh rank 0 sees its replica's batches
    only: each counts `replicas` times, and each direction's end sets the exact count."""

    def __init__(self, total: int, enabled: bool, replicas: int) -> None:
        self.bar = tqdm(total=total, unit="sent", disable=not enabled, file=sys.stderr, dynamic_ncols=True)
        self.replicas, self.done, self.current = replicas, 0, 0

    def start(self, direction: str, sentences: int) -> None:
        self.bar.set_description(direction)
        self.current = sentences

    def batch(self, n: int) -> None:
        self.bar.update(min(n * self.replicas, self.done + self.current - self.bar.n))

    def finish_direction(self) -> None:
        self.done += self.current
        self.bar.update(self.done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def score_all(
    decode: Decode, args: EvaluateArguments, plan: Plan, where: str, replicas: int, stdout: TextIO
) -> dict[str, Any] | None:
    """Decode and score every direction; rank 0 writes the files and prints the table (collective)."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    n = len(next(iter(plan.texts.values())))
    if rank == 0:
        print(
            f"trainer.evaluate: {len(plan.directions)} directions x {n} sentences on {where}", file=sys.stderr
        )
    progress = Progress(n * len(plan.directions), rank == 0 and not args.disable_tqdm, replicas)
    metrics = metric_names(plan.spbleu)
    rows: dict[str, dict[str, float]] = {}
    hypotheses: dict[str, list[str]] = {}
    try:
        for src, tgt in plan.directions:
            name = f"{src}-{tgt}"
            progress.start(name, n)
            hyps = decode(plan.texts[src], plan.model_codes[src], plan.model_codes[tgt], progress.batch)
            progress.finish_direction()
            if hyps is not None:
                # Edge whitespace depends on the tokenizer class, not the tokens (a hypothesis cut
                # at max_length after a lone "▁" piece: our SentencePiece decode keeps the space,
                # the stock M2M100Tokenizer of an export strips it). sacreBLEU ignores it; the
                # predictions files drop it, so they compare across model forms too.
                hyps = [h.strip() for h in hyps]
                scores = compute_metrics(hyps, plan.texts[tgt], tgt, plan.spbleu)
                rows[name] = {"sentences": n, **scores}
                hypotheses[name] = hyps
    finally:
        progress.close()
    if rank != 0:
        return None
    settings = {
        "model": args.model,
        "data": plan.data,
        "num_beams": plan.settings.num_beams,
        "max_length": plan.settings.max_length,
        "dtype": str(plan.dtype).removeprefix("torch."),
        "decoded_on": where,
    }
    result = build_result(rows, metrics, settings)
    if args.output_dir is not None:
        write_report(args.output_dir, result, hypotheses)
    if args.spbleu is None and not plan.spbleu:
        print(
            f"trainer.evaluate: spBLEU not scored: sacreBLEU's flores200 SentencePiece model is not at "
            f"{spbleu_model_path()} (fetch {spbleu_model_url()} there to score it)",
            file=sys.stderr,
        )
    stdout.write(to_markdown(result))
    stdout.flush()
    return result
