"""The NLLB-MoE model (sparse layers in the block list), one process: where the sparse layers are,
training semantics that must not depend on how a batch is cut (dropless routing), the aux loss's
gradient equal to fairseq's criterion, keyed randomness under remat, keyed expert init, and the
config's errors."""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from models.init import LocalSlice
from models.m2m100 import IGNORE_INDEX, M2M100Translation, Seq2SeqBatch
from parallel.remat import apply_remat

CFG = dict(
    vocab_size=61,
    d_model=16,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=24,
    decoder_ffn_dim=20,
    num_experts=8,
    encoder_sparse_step=2,
    decoder_sparse_step=1,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    moe_token_dropout=0.0,
    max_position_embeddings=32,
)


def model(**overrides: object) -> M2M100Translation:
    m = M2M100Translation(ModelConfig(**{**CFG, **overrides}), seed=3)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "router" in name:
                p.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(len(name)))
    return m.train()


def batch(rows: int = 4, seed: int = 0) -> Seq2SeqBatch:
    g = torch.Generator().manual_seed(seed)
    src_lens = [9, 5, 7, 3, 8, 6][:rows]
    tgt_lens = [6, 4, 7, 2, 5, 3][:rows]
    src = torch.full((rows, max(src_lens)), 1)
    lab = torch.full((rows, max(tgt_lens)), IGNORE_INDEX)
    for i, (s, t) in enumerate(zip(src_lens, tgt_lens)):
        src[i, :s] = torch.randint(4, 61, (s,), generator=g)
        lab[i, :t] = torch.randint(4, 61, (t,), generator=g)
    dec = torch.full_like(lab, 1)  # as trainer.data.batching.collate: `</s> y[:-1]`, then pad
    for i, t in enumerate(tgt_lens):
        dec[i, :t] = torch.cat([torch.tensor([2]), lab[i, : t - 1]])
    return Seq2SeqBatch(src, (src != 1).long(), dec, lab)


def grads(m: M2M100Translation, parts: list[Seq2SeqBatch], total_tokens: int) -> dict[str, torch.Tensor]:
    """Gradients of the step's loss as the executor computes it: each micro-batch's loss sum
    times 1 / tokens(global batch), the aux loss's scale set once for the step."""
    m.zero_grad()
    m.moe.begin_step(seed=0, step=1, loss_scale=1.0 / total_tokens)
    for b in parts:
        loss, _ = m.loss(b)
        (loss / total_tokens).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_sparse_layers_where_transformers_puts_them() -> None:
    m = model()
    assert m.config.sparse_layers() == [
        "encoder.layers.1",
        "decoder.layers.0",
        "decoder.layers.1",
    ]
    names = dict(m.named_parameters())
    assert names["encoder.layers.1.ffn.experts.fc1_weight"].shape == (8, 24, 16)
    assert names["decoder.layers.0.ffn.experts.fc2_weight"].shape == (8, 16, 20)
    assert (
        "encoder.layers.0.fc1.weight" in names
        and "encoder.layers.0.ffn.router.classifier.weight" not in names
    )
    assert sum(p.numel() for p in m.parameters()) == m.config.num_parameters()
    assert [b.name for b in m.blocks] == [
        b.name for b in M2M100Translation(ModelConfig(**{**CFG, "num_experts": 0})).blocks
    ]


def test_dropless_gradients_do_not_depend_on_the_grouping() -> None:
    """Dropless, no aux loss: routing is per token, so micro-batches of any size give the
    unsplit batch's gradients (what lets a sharded run equal one process)."""
    m = model(router_aux_loss_coef=0.0)
    m.moe.dropless = True
    whole = batch()
    ref = grads(m, [whole], whole.num_tokens())
    got = grads(m, whole.split(2), whole.num_tokens())
    assert ref.keys() == got.keys() and any("experts" in n for n in ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-6, msg=name)
    m.moe.dropless = False  # with capacity, the grouping changes which tokens are dropped
    assert any(not torch.allclose(grads(m, whole.split(2), whole.num_tokens())[n], ref[n]) for n in ref)


