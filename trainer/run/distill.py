"""Word-level distillation in a training run: where the teacher comes from, the checks, its build.

    teacher_source      teacher_model_name_or_path -> a checkpoint of this trainer (trainer_state.json:
                        its model_config, its run's tokenizer/), or an HF directory / hub name in the
                        cache (`trainer.config.pretrained`: config.json, its own tokenizer files)
    check_teacher       before anything is written, on every rank: the teacher and the student share
                        the vocabulary (every id's token) and the run's language tags, one line naming
                        both tokenizers otherwise; the same embedding rows and special ids; the mesh
                        fits the teacher too (tp divides it, ep its experts, pp x v stages its blocks)
    build_teacher       its stages on the student's pp ranks (cut by parameters), tp- and ep-sharded,
                        each rank reading only its slices (HF files, or DCP for a checkpoint), frozen in
                        the working precision; attached to the student (`ParallelModel.train_with`)

A new student takes the teacher's tokenizer unless `tokenizer_name` (or `model_name_or_path`)
names one: SentencePiece trained on the data could never share the teacher's ids. At
`distillation_alpha: 0` the teacher is not loaded at all: the run is plain training.
The teacher is never saved in the student's checkpoints; a resume reloads it from its path.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from models.config import ModelConfig
from models.m2m100 import block_specs
from parallel.distill.loss import DistillSettings
from parallel.distill.teacher import DistillationLoss, Teacher, meta_teacher
from parallel.mesh import ParallelDims, ParallelMesh, check_ep_divides_model, check_tp_divides_model
from parallel.parallelize import ParallelModel, build_parallel_model
from trainer.config.pretrained import has_tokenizer_files, pretrained_sources, resolve_pretrained
from trainer.config.schema import JobConfig
from trainer.errors import ConfigError, TokenizerError
from trainer.tokenizer.vocab import Tokenizer

logger = logging.getLogger("trainer")

FIELD = "teacher_model_name_or_path"


@dataclass(frozen=True)
class TeacherSource:
    """A resolved teacher: its directory, whether it is a checkpoint of ours, its architecture and
    the tokenizer it was trained with."""

    name: str  # as the config gives it
    path: Path  # checkpoint-<step>/ or an HF directory
    checkpoint: bool
    config: ModelConfig
    tokenizer: Path


def teacher_source(name: str) -> TeacherSource:
    """Resolve `teacher_model_name_or_path` (see the module docstring).

    Raises:
        ConfigError: neither a complete checkpoint of this trainer nor an HF model (directory or hub
            name in the cache) with tokenizer files, naming the field and the value.
    """
    from trainer.checkpoint.commit import COMMIT_MARKER, is_complete
    from trainer.checkpoint.hf_export import ExportError, find_tokenizer_dir, read_model_config

    path = Path(name).expanduser()
    if (path / "trainer_state.json").is_file():
        if not is_complete(path):
            raise ConfigError(f"{FIELD}={name!r} has no {COMMIT_MARKER} marker: its save did not finish")
        try:  # its files' checksums: `check_teacher` (collective), not here (rank 0 alone asks too)
            return TeacherSource(name, path, True, read_model_config(path), find_tokenizer_dir(path, None))
        except ExportError as e:
            raise ConfigError(f"{FIELD}: {e}".replace("--tokenizer DIR", "tokenizer/ beside it")) from None
    model = resolve_pretrained(name, FIELD, True)
    if not (model / "config.json").is_file():
        raise ConfigError(
            f"{FIELD}={name!r} is neither an HF model directory (config.json) nor a checkpoint of this "
            "trainer (OUTPUT_DIR/checkpoint-<step> with trainer_state.json)"
        )
    if not has_tokenizer_files(model):
        raise ConfigError(
            f"{FIELD}={name!r} holds no tokenizer files: the teacher's vocabulary cannot be checked"
        )
    from models.hf import read_hf_config

    return TeacherSource(name, model, False, read_hf_config(model), model)


def distilling(cfg: JobConfig) -> bool:
    """Whether the run trains against a teacher (a teacher named, and alpha > 0)."""
    return bool(cfg.model.teacher_model_name_or_path) and cfg.training.distillation_alpha > 0


def student_tokenizer_dir(cfg: JobConfig) -> Path | None:
    """The tokenizer a fresh run loads: `tokenizer_name`, the model directory's, else the teacher's
    (None: SentencePiece trained on the data)."""
    own = pretrained_sources(cfg.model.model_name_or_path, cfg.model.tokenizer_name).tokenizer
    if own is not None or not cfg.model.teacher_model_name_or_path:
        return own
    return teacher_source(cfg.model.teacher_model_name_or_path).tokenizer


def check_teacher(
    cfg: JobConfig, dims: ParallelDims, student: ModelConfig, tokenizer: Path | None, new_student: bool
) -> TeacherSource | None:
    """Every check of the teacher (module docstring), before anything is written; in a run (a process
    group up, every rank calling it) a checkpoint teacher's files are checked against its marker.

    Args:
        student: the student's architecture (a new one's vocabulary rows become the teacher's).
        tokenizer: the student's tokenizer directory (a resume's: its run's own).
        new_student: no `model_name_or_path` and no checkpoint: its embedding is sized here.

    Returns:
        The teacher, or None when the run does not distill.

    Raises:
        ConfigError, TokenizerError, ParallelConfigError: one line naming the value and both sides.
    """
    if not cfg.model.teacher_model_name_or_path:
        return None
    source = teacher_source(cfg.model.teacher_model_name_or_path)
    if source.checkpoint and dist.is_initialized():  # a run: every rank checks its share of the files
        from trainer.checkpoint.commit import verify_checkpoint

        problem = verify_checkpoint(source.path)
        if problem is not None:
            raise ConfigError(f"{FIELD}: {problem}")
    check_vocabularies(source, tokenizer, cfg)
    teacher = source.config
    if not new_student and teacher.vocab_size != student.vocab_size:
        raise ConfigError(
            f"{FIELD}={source.name!r} has {teacher.vocab_size} embedding rows but the student has "
            f"{student.vocab_size}: the KL term compares the two distributions id by id"
        )
    p, v = dims.pp, cfg.parallel.virtual_stages
    blocks = len(block_specs(teacher))
    if p * v > blocks:
        raise ConfigError(
            f"{FIELD}={source.name!r}: pipeline_parallel_size({p}) x virtual stages({v}) = {p * v} stages "
            f"but the teacher has only {blocks} blocks"
        )
    check_tp_divides_model(teacher, dims.tp)
    if teacher.is_moe:
        check_ep_divides_model(teacher, dims.ep, dims.dp)
    return source


def check_vocabularies(source: TeacherSource, tokenizer: Path | None, cfg: JobConfig) -> None:
    """The student's tokenizer and the teacher's give every id the same token, the run's languages
    the same tags, and the special ids the teacher's config was trained with.

    Raises:
        TokenizerError: one line naming both tokenizers and the first difference.
    """
    from trainer.data.sources import run_languages

    t = source.config
    trained = (t.pad_token_id, t.eos_token_id, t.decoder_start_token_id)
    _compare(
        None if tokenizer is None else str(tokenizer),
        str(source.tokenizer),
        tuple(run_languages(cfg.data)),
        trained,
    )


@functools.lru_cache(maxsize=8)  # the planner checks thousands of layouts of one job
def _compare(
    tokenizer: str | None, teacher: str, languages: tuple[str, ...], trained: tuple[int, int, int]
) -> None:
    """`check_vocabularies` on the two directories (cached: a success is remembered)."""
    source_tok = Path(teacher)
    theirs = Tokenizer.load(source_tok, languages)
    mine = theirs if tokenizer is None or Path(tokenizer).resolve() == source_tok.resolve() else None
    if mine is None:
        assert tokenizer is not None
        mine = Tokenizer.load(tokenizer, languages)
    both = f"the student's tokenizer ({tokenizer}) and the teacher's ({teacher}, {FIELD})"
    if mine.vocab_size != theirs.vocab_size:
        raise TokenizerError(
            f"{both} differ: {mine.vocab_size} vs {theirs.vocab_size} ids; they must share the vocabulary"
        )
    tags = {lang: (mine.lang_id(lang), theirs.lang_id(lang)) for lang in languages}
    moved = {lang: ids for lang, ids in tags.items() if ids[0] != ids[1]}
    if moved:
        lang, (x, y) = next(iter(moved.items()))
        raise TokenizerError(
            f"{both} differ: language {lang}'s tag is id {x} vs {y}; they must share the tags"
        )
    if mine is not theirs:
        for i, (a, b) in enumerate(zip(mine.pieces(), theirs.pieces())):
            if a != b:
                raise TokenizerError(
                    f"{both} differ: id {i} is {a!r} vs {b!r}; they must share the vocabulary"
                )
    ours = mine.special_ids()
    for name, id_ in zip(("pad_token_id", "eos_token_id", "decoder_start_token_id"), trained):
        if ours[name] != id_:
            raise TokenizerError(
                f"{both}: the teacher's model was trained with {name}={id_}, the tokenizer gives {ours[name]}"
            )


def check_mesh(dims: ParallelDims, student: ModelConfig, teacher: ModelConfig | None) -> None:
    """`ParallelDims.validate` for a run that may distill: ep > 1 needs a sparse student or teacher
    (a dense student's ep ranks hold the teacher's experts).

    Raises:
        ParallelConfigError: naming the size that does not fit.
    """
    if teacher is None or student.is_moe or not teacher.is_moe:
        dims.validate(student)
        return
    dims.validate()
    check_tp_divides_model(student, dims.tp)


def build_teacher(
    cfg: JobConfig,
    source: TeacherSource,
    mesh: ParallelMesh,
    device: torch.device,
    student: ParallelModel,
    dtype: torch.dtype | None,
) -> DistillationLoss:
    """This rank's share of the frozen teacher, attached to `student` with the distillation loss, which
    is returned (it holds the teacher; collective: DCP for a checkpoint).

    Cut into the student's pp x v stages by parameters (`trainer.run.balance.param_partition`),
    placed as the student's schedule places its stages, so both last stages share a rank; its
    weights held in `dtype`, the run's working dtype (None: fp32)."""
    from trainer.run.balance import param_partition

    p = cfg.parallel
    zbv = p.pipeline_schedule == "zbv"  # its V puts the last stage on pp rank 0: the teacher's too
    schedule, v = ("zbv", 2) if zbv else ("gpipe", 1)
    balance = param_partition(source.config, mesh.size("pp") * v, mesh.size("ep"))
    pm = build_parallel_model(
        meta_teacher(source.config, dtype), mesh, balance, p.num_microbatches, schedule, v, "none", 0.0, autocast_dtype=dtype,
        device=device, pretrained=None if source.checkpoint else str(source.path),
        from_checkpoint=source.checkpoint,
    )  # fmt: skip
    if source.checkpoint:
        from trainer.checkpoint.dcp import load_checkpoint

        load_checkpoint(source.path, [pm.model], None, to_logical=pm.to_logical, restore_rng=False)
    teacher = Teacher(pm)
    teacher.check_placement(student)
    t = cfg.training
    settings = DistillSettings(t.distillation_alpha, t.distillation_temperature, t.label_smoothing_factor)
    loss = DistillationLoss(teacher, settings, student)
    student.train_with(loss, teacher.forward)
    logger.info(
        "distilling from %s (%.2fM parameters, stages of %s blocks; %.1f MiB of it on this rank): "
        "alpha %g, temperature %g", source.name, source.config.num_parameters() / 1e6, balance,
        teacher.parameter_bytes / 2**20, t.distillation_alpha, t.distillation_temperature,
    )  # fmt: skip
    return loss
