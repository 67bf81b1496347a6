"""The checks a run makes before anything is written or any collective runs (`validate_early`).

Also the planner's filter: a candidate layout's trainer flags must pass them.
"""

from __future__ import annotations

from pathlib import Path

from parallel.mesh import ParallelDims
from trainer.config.dims import parallel_dims
from trainer.config.schema import LAYERDROP_FIELDS, JobConfig
from trainer.data.sources import run_languages
from trainer.errors import ConfigError
from trainer.run.strategies import check_metric_name


def validate_early(cfg: JobConfig, world: int) -> ParallelDims:
    """Every check that needs no data, before anything is written or any collective runs.

    Mesh vs world size and node size, tp vs heads/FFN/d_model, blocks vs stages,
    an explicit partition's length and sum, and the schedule's (p, m, v) constraints.
    Raises ValueError (ConfigError, PartitionError, ...) naming the bad value.
    """
    from parallel.pipeline.partition import validate_balance
    from parallel.pipeline.schedule import build_schedule

    dims = parallel_dims(cfg.parallel, world)
    if cfg.model.model_name_or_path:
        from models.hf import read_hf_config

        arch = read_hf_config(cfg.model.model_name_or_path)
    else:
        arch = cfg.model.model_config(cfg.model.vocab_size, {})
    for name in LAYERDROP_FIELDS:
        if getattr(cfg.model, name) is not None:
            setattr(arch, name, getattr(cfg.model, name))
    cfg.model.check_moe(arch)
    dims.validate(arch)
    layerdrop = max(arch.encoder_layerdrop, arch.decoder_layerdrop)
    if cfg.parallel.data_parallel_sharding == "fsdp" and dims.dp > 1 and layerdrop > 0:
        raise ConfigError(
            f"data_parallel_sharding=fsdp does not support LayerDrop yet (encoder_layerdrop="
            f"{arch.encoder_layerdrop}, decoder_layerdrop={arch.decoder_layerdrop}): a skipped layer "
            f"leaves its FSDP unit unused; set both to 0 or use data_parallel_sharding none | zero1"
        )
    p, v = dims.pp, cfg.parallel.virtual_stages
    n_blocks = arch.encoder_layers + arch.decoder_layers + 4
    if p * v > n_blocks:
        raise ConfigError(
            f"pipeline_parallel_size({p}) x virtual stages({v}) = {p * v} stages but the model "
            f"has only {n_blocks} blocks ({arch.encoder_layers} encoder + {arch.decoder_layers} "
            f"decoder layers + 4); use fewer stages or more layers"
        )
    balance = cfg.parallel.partition_balance()
    if balance is not None:
        validate_balance(balance, n_blocks, p * v)
    build_schedule(cfg.parallel.pipeline_schedule, p, cfg.parallel.num_microbatches, v)
    check_predict_args(cfg)
    check_metric_name(cfg.training.metric_for_best_model, [f"{s}-{t}" for s, t in cfg.data.directions()])
    return dims


def check_predict_args(cfg: JobConfig) -> None:
    """do_predict needs test data: a test_file that exists, or a dataset_name (checked before
    anything runs; a dataset without a 'test' split is refused when the data is loaded, before
    training: `trainer.run.setup.setup_run`).

    Raises:
        ConfigError: do_predict with neither test_file nor dataset_name, or a test_file (or one of
            its per-language files, for a '{lang}' pattern) that does not exist.
    """
    if not cfg.training.do_predict:
        return
    test = cfg.data.test_file
    if not test and cfg.data.dataset_name:
        return
    if not test:
        raise ConfigError(
            "do_predict=True needs test_file (JSON lines / Parquet / '{lang}' text files) "
            "or a dataset_name with a 'test' split"
        )
    paths = [test.format(lang=lang) for lang in run_languages(cfg.data)] if "{lang}" in test else [test]
    missing = [p for p in paths if not Path(p).is_file()]
    if missing:
        raise ConfigError(f"test_file={test!r}: {missing[0]!r} does not exist")