def test_aux_loss_gradient_is_fairseqs_criterion() -> None:
    """loss = (sum_mb CE_mb + coef * sum_mb ntokens_mb * mean_layers(aux_mb)) / ntokens, the
    aux part reaching the router through `AuxLossScaler` where each layer runs."""
    coef = 0.05
    m = model(router_aux_loss_coef=coef)
    whole = batch(rows=6, seed=1)
    parts = whole.split(2)
    got = grads(m, parts, whole.num_tokens())
    m.zero_grad()
    m.moe.begin_step(0, 1, 0.0)  # no scaler: the criterion by hand
    auxes: list[torch.Tensor] = []
    hooks = [
        ffn.router.register_forward_hook(lambda mod, args, out: auxes.append(out.aux_loss))
        for ffn in m.sparse_ffns().values()
    ]
    for b in parts:
        auxes.clear()
        ce, n = m.loss(b)
        ((ce + coef * n * torch.stack(auxes).mean()) / whole.num_tokens()).backward()
    for h in hooks:
        h.remove()
    for name, p in m.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_keyed_randomness_replays_under_remat() -> None:
    """Sampling policy and expert output masking draw from (seed, step, slot, layer)-keyed
    generators: a rematerialised model (layers recomputed in backward) has the same gradients."""
    kw = dict(second_expert_policy="sampling", moe_token_dropout=0.3)
    plain, remat = model(**kw), model(**kw)
    assert apply_remat(remat, "full") == 4
    b = batch()
    g1, g2 = grads(plain, [b], b.num_tokens()), grads(remat, [b], b.num_tokens())
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], msg=name)
    b2 = batch()
    b2.slot = 1  # another micro-batch: other draws
    assert not torch.equal(plain(b2), plain(b))


def test_keyed_init_of_an_expert_range_equals_the_whole_models_slice() -> None:
    m = model()
    with torch.device("meta"):
        meta = M2M100Translation(m.config)
    name = "decoder.layers.1.ffn.experts.fc2_weight"
    part = meta.init_value(name, LocalSlice((8, 16, 20), 0, 5, 3, 3), seed=3)
    torch.testing.assert_close(part, M2M100Translation(m.config, seed=3).state_dict()[name][5:8])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_experts": 1}, "num_experts=1 must be 0"),
        ({"second_expert_policy": "top1"}, "second_expert_policy='top1' is unknown"),
        ({"moe_token_dropout": 1.0}, "moe_token_dropout=1.0 must be in"),
        ({"router_dtype": "int8"}, "router_dtype='int8' is unknown"),
        ({"moe_eval_capacity_token_fraction": 1.5}, "moe_eval_capacity_token_fraction=1.5 must be <= 1"),
    ],
)
def test_bad_moe_config_is_one_line_naming_the_field(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**CFG, **overrides})


def test_expert_load_row_sums_the_window_without_reading_per_step() -> None:
    """`trainer.run.moe_load.ExpertLoad`: per layer, assignments per expert per step, the dropped
    fraction and the token-weighted aux loss over the window's micro-batches."""
    from trainer.run.moe_load import ExpertLoad, load_line

    m = model()
    load = ExpertLoad(m, torch.device("cpu"))
    parts = batch(rows=6).split(3)
    recorded = []
    for step in (1, 2):
        m.moe.begin_step(0, step, 0.0)
        for b in parts:
            m.loss(b)
        recorded.append({k: list(f.last_stats.values()) for k, f in m.sparse_ffns().items()})
        load.collect()
    row = load.row(load.values().tolist())
    for name, short in (("encoder.layers.1", "enc1"), ("decoder.layers.0", "dec0")):
        stats = [s for r in recorded for s in r[name]]
        per_expert = torch.stack([s.tokens_per_expert for s in stats]).sum(0).double() / 2
        assert row[f"moe_{short}_tokens_max"] == pytest.approx(per_expert.max().item())
        assert row[f"moe_{short}_tokens_mean"] == pytest.approx(per_expert.mean().item())
        dropped = sum(int(s.dropped) for s in stats) / (2 * per_expert.sum().item())
        assert row[f"moe_{short}_dropped"] == pytest.approx(dropped)
        aux = sum(float(s.aux_loss) * s.num_tokens for s in stats) / sum(s.num_tokens for s in stats)
        assert row[f"moe_{short}_aux_loss"] == pytest.approx(aux)
    assert row["moe_dec0_tokens_mean"] * 8 == pytest.approx(2 * sum(b.num_tokens() for b in parts))
    assert "enc1 max/mean" in load_line(row)
    assert load.row(load.values().tolist())["moe_enc1_tokens_max"] == 0  # the window was reset


