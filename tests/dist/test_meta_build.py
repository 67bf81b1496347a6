"""Stage-local construction on 4 gloo ranks, (pp=2, dp=1, tp=2): every rank builds only its
stage's tp shards from the config (keyed init or an HF directory read slice by slice), and
they equal the one-process model's parameters cut by the pipeline and sliced by tp; the
meta-built parallel model's loss equals the one-process model's.
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
from parallel.mesh import ParallelDims, build_mesh
from parallel.parallelize import build_parallel_model
from parallel.tp.apply import apply_tensor_parallel
from tests.dist.harness import run_distributed
from tests.dist.test_tensor_parallel import _batch, _tiny_config

SEED = 7
BALANCE = [4, 4]  # 2 enc + 2 dec layers: 8 blocks


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
    return out


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
