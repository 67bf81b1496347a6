"""Stage-local construction without processes: meta build, keyed init, slice loading.

Tensor parallelism is simulated by handing `apply_tensor_parallel` a stand-in group
whose size and rank the tp modules read through `_size` / `_rank` (patched here):
construction makes no collective, so rank r of p builds exactly its shards. The
reference is always the one-process model, cut and sliced by `apply_tensor_parallel`
itself; the meta path must match it bit for bit.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import hf
from models.config import ModelConfig
from models.hf import CheckpointMismatchError, load_hf_into, read_hf_slices
from models.hf_save import save_hf_model
from models.init import LocalSlice, keyed_init
from models.m2m100 import BlockKind, M2M100Translation, block_specs
from parallel.materialize import keyed_init_fill, local_slices, materialize, pretrained_fill
from parallel.tp import apply as tp_apply
from parallel.tp import layers as tp_layers
from parallel.tp.apply import apply_tensor_parallel

VOCAB = 101  # not a multiple of tp: the vocab-parallel embedding pads


def _config(**kw: int) -> ModelConfig:
    base = dict(
        vocab_size=VOCAB,
        d_model=16,
        encoder_layers=3,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    return ModelConfig(**{**base, **kw})  # type: ignore[arg-type]


@contextmanager
def fake_tp(p: int, r: int) -> Iterator[object]:
    """A stand-in tp group of size p seen from rank r (construction only: no collective runs)."""
    saved = [(m, m._size, m._rank) for m in (tp_layers, tp_apply)]
    try:
        for m in (tp_layers, tp_apply):
            m._size, m._rank = (lambda g: p), (lambda g: r)  # type: ignore[assignment]
        yield object()
    finally:
        for m, size, rank in saved:
            m._size, m._rank = size, rank  # type: ignore[assignment]


# (p, r, blocks kept): a pipeline cut per case, the first and last stages included
STAGES = {
    "whole": lambda b: b,
    "first": lambda b: b[:3],
    "middle": lambda b: [
        x for x in b if x.kind in (BlockKind.ENC_NORM, BlockKind.TGT_EMBED, BlockKind.DEC_LAYER)
    ],
    "last": lambda b: [x for x in b if x.kind in (BlockKind.DEC_LAYER, BlockKind.HEAD)],
}
MESHES = [(1, 0), (2, 0), (2, 1), (4, 1), (4, 3)]


def _reference(mc: ModelConfig, seed: int, stage: str, p: int, r: int) -> dict[str, torch.Tensor]:
    """The one-process model, cut to the stage and sliced by `apply_tensor_parallel`."""
    ref = M2M100Translation(mc, seed=seed)
    ref.keep_only(STAGES[stage](ref.blocks))
    if p > 1:
        with fake_tp(p, r) as group:
            apply_tensor_parallel(ref, group)  # type: ignore[arg-type]
    return dict(ref.named_parameters())


def _meta_stage(mc: ModelConfig, stage: str, p: int, r: int) -> M2M100Translation:
    with torch.device("meta"):
        model = M2M100Translation(mc)
    model.keep_only(STAGES[stage](model.blocks))
    if p > 1:
        with fake_tp(p, r) as group:
            apply_tensor_parallel(model, group)  # type: ignore[arg-type]
    return model


def _assert_same(model: M2M100Translation, ref: dict[str, torch.Tensor]) -> None:
    got = dict(model.named_parameters())
    assert set(got) == set(ref)
    for name, param in got.items():
        assert param.device.type == "cpu" and not param.is_meta
        assert torch.equal(param, ref[name]), name
        assert getattr(param, "tp_sharded", None) == getattr(ref[name], "tp_sharded", None), name


# ----------------------------------------------------------------------------- keyed init


def test_one_process_init_has_hf_distribution_and_follows_the_seed() -> None:
    mc = _config(vocab_size=3000, d_model=64)
    a = M2M100Translation(mc, seed=5)
    torch.manual_seed(5)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), M2M100Translation(mc).parameters()))
    b = M2M100Translation(mc, seed=6)
    assert not torch.equal(a.shared.weight, b.shared.weight)  # type: ignore[union-attr]
    w = a.shared.weight.detach()  # type: ignore[union-attr]
    assert torch.all(w[mc.pad_token_id] == 0)
    assert abs(float(w.std()) - mc.init_std) < 0.02 * mc.init_std and abs(float(w.mean())) < 1e-3
    layer = a.encoder.layers["0"]
    assert torch.all(layer.final_layer_norm.weight == 1) and torch.all(layer.fc1.bias == 0)
    # distinct parameters of equal shape are drawn independently
    assert not torch.equal(layer.fc1.weight, a.decoder.layers["0"].fc1.weight)


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize(("p", "r"), MESHES)
def test_meta_stage_equals_the_one_process_models_slices(stage: str, p: int, r: int) -> None:
    mc = _config()
    model = _meta_stage(mc, stage, p, r)
    assert all(t.is_meta for t in model.parameters())
    materialize(model, torch.device("cpu"), keyed_init_fill(model, seed=11), p, r)
    _assert_same(model, _reference(mc, 11, stage, p, r))


def test_meta_built_model_runs_like_the_one_process_model() -> None:
    from tests.dist.test_tensor_parallel import _batch

    mc = _config(vocab_size=128)
    model = _meta_stage(mc, "whole", 1, 0)
    materialize(model, torch.device("cpu"), keyed_init_fill(model, seed=3), 1, 0)
    assert torch.equal(model.positions.table, M2M100Translation(mc, seed=3).positions.table)
    assert torch.equal(model(_batch()), M2M100Translation(mc, seed=3)(_batch()))


def test_keyed_init_draws_only_the_rows_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row slice draws only the row blocks it overlaps: no full tensor for a shard."""
    drawn: list[int] = []
    real = torch.Generator  # each row block is drawn from its own

    def counting(*a: object, **k: object) -> torch.Generator:
        drawn.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr("models.init.torch.Generator", counting)
    part = LocalSlice((1000, 8), 0, 640, 64, 64)
    value = keyed_init("shared.weight", part, 1, 0.02)
    assert len(drawn) == 1 and value.shape == (64, 8)
    monkeypatch.undo()
    assert torch.equal(value, keyed_init("shared.weight", LocalSlice.whole((1000, 8)), 1, 0.02)[640:704])


