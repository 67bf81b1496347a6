"""Stage-local construction on 4 gloo ranks, (pp=2, dp=1, tp=2): every rank builds only its
stage's tp shards from the config (keyed init or an HF directory read slice by slice), and
they equal the one-process model's parameters cut by the pipeline and sliced by tp; the
meta-built parallel model's loss equals the one-process model's.

Under fsdp, (1, 2, 2) and (2, 2, 1) on the same ranks, FSDP shards the meta model first and
each rank gives memory only to its dp shard (issue 23: it used to materialise its whole tp
shard, then cut it over dp): the parameters held while the fill runs are half the stage's,
and the gathered weights equal the one-process model's bit for bit (keyed init and HF
slices, uneven dp chunks included); a build for a checkpoint draws nothing and holds zeros.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from models.hf import load_hf_into
from models.hf_save import save_hf_model
from models.m2m100 import M2M100Translation
import parallel.materialize as materialize_module
from parallel.dp.fsdp import dp_chunk, local
from parallel.mesh import ParallelDims, build_mesh
from parallel.parallelize import build_parallel_model
from parallel.tp.apply import apply_tensor_parallel
from parallel.tp.layers import tp_local_slice
from tests.dist.harness import run_distributed
from tests.dist.test_tensor_parallel import _batch, _tiny_config

SEED = 7
BALANCE = [4, 4]  # 2 enc + 2 dec layers: 8 blocks
FSDP_MESHES = ((1, 2, 2), (2, 2, 1))  # (pp, dp, tp); vocabulary 101: tp pads it, dp=2 cuts it unevenly


def _compare(pm: Any, ref: M2M100Translation) -> str:
    got, want = pm.named_params(), dict(ref.named_parameters())
    if set(got) != set(want):
        return f"names differ: {sorted(set(got) ^ set(want))[:5]}"
    bad = [n for n in got if not torch.equal(got[n].detach(), want[n].detach())]
    return f"differ: {bad[:5]}" if bad else "ok"


def _reference(mesh: Any, pm: Any, hf_dir: str | None) -> M2M100Translation:
    """The one-process model (keyed init, or loaded), cut to this rank's blocks and tp-sliced."""
    ref = M2M100Translation(_tiny_config(), seed=SEED)
    ref.keep_only(pm.plan.rank_blocks(mesh.pp_rank))
    if hf_dir is not None:
        load_hf_into(ref, hf_dir)
    apply_tensor_parallel(ref, mesh.group("tp"))
    return ref


def _worker(rank: int, world_size: int, hf_dir: str) -> dict[str, Any]:
    mesh = build_mesh(ParallelDims(pp=2, dp=1, tp=2, world_size=world_size).validate(), "cpu")
    out: dict[str, Any] = {}
    for case, kw in (("seed", {"seed": SEED}), ("pretrained", {"pretrained": hf_dir})):
        try:
            pm = build_parallel_model(_tiny_config(), mesh, BALANCE, 2, "1f1b", 1, "none", 0.0, **kw)  # type: ignore[arg-type]
            out[case] = _compare(pm, _reference(mesh, pm, kw.get("pretrained")))  # type: ignore[arg-type]
            out[f"{case}_loss"] = pm.eval_loss([_batch(), _batch(s_len=6, t_len=5)])
            out[f"{case}_numel"] = sum(p.numel() for p in pm.params())
        except Exception:  # noqa: BLE001 - reported by the tests below
            out[case] = traceback.format_exc()
    for pp, dp, tp in FSDP_MESHES:
        mesh = build_mesh(ParallelDims(pp=pp, dp=dp, tp=tp, world_size=world_size).validate(), "cpu")
        for case, kw in (("seed", {"seed": SEED}), ("pretrained", {"pretrained": hf_dir})):
            out.update(_fsdp_case(f"fsdp{pp}{dp}{tp}-{case}", mesh, kw))
    out["fsdp-checkpoint-zeros"] = _fsdp_for_checkpoint(mesh)
    return out


def _fsdp_case(name: str, mesh: Any, kw: dict[str, Any]) -> dict[str, Any]:
    """Build under fsdp, recording the parameter bytes held at each value the fill yields; compare
    the gathered weights and the loss with the one-process model's. The collectives run on every
    rank whatever a rank's checks find, so a failure is reported, never a hang."""
    from tests.dist.fsdp_workers import full

    held: list[int] = []
    balance = [8] if mesh.size("pp") == 1 else BALANCE
    try:
        with pytest.MonkeyPatch.context() as mp:
            for fill in ("keyed_init_fill", "pretrained_fill"):
                mp.setattr(materialize_module, fill, _recording(getattr(materialize_module, fill), held))
            pm = build_parallel_model(_tiny_config(), mesh, balance, 2, "1f1b", 1, "none", 0.0,
                                      dp_sharding="fsdp", **kw)  # fmt: skip
        error = None
    except Exception:  # noqa: BLE001 - reported by the tests below
        error = traceback.format_exc()
    if not _everywhere(error is None):  # no collective below unless every rank built
        return {name: error or "the build failed on another rank"}
    gathered = {n: full(pm, n, p) for n, p in pm.named_params().items()}  # collective
    loss = pm.eval_loss([_batch(), _batch(s_len=6, t_len=5)])  # collective
    try:
        ref = M2M100Translation(_tiny_config(), seed=SEED)
        if "pretrained" in kw:
            load_hf_into(ref, kw["pretrained"])
        want = {n: p.detach() for n, p in ref.named_parameters()}
        bad = []
        for n, p in pm.named_params().items():
            part = tp_local_slice(p, mesh.size("tp"), mesh.tp_rank)  # this rank's tp piece, padding zero
            piece = part.pad(want[n][tuple(slice(*part.bounds(d)) for d in range(p.dim()))])
            if not (torch.equal(local(p), dp_chunk(p, piece)) and torch.equal(gathered[n], want[n])):
                bad.append(n)
        result = f"differ: {bad[:5]}" if bad else "ok"
    except Exception:  # noqa: BLE001 - reported by the tests below
        result = traceback.format_exc()
    stage_bytes = sum(p.numel() * p.element_size() for p in pm.params())  # the tp shard's, unsharded
    return {name: result, f"{name}_held": max(held) / stage_bytes, f"{name}_loss": loss}


