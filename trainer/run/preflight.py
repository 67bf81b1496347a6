"""The checks a run makes before anything is written or any collective runs (`validate_early`).

Also the planner's filter: a candidate layout's trainer flags must pass them.
"""

from __future__ import annotations

from parallel.mesh import ParallelDims
from trainer.config.dims import parallel_dims
from trainer.config.schema import JobConfig
from trainer.errors import ConfigError
from trainer.eval.predict import check_predict_args
from trainer.run.strategies import check_metric_name


def validate_early(cfg: JobConfig, world: int) -> ParallelDims:
    """Every check that needs no data, before anything is written or any collective runs.

    Mesh vs world size and node size, tp vs heads/FFN/d_model, blocks vs stages,
    an explicit partition's length and sum, and the schedule's (p, m, v) constraints.
    Raises ValueError (ConfigError, PartitionError, ...) naming the bad value.
    """
    from parallel.partition import validate_balance
    from parallel.schedule import build_schedule

    dims = parallel_dims(cfg.parallel, world)
    if cfg.model.model_name_or_path:
        from models.hf import read_hf_config

        arch = read_hf_config(cfg.model.model_name_or_path)
    else:
        arch = cfg.model.model_config(cfg.model.vocab_size, {})
    dims.validate(arch)
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