def test_materialize_errors_name_the_problem() -> None:
    mc = _config()
    model = _meta_stage(mc, "last", 1, 0)

    def short(parts: object) -> Iterator[tuple[str, torch.Tensor]]:
        yield "decoder.layer_norm.weight", torch.ones(16)

    with pytest.raises(ValueError, match=r"left \d+ parameters unset"):
        materialize(model, torch.device("cpu"), short)
    model = _meta_stage(mc, "last", 1, 0)

    def wrong(parts: object) -> Iterator[tuple[str, torch.Tensor]]:
        yield "decoder.layer_norm.weight", torch.ones(15)

    with pytest.raises(
        ValueError, match=r"decoder.layer_norm.weight: filled with shape \(15,\), holds \(16,\)"
    ):
        materialize(model, torch.device("cpu"), wrong)
    with pytest.raises(ValueError, match="no initialisation rule for parameter 'x.scale'"):
        keyed_init("x.scale", LocalSlice.whole((3,)), 0, 0.02)


def test_profile_by_kind_builds_one_layer_per_kind() -> None:
    from parallel.pipeline.profile import RunSetting, param_counts_per_block, profile_blocks_by_kind
    from tests.dist.test_tensor_parallel import _batch

    mc = _config(vocab_size=128)
    times, mems, counts = profile_blocks_by_kind(mc, _batch(), torch.device("cpu"), repeats=1)
    assert len(times) == len(mems) == len(counts) == len(block_specs(mc))
    with torch.device("meta"):
        assert counts == param_counts_per_block(M2M100Translation(mc))
    assert all(t > 0 for t in times) and all(m > 0 for m in mems)
    run = RunSetting(tp=2, dtype=torch.bfloat16, working_weights=True)  # a tp rank's shard, in bf16
    _, half, shard = profile_blocks_by_kind(mc, _batch(), torch.device("cpu"), repeats=1, run=run)
    layers = [i for i, s in enumerate(block_specs(mc)) if s.kind.value.endswith("_layer")]
    assert all(shard[i] < counts[i] and half[i] < mems[i] for i in layers)