@pytest.mark.parametrize(
    ("grouped", "dropless", "reads"), [(True, False, 0), (True, True, 0), (False, False, 0), (False, True, 3)]
)
def test_device_reads_of_a_training_forward_and_backward(grouped: bool, dropless: bool, reads: int) -> None:
    """No read back to the host in a sparse model's training step (the hot path), except the
    capacity buffer's size under dropless routing: one per sparse layer (3 here)."""
    from models.moe import LocalDispatcher
    from parallel.dispatch_count import DispatchCounter

    m = model(second_expert_policy="random", moe_token_dropout=0.2, dropout=0.1)
    m.moe.dropless = dropless
    for ffn in m.sparse_ffns().values():
        ffn.dispatcher = LocalDispatcher(grouped)
    b = batch()
    m.moe.begin_step(0, 1, 1.0 / b.num_tokens())
    with DispatchCounter() as counter:
        loss, _ = m.loss(b)
        loss.backward()
    assert counter.host_reads == reads


def test_an_fp32_router_keeps_fp32_weights_under_mixed_precision() -> None:
    """bf16 working weights (several micro-batches per step) and FSDP's bf16 units leave an fp32
    router's classifier in fp32, so routing does not depend on how a step is cut; a bf16 router
    (router_dtype bfloat16) is cast with the rest."""
    from parallel.dp.fsdp import _units
    from parallel.mixed_precision import WorkingWeights

    m = model()
    x = torch.randn(10, CFG["d_model"])  # type: ignore[arg-type]
    routers = [ffn.router for ffn in m.sparse_ffns().values()]
    reference = [r.logits(x) for r in routers]
    with WorkingWeights(m, torch.bfloat16).swapped(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert all(r.classifier.weight.dtype == torch.float32 for r in routers)
        assert all(torch.equal(r.logits(x), ref) for r, ref in zip(routers, reference))
        assert m.encoder.layers["1"].ffn.experts.fc1_weight.dtype == torch.bfloat16  # type: ignore[index]
    fp32_units = [unit for unit, policy, _ in _units(m, torch.bfloat16) if policy.param_dtype is None]
    assert all(any(r.classifier is u for u in fp32_units) for r in routers)
    bf16_router = model(router_dtype="bfloat16")
    with WorkingWeights(bf16_router, torch.bfloat16).swapped():
        assert all(
            ffn.router.classifier.weight.dtype == torch.bfloat16 for ffn in bf16_router.sparse_ffns().values()
        )


@pytest.mark.parametrize("ffn, layout", [(32, "grouped"), (20, "buffer")])
def test_experts_run_in_the_working_dtype_under_autocast(ffn: int, layout: str) -> None:
    """Under bf16 autocast the routed rows are cast once after the fp32 router, so the experts
    (and an all-to-all) see bf16 and the grouped product runs in it; an F whose bf16 rows are
    not 16-byte strided (20) takes the buffer instead of failing in `_grouped_mm`."""
    m = model(encoder_ffn_dim=ffn, decoder_ffn_dim=ffn)
    seen: list[tuple[torch.dtype, int]] = []
    for ffn_module in m.sparse_ffns().values():
        ffn_module.experts.register_forward_pre_hook(lambda _, args: seen.append((args[0].dtype, len(args))))
    b = batch()
    m.moe.begin_step(seed=0, step=1, loss_scale=1.0)
    reference, n = m.loss(b)
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = m.loss(b)
    loss.backward()
    assert set(seen) == {(torch.bfloat16, 2 if layout == "grouped" else 1)}
    assert abs(loss.item() - reference.item()) / reference.item() < 1e-2
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in m.parameters())
