"""ParallelDims validation messages and mesh coordinate math (pure: no processes)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from models.config import ModelConfig
from parallel.mesh import ParallelDims, check_tp_divides_model, coords_to_rank, rank_to_coords
from trainer.config import ParallelArguments


def test_mesh_not_multiplying_to_world_names_every_size() -> None:
    with pytest.raises(ValueError, match=r"pp\(2\) \* dp\(2\) \* tp\(2\) = 8 != WORLD_SIZE\(4\)"):
        ParallelDims(pp=2, dp=2, tp=2, world_size=4).validate()


def test_dp_inferred_from_world() -> None:
    dims = ParallelDims(pp=2, dp=-1, tp=2, world_size=8).validate()
    assert dims.dp == 2 and dims.shape == (2, 2, 2)


def test_dp_not_inferable() -> None:
    with pytest.raises(ValueError, match=r"WORLD_SIZE\(6\) is not divisible by pp\(2\) \* tp\(2\) = 4"):
        ParallelDims(pp=2, dp=-1, tp=2, world_size=6).validate()


@pytest.mark.parametrize("name", ["pp", "tp", "world_size"])
def test_non_positive_sizes(name: str) -> None:
    kwargs: dict[str, Any] = {"pp": 1, "dp": 1, "tp": 1, "world_size": 1, name: 0}
    with pytest.raises(ValueError, match=f"{name}=0 must be >= 1"):
        ParallelDims(**kwargs).validate()


def test_tp_across_nodes_refused_unless_allowed() -> None:
    with pytest.raises(ValueError, match=r"tp\(8\) > LOCAL_WORLD_SIZE\(4\)"):
        ParallelDims(pp=1, dp=1, tp=8, world_size=8, local_world_size=4).validate()
    ParallelDims(pp=1, dp=1, tp=8, world_size=8, local_world_size=4, allow_tp_across_nodes=True).validate()


def test_tp_must_divide_heads_ffn_and_d_model() -> None:
    cfg = ModelConfig(
        d_model=48,
        encoder_attention_heads=6,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        vocab_size=101,
    )
    with pytest.raises(ValueError, match=r"tp\(4\) does not divide encoder_attention_heads\(6\)"):
        ParallelDims(pp=1, dp=1, tp=4, world_size=4).validate(cfg)
    cfg = ModelConfig(
        d_model=32,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=64,
        decoder_ffn_dim=60,
        vocab_size=101,
    )
    with pytest.raises(ValueError, match=r"tp\(8\) does not divide decoder_ffn_dim\(60\)"):
        check_tp_divides_model(cfg, 8)
    # The vocabulary (101) need not be divisible: it is padded.
    check_tp_divides_model(cfg, 4)  # 60 and 101 are fine for tp=4


def test_from_args() -> None:
    args = ParallelArguments(pipeline_parallel_size=2, tensor_parallel_size=2, allow_tp_across_nodes=True)
    dims = ParallelDims.from_args(args, world_size=8, local_world_size=2).validate()
    assert (dims.pp, dims.dp, dims.tp, dims.allow_tp_across_nodes) == (2, 2, 2, True)


def test_coordinates_tp_innermost_pp_outermost() -> None:
    shape = (2, 3, 2)
    pp, dp, tp = shape
    for rank, coords in enumerate(itertools.product(range(pp), range(dp), range(tp))):
        assert rank_to_coords(rank, shape) == coords
        assert coords_to_rank(coords, shape) == rank == (coords[0] * dp + coords[1]) * tp + coords[2]
    assert rank_to_coords(5, (2, 2, 2)) == (1, 0, 1)


def test_coordinates_out_of_range() -> None:
    with pytest.raises(ValueError, match="rank 8 is outside a mesh of 8 ranks"):
        rank_to_coords(8, (2, 2, 2))
    with pytest.raises(ValueError, match=r"dp coordinate 2 is outside \[0, 2\)"):
        coords_to_rank((0, 2, 0), (2, 2, 2))
