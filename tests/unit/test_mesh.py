"""ParallelDims validation messages and mesh coordinate math (pure: no processes)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from models.config import ModelConfig
from parallel.mesh import ParallelDims, check_tp_divides_model, coords_to_rank, rank_to_coords
from trainer.config.dims import parallel_dims
from trainer.config.schema import ParallelArguments


def test_mesh_not_multiplying_to_world_names_every_flag() -> None:
    with pytest.raises(
        ValueError,
        match=r"pipeline_parallel_size\(2\) \* data_parallel_size\(2\) \* tensor_parallel_size\(2\) = 8 "
        r"!= WORLD_SIZE\(4\); valid: data_parallel_size=1 or -1",
    ):
        ParallelDims(pp=2, dp=2, tp=2, world_size=4).validate()


def test_dp_inferred_from_world() -> None:
    dims = ParallelDims(pp=2, dp=-1, tp=2, world_size=8).validate()
    assert dims.dp == 2 and dims.shape == (2, 2, 2)


@pytest.mark.parametrize(
    "pp,tp,world,message",
    [
        (1, 3, 4, "tensor_parallel_size=3 does not divide 4 ranks; valid: 1, 2, 4"),
        (3, 1, 4, "pipeline_parallel_size=3 does not divide 4 ranks; valid: 1, 2, 4"),
        (
            2,
            4,
            12,
            r"tensor_parallel_size=4 does not divide the 6 ranks of a pipeline stage .*; valid: 1, 2, 3, 6",
        ),
    ],
)
def test_size_not_dividing_the_ranks_names_the_flag_and_valid_sizes(
    pp: int, tp: int, world: int, message: str
) -> None:
    """Was: `cannot infer dp: WORLD_SIZE(4) is not divisible by pp(1) * tp(3)`: no flag, no valid values."""
    with pytest.raises(ValueError, match=message):
        ParallelDims(pp=pp, dp=-1, tp=tp, world_size=world).validate()
    with pytest.raises(ValueError, match=message):  # an explicit dp does not hide the real cause
        ParallelDims(pp=pp, dp=1, tp=tp, world_size=world).validate()


@pytest.mark.parametrize(
    "name,flag",
    [("pp", "pipeline_parallel_size"), ("tp", "tensor_parallel_size"), ("world_size", "world_size")],
)
def test_non_positive_sizes(name: str, flag: str) -> None:
    kwargs: dict[str, Any] = {"pp": 1, "dp": 1, "tp": 1, "world_size": 1, name: 0}
    with pytest.raises(ValueError, match=f"{flag}=0 must be >= 1"):
        ParallelDims(**kwargs).validate()


def test_tp_across_nodes_refused_unless_allowed() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 > LOCAL_WORLD_SIZE\(4\).*<= 4"):
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
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=4 does not divide encoder_attention_heads\(6\); valid: 1, 2, 3, 6",
    ):
        ParallelDims(pp=1, dp=1, tp=4, world_size=4).validate(cfg)
    cfg = ModelConfig(
        d_model=32,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        encoder_ffn_dim=64,
        decoder_ffn_dim=60,
        vocab_size=101,
    )
    with pytest.raises(ValueError, match=r"tensor_parallel_size=8 does not divide decoder_ffn_dim\(60\)"):
        check_tp_divides_model(cfg, 8)
    # The vocabulary (101) need not be divisible: it is padded.
    check_tp_divides_model(cfg, 4)  # 60 and 101 are fine for tp=4


def test_expert_parallel_size_checked_before_any_group() -> None:
    """ep must divide dp and the experts, and needs a sparse model: one line naming the field."""
    moe = ModelConfig(vocab_size=101, num_experts=6, encoder_sparse_step=2, decoder_sparse_step=2)
    with pytest.raises(
        ValueError, match=r"expert_parallel_size=3 does not divide data_parallel_size\(4\); valid: 1, 2, 4"
    ):
        ParallelDims(pp=1, dp=4, tp=1, world_size=4, ep=3).validate()
    with pytest.raises(
        ValueError, match=r"expert_parallel_size=4 does not divide num_experts\(6\); valid: 1, 2$"
    ):  # the sizes named divide both the experts and dp (3 and 6 do not divide dp 4)
        ParallelDims(pp=1, dp=4, tp=1, world_size=4, ep=4).validate(moe)
    with pytest.raises(ValueError, match=r"expert_parallel_size=2 needs a sparse .*num_experts=0.*valid: 1"):
        ParallelDims(pp=1, dp=2, tp=1, world_size=2, ep=2).validate(ModelConfig(vocab_size=101))
    dims = ParallelDims(pp=2, dp=-1, tp=1, world_size=8, ep=2).validate(moe)
    assert (dims.dp, dims.edp, dims.size("ep"), dims.size("edp")) == (4, 2, 2, 2)
    args = ParallelArguments(data_parallel_size=4, expert_parallel_size=2)
    assert parallel_dims(args, world_size=4).validate(moe).ep == 2


def test_from_args() -> None:
    args = ParallelArguments(pipeline_parallel_size=2, tensor_parallel_size=2, allow_tp_across_nodes=True)
    dims = parallel_dims(args, world_size=8, local_world_size=2).validate()
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