def _everywhere(ok: bool) -> bool:
    """True on every rank iff `ok` is true on every rank (collective)."""
    import torch.distributed as dist

    flag = torch.tensor(int(ok))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag)


def _recording(make: Any, held: list[int]) -> Any:
    """`make` (a fill factory) whose fill appends the bytes the model's parameters hold per value."""

    def make_fill(*args: Any) -> Any:
        model = next(a for a in args if isinstance(a, M2M100Translation))
        fill = make(*args)

        def recorded(parts: Any) -> Any:
            for item in fill(parts):
                held.append(sum(local(p).untyped_storage().nbytes() for p in model.parameters()))
                yield item

        return recorded

    return make_fill


def _fsdp_for_checkpoint(mesh: Any) -> str:
    """A build for a checkpoint to load (resume) draws nothing and leaves zeros in every shard."""
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(M2M100Translation, "init_value", None)  # a draw would fail here
            pm = build_parallel_model(_tiny_config(), mesh, BALANCE, 2, "1f1b", 1, "none", 0.0,
                                      dp_sharding="fsdp", from_checkpoint=True)  # fmt: skip
        nonzero = [n for n, p in pm.named_params().items() if local(p).count_nonzero()]
        return f"not zero: {nonzero[:5]}" if nonzero else "ok"
    except Exception:  # noqa: BLE001 - reported by the test below
        return traceback.format_exc()


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    hf_dir = tmp_path_factory.mktemp("hf") / "model"
    trained = M2M100Translation(_tiny_config(), seed=99)  # other weights than the keyed init
    save_hf_model(dict(trained.state_dict()), _tiny_config(), hf_dir)
    return run_distributed(
        _worker, world_size=4, args=(str(hf_dir),), timeout=180, collective_timeout=30
    ), hf_dir


@pytest.mark.parametrize("case", ["seed", "pretrained"])
def test_each_rank_builds_exactly_its_slices(setup: tuple[list[dict[str, Any]], Path], case: str) -> None:
    results, hf_dir = setup
    for rank, res in enumerate(results):
        assert res[case] == "ok", f"rank {rank}, {case}:\n{res[case]}"
    full = sum(p.numel() for p in M2M100Translation(_tiny_config(), seed=0).parameters())
    assert all(
        res[f"{case}_numel"] < 0.6 * full for res in results
    )  # a quarter of the layers, half the vocab...


@pytest.mark.parametrize("case", ["seed", "pretrained"])
@pytest.mark.parametrize("mesh", ["fsdp122", "fsdp221"])
def test_fsdp_builds_only_the_dp_shard_equal_to_one_process(
    setup: tuple[list[dict[str, Any]], Path], case: str, mesh: str
) -> None:
    results, hf_dir = setup
    name = f"{mesh}-{case}"
    model = M2M100Translation(_tiny_config(), seed=SEED)
    if case == "pretrained":
        load_hf_into(model, hf_dir)
    with torch.no_grad():
        want = sum(float(model.loss(b)[0]) for b in (_batch(), _batch(s_len=6, t_len=5)))
    for rank, res in enumerate(results):
        assert res[name] == "ok", f"rank {rank}, {name}:\n{res[name]}"
        # dp = 2: half the stage (+ an uneven chunk's row), not all of it as before
        assert res[f"{name}_held"] <= 0.55, f"rank {rank}, {name}: held {res[f'{name}_held']:.2f} of the stage"
        loss_sum, tokens = res[f"{name}_loss"]
        if tokens:
            assert loss_sum == pytest.approx(want, rel=1e-5), (rank, name)
    last_stage_ranks = 4 if mesh == "fsdp122" else 2  # pp = 1: every rank; pp = 2: ranks 2, 3
    assert sum(res[f"{name}_loss"][1] > 0 for res in results) == last_stage_ranks
    for rank, res in enumerate(results):
        assert res["fsdp-checkpoint-zeros"] == "ok", f"rank {rank}:\n{res['fsdp-checkpoint-zeros']}"


@pytest.mark.parametrize("case", ["seed", "pretrained"])
def test_meta_built_model_has_the_one_process_loss(
    setup: tuple[list[dict[str, Any]], Path], case: str
) -> None:
    results, hf_dir = setup
    model = M2M100Translation(_tiny_config(), seed=SEED)
    if case == "pretrained":
        load_hf_into(model, hf_dir)
    with torch.no_grad():
        want = sum(float(model.loss(b)[0]) for b in (_batch(), _batch(s_len=6, t_len=5)))
    last = [res[f"{case}_loss"] for res in results[2:]]  # pp rank 1: ranks 2, 3 hold the loss
    for loss_sum, tokens in last:
        assert tokens > 0 and loss_sum == pytest.approx(want, rel=1e-5)