def test_balancing_profiles_sparse_layers_with_the_runs_routing() -> None:
    """`partition_method: time | memory` measures a sparse layer with the run's routing options
    (dropless, or its capacity factor), not the model's defaults."""
    from parallel.pipeline.profile import one_layer_model
    from trainer.config.parse import load_config_dict
    from trainer.run.balance import run_setting

    moe = _config(vocab_size=128, num_experts=4, encoder_sparse_step=1, decoder_sparse_step=1)
    for options in ({"moe_capacity_factor": 0.5}, {"moe_dropless": True}):
        run = run_setting(load_config_dict({"output_dir": "/tmp/unused", **options}), 1, None)
        model, _ = one_layer_model(moe, torch.device("cpu"), run=run)
        assert model.moe.dropless == options.get("moe_dropless", False)
        assert model.moe.capacity_factor == options.get("moe_capacity_factor", 1.0)


# ----------------------------------------------------------------------------- pretrained slices


def _hf_dirs(tmp_path: Path, mc: ModelConfig) -> dict[str, Path]:
    """The same weights as one safetensors file, sharded safetensors, one .bin and sharded .bins."""
    single = tmp_path / "single"
    save_hf_model(dict(M2M100Translation(mc, seed=21).state_dict()), mc, single)
    state = load_file(single / "model.safetensors")
    config = (single / "config.json").read_text()
    keys = sorted(state)
    halves = {"a": keys[: len(keys) // 2], "b": keys[len(keys) // 2 :]}
    dirs = {"safetensors": single}
    for kind, ext, index in (
        ("sharded_safetensors", "safetensors", "model.safetensors.index.json"),
        ("sharded_bin", "bin", "pytorch_model.bin.index.json"),
    ):
        d = tmp_path / kind
        d.mkdir()
        (d / "config.json").write_text(config)
        weight_map = {}
        for half, names in halves.items():
            fname = f"part-{half}.{ext}"
            part = {k: state[k].clone() for k in names}
            save_file(part, d / fname) if ext == "safetensors" else torch.save(part, d / fname)
            weight_map.update(dict.fromkeys(names, fname))
        (d / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        dirs[kind] = d
    d = tmp_path / "bin"
    d.mkdir()
    (d / "config.json").write_text(config)
    aliased = {("lm_head.weight" if k == "model.shared.weight" else k): v for k, v in state.items()}
    torch.save(aliased, d / "pytorch_model.bin")
    dirs["bin"] = d  # the embedding only under its tied aliases, as some exports keep it
    return dirs


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _hf_dirs(tmp_path_factory.mktemp("hf"), _config())


@pytest.mark.parametrize("layout", ["safetensors", "sharded_safetensors", "bin", "sharded_bin"])
@pytest.mark.parametrize(
    ("stage", "p", "r"), [("whole", 1, 0), ("first", 2, 1), ("last", 4, 3), ("middle", 4, 0)]
)
def test_pretrained_slices_equal_the_loaded_models_shards(
    hf_dirs: dict[str, Path], layout: str, stage: str, p: int, r: int
) -> None:
    mc = _config()
    ref = M2M100Translation(mc, seed=0)
    ref.keep_only(STAGES[stage](ref.blocks))
    load_hf_into(ref, hf_dirs["safetensors"])
    if p > 1:
        with fake_tp(p, r) as group:
            apply_tensor_parallel(ref, group)  # type: ignore[arg-type]
    model = _meta_stage(mc, stage, p, r)
    materialize(model, torch.device("cpu"), pretrained_fill(hf_dirs[layout], model), p, r)
    _assert_same(model, dict(ref.named_parameters()))


@pytest.mark.parametrize("layout", ["sharded_safetensors", "sharded_bin"])
def test_loader_reads_only_the_slices_and_holds_one_tensor(
    hf_dirs: dict[str, Path], layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under tp=4 every read is a slice (never a whole tensor), reads add up to the rank's
    parts exactly, and the loader keeps no tensor it has yielded."""
    mc = _config()
    model = _meta_stage(mc, "whole", 4, 2)
    parts = local_slices(model, 4, 2)
    read_numel: list[int] = []
    real_read = hf._Checkpoint.read

    def counting_read(self: hf._Checkpoint, key: str, bounds: list[tuple[int, int]]) -> torch.Tensor:
        out = real_read(self, key, bounds)
        read_numel.append(out.numel())
        return out

    monkeypatch.setattr(hf._Checkpoint, "read", counting_read)
    alive: list[weakref.ref[torch.Tensor]] = []
    for name, value in read_hf_slices(hf_dirs[layout], parts, mc):
        assert sum(ref() is not None for ref in alive) == 0, f"loader still holds a tensor at {name}"
        assert value.untyped_storage().nbytes() == value.numel() * value.element_size()  # not a view
        assert tuple(value.shape) == parts[name].local_shape
        alive.append(weakref.ref(value))
        del value
    expected = sum(torch.Size(part.read_shape).numel() for part in parts.values())
    assert sum(read_numel) == expected
    full_numel = sum(torch.Size(part.full_shape).numel() for part in parts.values())
    assert expected < full_numel / 3  # a tp=4 rank reads about a quarter of the sharded tensors


def test_checkpoint_errors_name_the_tensor(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    mc = _config()
    parts: dict[str, LocalSlice | None] = {"encoder.layers.7.fc1.weight": None}
    with pytest.raises(CheckpointMismatchError, match=r"lacks \['encoder.layers.7.fc1.weight'\]"):
        dict(read_hf_slices(hf_dirs["sharded_bin"], parts, mc))
    wrong = {"encoder.layers.0.fc1.weight": LocalSlice.whole((33, 16))}
    with pytest.raises(
        CheckpointMismatchError, match=r"encoder.layers.0.fc1.weight: checkpoint shape \(32, 16\)"
    ):
        dict(read_hf_slices(hf_dirs["safetensors"], wrong, mc))
    (tmp_path / "config.json").write_text((hf_dirs["safetensors"] / "config.json").read_text())
    with pytest.raises(CheckpointMismatchError, match="holds no model.safetensors, pytorch_model.bin"):
        dict(read_hf_slices(tmp_path, parts, mc))


def test_build_arguments_are_checked_before_anything_is_built() -> None:
    from parallel.parallelize import build_parallel_model

    mc = _config()
    args = (None, [9], 1, "gpipe", 1, "none", 0.0)  # the mesh is never reached
    one_of = "exactly one of seed=, pretrained= or from_checkpoint="
    with pytest.raises(ValueError, match=f"{one_of} \\(got seed=None"):
        build_parallel_model(mc, *args)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=one_of):
        build_parallel_model(mc, *args, seed=1, pretrained="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=one_of):
        build_parallel_model(mc, *args, seed=1, from_checkpoint=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="this model already has weights"):
        build_parallel_model(M2M100Translation(mc, seed=0), *args, seed=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="before_tp needs a model with weights"):
        build_parallel_model(mc, *args, seed=1, before_tp=lambda m: None)  # type: ignore[arg-type]


def test_legacy_bin_is_a_clear_error(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((hf_dirs["safetensors"] / "config.json").read_text())
    state = load_file(hf_dirs["safetensors"] / "model.safetensors")
    torch.save(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointMismatchError, match="pytorch_model.bin cannot be memory-mapped"):
        dict(read_hf_slices(tmp_path, {"shared.weight": None}, _config()))
