"""Tensor parallelism matches the single-device model (parity ladder, rung 1), on gloo ranks.

Several checks share one spawned group (spawning dominates the run time on small
machines). Every rank seeds identically and builds the same single-device layer,
then compares its tp shard's output and gradients with the slice of the
single-device result it should hold (fp32, 1e-6 abs / 1e-5 rel).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from models.config import ModelConfig
from models.m2m100 import IGNORE_INDEX, M2M100Translation, Seq2SeqBatch
from parallel.grads import grad_sq_over_tp, sync_sequence_parallel_grads
from parallel.mesh import ParallelDims, ParallelMesh, build_mesh, rank_to_coords
from parallel.tp.apply import apply_tensor_parallel, gather_full_state_dict
from parallel.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    is_sequence_parallel_param,
    is_tp_sharded,
)
from parallel.tp.loss import vocab_parallel_cross_entropy
from tests.dist.dropout_checks import check_masks_per_rank, expected_loss_gap
from tests.dist.harness import run_distributed

pytestmark = pytest.mark.dist

ATOL, RTOL = 1e-6, 1e-5
VOCAB = 101  # not divisible by 2 or 4: exercises vocabulary padding


def _close(actual: Tensor | None, expected: Tensor | None, what: str) -> None:
    assert actual is not None and expected is not None, f"{what}: missing tensor"
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def _shard(t: Tensor, dim: int, group: Any) -> Tensor:
    return t.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)]


# ----------------------------------------------------------------------------- layer checks


def _check_column(group: Any) -> None:
    torch.manual_seed(1)
    lin = nn.Linear(16, 12)
    x = torch.randn(3, 5, 16, requires_grad=True)
    g = torch.randn(3, 5, 12)
    (lin(x) * g).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None and lin.bias.grad is not None
    for gather in (False, True):
        col = ColumnParallelLinear(lin, group, gather_output=gather)
        x_tp = x.detach().clone().requires_grad_(True)
        y = col(x_tp)
        ref_y = lin(x).detach()
        _close(y, ref_y if gather else _shard(ref_y, -1, group), f"column(gather={gather}) output")
        (y * (g if gather else _shard(g, -1, group))).sum().backward()
        _close(x_tp.grad, x.grad, "column input grad")
        _close(col.weight.grad, _shard(lin.weight.grad, 0, group), "column weight grad")
        assert col.bias is not None
        _close(col.bias.grad, _shard(lin.bias.grad, 0, group), "column bias grad")
        assert is_tp_sharded(col.weight) and is_tp_sharded(col.bias)


def _check_row(group: Any) -> None:
    torch.manual_seed(2)
    lin = nn.Linear(12, 16)
    x = torch.randn(3, 5, 12, requires_grad=True)
    g = torch.randn(3, 5, 16)
    ref_y = lin(x)
    (ref_y * g).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None and lin.bias.grad is not None
    for parallel_in in (True, False):
        row = RowParallelLinear(lin, group, input_is_parallel=parallel_in)
        x_tp = (_shard(x.detach(), -1, group) if parallel_in else x.detach()).clone().requires_grad_(True)
        y = row(x_tp)
        _close(y, ref_y.detach(), f"row(input_is_parallel={parallel_in}) output")
        (y * g).sum().backward()
        _close(x_tp.grad, _shard(x.grad, -1, group) if parallel_in else x.grad, "row input grad")
        _close(row.weight.grad, _shard(lin.weight.grad, 1, group), "row weight grad")
        assert row.bias is not None
        _close(row.bias.grad, lin.bias.grad, "row bias grad (replicated)")
        assert is_tp_sharded(row.weight) and not is_tp_sharded(row.bias)


def _padded(t: Tensor, rows: int) -> Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _check_embedding_and_head(group: Any) -> None:
    p = dist.get_world_size(group)
    torch.manual_seed(3)
    emb = nn.Embedding(VOCAB, 8, padding_idx=1)
    ids = torch.randint(0, VOCAB, (4, 7))
    ids[0, :3] = 1
    ids[1, 0], ids[1, 1] = 0, VOCAB - 1  # first and last real ids
    g = torch.randn(4, 7, 8)
    (emb(ids) * g).sum().backward()
    vpe = VocabParallelEmbedding(emb, group)
    padded = -(-VOCAB // p) * p
    assert vpe.padded_vocab_size == padded and vpe.weight.shape[0] == padded // p
    out = vpe(ids)
    _close(out, emb(ids).detach(), "vocab-parallel embedding output")
    (out * g).sum().backward()
    assert emb.weight.grad is not None and vpe.weight.grad is not None
    _close(vpe.weight.grad, _shard(_padded(emb.weight.grad, padded), 0, group), "embedding weight grad")
    _close(vpe.weight.detach(), _shard(_padded(emb.weight.detach(), padded), 0, group), "embedding shard")

    # LM head: logits shard = h E_r^T, padding columns never predicted.
    h = torch.randn(2, 3, 8)
    head = VocabParallelLMHead(group, VOCAB, vpe.vocab_start)
    local = head(h, vpe.weight)  # (B, T, V'/p)
    ref = F.linear(h, emb.weight)  # (B, T, V)
    n_real = max(0, min(VOCAB - vpe.vocab_start, local.shape[-1]))
    _close(
        local[..., :n_real], ref[..., vpe.vocab_start : vpe.vocab_start + n_real].detach(), "lm head shard"
    )
    assert bool((local[..., n_real:] == torch.finfo(local.dtype).min).all())


def _check_cross_entropy(group: Any) -> None:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    padded = -(-VOCAB // p) * p
    per = padded // p
    torch.manual_seed(4)
    logits = torch.randn(3, 6, VOCAB) * 3
    labels = torch.randint(0, VOCAB, (3, 6))
    labels[0, 4:] = IGNORE_INDEX
    labels[2, 0], labels[2, 1] = 0, VOCAB - 1
    for eps in (0.0, 0.1):
        for pad_value in (0.0, 50.0):  # raw padding logits, even large ones, must be ignored
            full = logits.clone().requires_grad_(True)
            ref = F.cross_entropy(
                full.view(-1, VOCAB),
                labels.view(-1),
                ignore_index=IGNORE_INDEX,
                reduction="sum",
                label_smoothing=eps,
            )
            ref.backward()
            pad = torch.full((3, 6, padded - VOCAB), pad_value)
            local = torch.cat([logits, pad], -1)[..., r * per : (r + 1) * per].clone().requires_grad_(True)
            loss = vocab_parallel_cross_entropy(local, labels, group, r * per, VOCAB, label_smoothing=eps)
            _close(loss, ref.detach(), f"vocab-parallel CE (eps={eps}, pad={pad_value})")
            (loss * 2.0).backward()
            assert full.grad is not None
            ref_grad = torch.cat([full.grad * 2.0, torch.zeros(3, 6, padded - VOCAB)], -1)
            _close(local.grad, ref_grad[..., r * per : (r + 1) * per], f"CE grad (eps={eps})")


# ----------------------------------------------------------------------------- whole model


def _tiny_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        max_position_embeddings=64,
    )


def _batch(s_len: int = 8, t_len: int = 8) -> Seq2SeqBatch:
    g = torch.Generator().manual_seed(5)
    b = 3
    src = torch.randint(4, VOCAB, (b, s_len), generator=g)
    mask = torch.ones(b, s_len, dtype=torch.long)
    mask[1, s_len - 3 :] = 0
    src[mask == 0] = 1
    dec = torch.randint(4, VOCAB, (b, t_len), generator=g)
    dec[:, 0] = 2
    labels = torch.cat([dec[:, 1:], torch.full((b, 1), 2)], dim=1)
    labels[2, t_len - 2 :] = IGNORE_INDEX
    dec[2, t_len - 2 :] = 1
    return Seq2SeqBatch(src, mask, dec, labels)


def _check_model(group: Any, sequence_parallel: bool) -> None:
    torch.manual_seed(0)
    ref = M2M100Translation(_tiny_config())
    model = copy.deepcopy(ref)
    batch = _batch()
    ref_logits = ref(batch)
    ref_loss, ref_n = ref.loss(batch, label_smoothing=0.1)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    ref_weights = {n: p.detach() for n, p in ref.named_parameters()}

    info = apply_tensor_parallel(model, group, sequence_parallel=sequence_parallel)
    p = dist.get_world_size(group)
    assert (
        info.padded_vocab_size == -(-VOCAB // p) * p
        and info.vocab_end - info.vocab_start == info.padded_vocab_size // p
    )
    assert {n for n, _ in model.named_parameters()} == set(ref_weights), "tp must keep parameter names"
    weights = gather_full_state_dict(model, group)
    for name, w in ref_weights.items():
        _close(weights[name], w, f"gathered weight {name}")
    local_logits = model(batch)  # (B, T, V'/p)
    _close(info.gather_logits(local_logits), ref_logits.detach(), f"logits (sp={sequence_parallel})")
    loss = info.loss(local_logits, batch.labels, label_smoothing=0.1)
    assert batch.num_tokens() == ref_n
    _close(loss, ref_loss.detach(), f"model loss (sp={sequence_parallel})")
    loss.backward()
    if sequence_parallel:
        assert any(is_sequence_parallel_param(q) for q in model.parameters())
        sync_sequence_parallel_grads(list(model.parameters()), group)
    grads = gather_full_state_dict(model, group, grads=True)
    assert set(grads) == set(ref_grads)
    for name, grad in ref_grads.items():
        _close(grads[name], grad, f"grad {name} (sp={sequence_parallel})")
    norm_sq = grad_sq_over_tp(list(model.parameters()), group)
    ref_norm_sq = sum(g.pow(2).sum() for g in ref_grads.values())
    _close(norm_sq, torch.as_tensor(ref_norm_sq), "grad norm^2 (replicated counted once)")


def _check_sequence_parallel_length(group: Any) -> None:
    """Sequence parallelism splits T: a length tp does not divide is a clear error on every rank."""
    torch.manual_seed(0)
    model = M2M100Translation(_tiny_config())
    apply_tensor_parallel(model, group, sequence_parallel=True)
    p = dist.get_world_size(group)
    with pytest.raises(ValueError, match=rf"sequence length \(7\) divisible by tp\({p}\)"):
        model(_batch(s_len=8, t_len=7))


def _check_pruned_stage(group: Any) -> None:
    """A pipeline stage holding only decoder layers and the head (no `shared` lookups)."""
    torch.manual_seed(0)
    model = M2M100Translation(_tiny_config())
    model.keep_only([b for b in model.blocks if b.kind.value in ("dec_layer", "head")])
    info = apply_tensor_parallel(model, group)
    assert info.vocab_size == VOCAB
    assert all(hasattr(q, "tp_sharded") for q in model.parameters())


CHECKS: dict[str, Callable[[Any], Any]] = {
    "column_linear": _check_column,
    "row_linear": _check_row,
    "embedding_and_head": _check_embedding_and_head,
    "cross_entropy": _check_cross_entropy,
    "model": lambda group: _check_model(group, sequence_parallel=False),
    "model_sequence_parallel": lambda group: _check_model(group, sequence_parallel=True),
    "sequence_parallel_length": _check_sequence_parallel_length,
    "pruned_stage": _check_pruned_stage,
    "dropout_masks": lambda group: check_masks_per_rank(group, False, _batch(), VOCAB),
    "dropout_masks_sequence_parallel": lambda group: check_masks_per_rank(group, True, _batch(), VOCAB),
    "dropout_masks_experts": lambda group: check_masks_per_rank(group, False, _batch(), VOCAB, sparse=True),
    # measured at tp=2 only (the quick tier's time): the mask checks cover tp=4
    "dropout_expected_loss": lambda group: (
        expected_loss_gap(group, _batch(), VOCAB) if dist.get_world_size(group) == 2 else None
    ),
}


def _run_checks(prefix: str, group: Any, out: dict[str, Any]) -> None:
    for name, check in CHECKS.items():
        try:
            figure = check(group)
            out[f"{prefix}/{name}"] = "ok"
            if figure is not None:
                out[f"{prefix}/{name}/figure"] = figure
        except Exception:  # noqa: BLE001 - reported per check by the tests below
            out[f"{prefix}/{name}"] = traceback.format_exc()


def _mesh_facts(mesh: ParallelMesh, rank: int) -> dict[str, Any]:
    assert tuple(mesh.device_mesh.get_coordinate() or ()) == mesh.coords
    sums = {}
    for axis in ("pp", "dp", "tp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.group(axis))
        sums[axis] = int(t.item())
    first_last = mesh.pp_subgroup((0, mesh.dims.pp - 1))
    assert first_last is not None
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=first_last)
    return {
        "coords": mesh.coords,
        "sums": sums,
        "peers": [mesh.pp_peer(s) for s in range(mesh.dims.pp)],
        "sizes": [mesh.size(a) for a in ("pp", "dp", "tp")],
        "first_last": int(t.item()),
        "tp_mesh": mesh["tp"].mesh.tolist(),
        "dp_tp_mesh": mesh["dp", "tp"].mesh.tolist(),
        "sub_meshes_made_once": mesh["tp"] is mesh["tp"] and mesh["dp", "tp"] is mesh["dp", "tp"],
    }


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    """One spawn for everything: a (2, 2, 2) mesh with its tp=2 groups, then a (2, 1, 4) mesh."""
    out: dict[str, Any] = {}
    mesh = build_mesh(ParallelDims(pp=2, dp=-1, tp=2, world_size=world_size).validate(), "cpu")
    out["mesh"] = _mesh_facts(mesh, rank)
    _run_checks("tp2", mesh.group("tp"), out)
    mesh4 = build_mesh(ParallelDims(pp=2, dp=1, tp=4, world_size=world_size).validate(), "cpu")
    out["mesh4_coords"] = mesh4.coords
    _run_checks("tp4", mesh4.group("tp"), out)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_worker, world_size=8, timeout=150, collective_timeout=30)


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_matches_single_device(results: list[dict[str, Any]], tp: int, check: str) -> None:
    for rank, res in enumerate(results):
        status = res[f"tp{tp}/{check}"]
        assert status == "ok", f"rank {rank}, tp={tp}, {check}:\n{status}"


def test_dropout_keeps_the_expected_loss(results: list[dict[str, Any]]) -> None:
    """Per-rank masks have the single-device distribution: the mean dropout loss at tp=2 over 64
    draws is within noise of one device's (the figure, z in standard errors, is printed; over
    512 draws z = -0.28)."""
    tp = 2
    fig = results[0][f"tp{tp}/dropout_expected_loss/figure"]
    print(f"tp={tp}: mean loss {fig['mean_tp']:.4f} vs one device {fig['mean_one']:.4f} "
          f"over {fig['draws']} draws each, SE {fig['se']:.4f}, z = {fig['z']:+.2f}")  # fmt: skip
    assert abs(fig["z"]) < 4.0


def test_mesh_coordinates_on_8_ranks(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        facts = res["mesh"]
        pp_i, dp_i, tp_i = facts["coords"]
        assert facts["coords"] == rank_to_coords(rank, (2, 2, 2))
        assert rank == (pp_i * 2 + dp_i) * 2 + tp_i
        assert facts["sizes"] == [2, 2, 2]
        peers = [(s * 2 + dp_i) * 2 + tp_i for s in range(2)]
        assert facts["peers"] == peers
        assert facts["sums"]["pp"] == sum(peers) == facts["first_last"]
        tp_ranks = [(pp_i * 2 + dp_i) * 2 + t for t in range(2)]
        assert facts["sums"]["tp"] == sum(tp_ranks) and facts["tp_mesh"] == tp_ranks
        assert facts["dp_tp_mesh"] == [[(pp_i * 2 + d) * 2 + t for t in range(2)] for d in range(2)]
        assert facts["sub_meshes_made_once"]
        assert facts["sums"]["dp"] == sum((pp_i * 2 + d) * 2 + tp_i for d in range(2))
        assert res["mesh4_coords"] == (rank // 4, 0, rank % 4)


def test_single_process_runs_without_torchrun() -> None:
    """`python -m ...` with no env vars: a 1-rank group, tp=1 applied, same loss as the plain model."""
    code = textwrap.dedent("""
        import torch
        from models.config import ModelConfig
        from models.m2m100 import M2M100Translation
        from parallel.mesh import ParallelDims, build_mesh, init_distributed
        from parallel.tp.apply import apply_tensor_parallel
        from tests.dist.test_tensor_parallel import _batch, _tiny_config
        init_distributed(timeout_s=30)
        mesh = build_mesh(ParallelDims(pp=1, dp=-1, tp=1, world_size=1).validate(), "cpu")
        torch.manual_seed(0)
        ref = M2M100Translation(_tiny_config())
        torch.manual_seed(0)
        model = M2M100Translation(_tiny_config())
        info = apply_tensor_parallel(model, mesh)
        b = _batch()
        assert torch.allclose(info.loss(model(b), b.labels), ref.loss(b)[0])
        print("ok", mesh.coords, info.padded_vocab_size)
    """)
    env = {
        k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-3000:]
    # the last line: torch 2.8 / 2.9's gloo prints "[Gloo] Rank 0 is connected to 0 peer ranks" first
    assert out.stdout.strip().splitlines()[-1] == f"ok (0, 0, 0) {VOCAB}", out.stdout
