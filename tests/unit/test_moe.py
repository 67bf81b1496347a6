"""The sparse FFN's parts against naive references: the top-2 router against a per-token loop
and a port of fairseq's `top2gating`, the batched experts against a per-expert loop, the local
dispatcher, expert output masking, the aux loss's gradient, keyed init and the name mapping."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from models.init import LocalSlice
from models.moe import (
    AuxLossScaler,
    Experts,
    LocalDispatcher,
    MoECall,
    MoERun,
    SparseFFN,
    SparseSettings,
    Top2Router,
    expert_param_name,
    is_expert_param,
    keyed_expert_init,
    keyed_generator,
    split_expert_name,
)

E, H, FF = 8, 12, 20


def naive_route(
    logits: torch.Tensor,
    pad: torch.Tensor | None,
    capacity: int | None,
    policy: str = "all",
    noise: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
    normalize_before: bool = False,
    prioritized: bool = False,
) -> dict[str, object]:
    """fairseq's top-2 gate written one token at a time (the semantics models.moe implements)."""
    n, e = logits.shape
    probs = torch.softmax(logits.double(), dim=-1)
    real = [True] * n if pad is None else [not bool(p) for p in pad]
    first, second, g1s, g2s, use2 = [], [], [], [], []
    for t in range(n):
        i1 = int(probs[t].argmax())
        scores = logits[t].double() + (noise[t].double() if noise is not None else 0)
        scores[i1] = -math.inf
        i2 = int(scores.argmax())
        g1, g2 = float(probs[t, i1]), float(probs[t, i2])
        if normalize_before:
            g1, g2 = g1 / (g1 + g2), g2 / (g1 + g2)
        keep2 = real[t] and (policy != "random" or 2 * g2 > float(u[t]))  # type: ignore[index]
        first.append(i1), second.append(i2), g1s.append(g1), g2s.append(g2), use2.append(keep2)
    order = list(range(n))
    if prioritized:
        order = sorted(range(n), key=lambda t: -float(probs[t].max()))
    count1 = [sum(1 for t in range(n) if real[t] and first[t] == x) for x in range(e)]
    seen1, seen2 = [0] * e, [0] * e
    slot = [[-1, -1] for _ in range(n)]
    for t in order:
        if real[t]:
            slot[t][0] = seen1[first[t]]
            seen1[first[t]] += 1
        if use2[t]:
            slot[t][1] = count1[second[t]] + seen2[second[t]]
            seen2[second[t]] += 1
    dropped = 0
    gate = [[0.0, 0.0] for _ in range(n)]
    for t in range(n):
        for k, used in ((0, real[t]), (1, use2[t])):
            if used and capacity is not None and slot[t][k] >= capacity:
                slot[t][k], dropped = -1, dropped + 1
            elif not used:
                slot[t][k] = -1
        a = g1s[t] if slot[t][0] >= 0 else 0.0
        b = g2s[t] if slot[t][1] >= 0 else 0.0
        if not normalize_before:
            d = max(a + b, torch.finfo(torch.float32).eps)
            a, b = a / d, b / d
        gate[t] = [a, b]
    n_real = max(sum(real), 1)
    me = [sum(float(probs[t, x]) for t in range(n) if real[t]) / n_real for x in range(e)]
    ce = [count1[x] / n_real for x in range(e)]
    tokens = [count1[x] + sum(1 for t in range(n) if use2[t] and second[t] == x) for x in range(e)]
    return {
        "expert_index": torch.tensor([first, second]).T,
        "slot": torch.tensor(slot),
        "gate": torch.tensor(gate, dtype=torch.float64),
        "dropped": dropped,
        "tokens_per_expert": torch.tensor(tokens),
        "aux": e * sum(a * b for a, b in zip(me, ce)),
    }


def fairseq_top2gating(logits: torch.Tensor, input_mask: torch.Tensor | None, capacity: int):
    """fairseq's `top2gating` (nllb branch) for policy 'all', normalising after dropping, token
    order: the same tensor program, condensed. Returns (l_aux, combine_weights (S, E, C))."""
    gates = F.softmax(logits.float(), dim=1)
    num_tokens, num_experts = gates.shape
    indices1_s = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(indices1_s, num_experts)
    logits_except1 = logits.masked_fill(mask1.bool(), float("-inf"))
    indices2_s = torch.argmax(logits_except1, dim=1)
    mask2 = F.one_hot(indices2_s, num_experts)
    if input_mask is not None:
        nonpadding = ~input_mask
        mask1 = mask1 * nonpadding.unsqueeze(-1).to(mask1.dtype)
        mask2 = mask2 * nonpadding.unsqueeze(-1).to(mask1.dtype)
    locations1 = torch.cumsum(mask1, dim=0) - 1
    locations2 = torch.cumsum(mask2, dim=0) - 1
    locations2 += torch.sum(mask1, dim=0, keepdim=True)
    me = torch.mean(gates, dim=0)
    ce = torch.mean(mask1.to(gates.dtype), dim=0)
    l_aux = torch.mean(me * ce) * num_experts * num_experts
    mask1 = mask1 * torch.lt(locations1, capacity)
    mask2 = mask2 * torch.lt(locations2, capacity)
    gates1_s = (gates * mask1).sum(dim=1)
    gates2_s = (gates * mask2).sum(dim=1)
    denom_s = torch.clamp(gates1_s + gates2_s, min=torch.finfo(gates.dtype).eps)
    gates1_s, gates2_s = gates1_s / denom_s, gates2_s / denom_s
    locations1_s = torch.sum(locations1 * mask1, dim=1)
    locations2_s = torch.sum(locations2 * mask2, dim=1)
    gates1 = gates1_s.unsqueeze(-1) * mask1.to(gates1_s.dtype)
    gates2 = gates2_s.unsqueeze(-1) * mask2.to(gates2_s.dtype)
    loc1_sc = F.one_hot(locations1_s, capacity).to(gates.dtype)
    loc2_sc = F.one_hot(locations2_s, capacity).to(gates.dtype)
    combine = torch.bmm(gates1.unsqueeze(-1), loc1_sc.unsqueeze(1)) + torch.bmm(
        gates2.unsqueeze(-1), loc2_sc.unsqueeze(1)
    )
    return l_aux, combine


def combine_tensor(r, capacity: int) -> torch.Tensor:
    """Our Routing as fairseq's (S, E, C) combine weights."""
    out = torch.zeros(r.gate.shape[0], E, capacity)
    for t in range(r.gate.shape[0]):
        for k in range(2):
            if r.slot[t, k] >= 0:
                out[t, r.expert_index[t, k], r.slot[t, k]] += r.gate[t, k]
    return out


def router(**kw) -> Top2Router:
    torch.manual_seed(0)
    r = Top2Router(H, E, **kw)
    torch.nn.init.normal_(r.classifier.weight, std=0.5)
    return r


@pytest.mark.parametrize("policy", ["all", "sampling", "random"])
@pytest.mark.parametrize(
    ("capacity", "padded", "normalize_before", "prioritized"),
    [(None, False, False, False), (4, True, False, False), (3, False, True, True), (5, True, False, True)],
)
def test_router_matches_per_token_loop(policy, capacity, padded, normalize_before, prioritized) -> None:
    r = router(
        second_expert_policy=policy, normalize_before_dropping=normalize_before, batch_prioritized=prioritized
    )
    x = torch.randn(30, H)
    pad = (torch.arange(30) % 7 == 6) if padded else None
    got = r(x, pad, capacity, generator=keyed_generator(x.device, 5, "t"))
    # The reference draws the same noise in the same order from the same keyed generator.
    g = keyed_generator(x.device, 5, "t")
    logits = r.logits(x).detach()
    noise = u = None
    if policy == "sampling":
        noise = torch.empty_like(logits).exponential_(generator=g).log_().neg_()
    if policy == "random":
        u = torch.rand(30, generator=g)
    ref = naive_route(logits, pad, capacity, policy, noise, u, normalize_before, prioritized)
    assert torch.equal(got.expert_index, ref["expert_index"])
    assert torch.equal(got.slot, ref["slot"])
    torch.testing.assert_close(got.gate.double(), ref["gate"], rtol=1e-6, atol=1e-6)
    assert int(got.dropped) == ref["dropped"]
    assert torch.equal(got.tokens_per_expert, ref["tokens_per_expert"])
    assert got.aux_loss.item() == pytest.approx(ref["aux"], rel=1e-5)
    if capacity is not None and policy == "all":
        assert ref["dropped"] > 0  # the cases do exercise the capacity


@pytest.mark.parametrize("capacity", [3, 8])
def test_router_equals_fairseq_top2gating(capacity) -> None:
    """Combine weights and l_aux equal a port of fairseq's tensor program (no padding); with
    padding the combine weights still do, and our aux is fairseq's formula over the real tokens
    (fairseq also averages the pad rows' gates into `me` and counts them in the mean)."""
    r = router()
    x = torch.randn(40, H)
    logits = r.logits(x).detach()
    ours = r(x, None, capacity)
    l_aux, combine = fairseq_top2gating(logits, None, capacity)
    torch.testing.assert_close(combine_tensor(ours, capacity), combine.float(), rtol=1e-6, atol=1e-7)
    assert ours.aux_loss.item() == pytest.approx(l_aux.item(), rel=1e-6)
    pad = torch.arange(40) >= 33
    ours = r(x, pad, capacity)
    _, combine = fairseq_top2gating(logits, pad, capacity)
    torch.testing.assert_close(combine_tensor(ours, capacity), combine.float(), rtol=1e-6, atol=1e-7)
    l_aux_real, _ = fairseq_top2gating(logits[~pad], None, capacity)
    assert ours.aux_loss.item() == pytest.approx(l_aux_real.item(), rel=1e-6)


def test_experts_batched_equal_per_expert_loop() -> None:
    torch.manual_seed(1)
    ex = Experts(H, FF, E, F.relu)
    for p in ex.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(E, 5, H, requires_grad=True)
    y = ex(x)
    ref = torch.stack(
        [
            F.linear(
                F.relu(F.linear(x[e], ex.fc1_weight[e], ex.fc1_bias[e])), ex.fc2_weight[e], ex.fc2_bias[e]
            )
            for e in range(E)
        ]
    )
    torch.testing.assert_close(y, ref)
    gy = torch.randn_like(y)
    grads = torch.autograd.grad(y, [x, ex.fc1_weight], gy)
    grads_ref = torch.autograd.grad(ref, [x, ex.fc1_weight], gy)
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b)


def test_grouped_experts_equal_per_expert_loop() -> None:
    """`torch._grouped_mm` over rows sorted by expert (and our backward for it): the values and
    gradients of each expert's FFN on its rows, zero rows past the groups, empty experts included."""
    from models.moe import GroupedRows

    torch.manual_seed(1)
    ex = Experts(H, FF, E, F.relu)
    for p in ex.parameters():
        torch.nn.init.normal_(p)
    counts = torch.tensor([3, 0, 2, 5, 1, 0, 4, 2])
    m = int(counts.sum()) + 3  # three rows past the groups (dropped assignments)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    expert = torch.repeat_interleave(torch.arange(E), counts)
    groups = GroupedRows(
        offs, torch.cat([expert, torch.full((3,), E - 1)]), torch.arange(m) < offs[-1], torch.zeros(0)
    )
    x = torch.randn(m, H, requires_grad=True)
    y = ex(x, groups)
    ref = [
        F.linear(F.relu(F.linear(x[r], ex.fc1_weight[e], ex.fc1_bias[e])), ex.fc2_weight[e], ex.fc2_bias[e])
        for r, e in enumerate(expert.tolist())
    ]
    ref = torch.cat([torch.stack(ref), torch.zeros(3, H)])
    torch.testing.assert_close(y, ref)
    gy = torch.randn_like(y)
    params = [x, ex.fc1_weight, ex.fc1_bias, ex.fc2_weight, ex.fc2_bias]
    for a, b in zip(torch.autograd.grad(y, params, gy), torch.autograd.grad(ref, params, gy)):
        torch.testing.assert_close(a, b)


def sparse_ffn(
    capacity_factor: float = 1.0,
    dropless: bool = False,
    token_dropout: float = 0.0,
    grouped: bool | None = None,
) -> SparseFFN:
    torch.manual_seed(2)
    ex = Experts(H, FF, E, F.relu)
    for p in ex.parameters():
        torch.nn.init.normal_(p, std=0.3)
    run = MoERun(dropless=dropless)
    run.capacity_factor = capacity_factor
    ffn = SparseFFN(router(), ex, SparseSettings(E, token_dropout=token_dropout, name="l"), run)
    ffn.dispatcher = LocalDispatcher(grouped)
    return ffn


def naive_ffn(ffn: SparseFFN, x: torch.Tensor, routing) -> torch.Tensor:
    """out[t] = sum_k gate[t, k] * expert_{e_k}(x[t]), one token at a time."""
    ex = ffn.experts
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros(H)
        for k in range(2):
            e, g = int(routing.expert_index[t, k]), routing.gate[t, k]
            if routing.slot[t, k] >= 0:
                h = F.relu(F.linear(x[t], ex.fc1_weight[e], ex.fc1_bias[e]))
                acc = acc + g * F.linear(h, ex.fc2_weight[e], ex.fc2_bias[e])
        rows.append(acc)
    return torch.stack(rows)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("dropless", [False, True])
def test_sparse_ffn_equals_per_token_loop(dropless, grouped) -> None:
    ffn = sparse_ffn(capacity_factor=0.5, dropless=dropless, grouped=grouped).train()
    x = torch.randn(4, 9, H)
    pad = torch.zeros(4, 9, dtype=torch.bool)
    pad[1, 6:] = True
    out = ffn(x, MoECall(pad=pad))
    flat = x.reshape(-1, H)
    routing = ffn.router(flat, pad.reshape(-1), ffn.capacity(36))
    assert (routing.capacity is None) == dropless
    assert int(routing.dropped) > 0 or dropless
    torch.testing.assert_close(out.reshape(-1, H), naive_ffn(ffn, flat, routing), rtol=1e-5, atol=1e-5)
    assert out.reshape(-1, H)[pad.reshape(-1)].abs().max() == 0  # padding gets no expert output


@pytest.mark.parametrize("factor", [0.1, 0.5, 0.7, 1.0, 1.1, 1.25, 2.0])
def test_capacity_is_computed_exactly_in_integers(factor) -> None:
    """C = ceil(f * 2 * ceil(N / E)) in training and ceil(fraction * N) in evaluation, in integers (no
    float for torch.compile to trace), exactly for the decimal written: in floats 1.1 * 50 is
    55.00000000000001 and its ceiling 56."""
    ffn = sparse_ffn(capacity_factor=factor)
    ffn.settings = SparseSettings(E, eval_capacity_fraction=factor, name="l")
    assert ffn.run.capacity_factor == factor
    exact = Fraction(repr(factor))
    for n in range(1, 300):
        train = math.ceil(exact * 2 * math.ceil(n / E))
        evaluation = math.ceil(exact * n)
        assert ffn.train().capacity(n) == (None if train >= n else train), (n, train)
        assert ffn.eval().capacity(n) == (None if evaluation >= n else evaluation), (n, evaluation)


def test_experts_that_override_forward_get_the_buffer() -> None:
    """A subclass of `Experts` with its own forward (a tensor-parallel shard) takes only the
    buffer: the dispatcher picks the buffer layout for it, whatever the device."""

    class BufferOnly(Experts):
        def forward(self, x):  # noqa: ANN001, ANN202
            assert x.dim() == 3
            return super().forward(x)

    ffn = sparse_ffn(grouped=True)
    only = BufferOnly(H, FF, E, F.relu)
    only.load_state_dict(ffn.experts.state_dict())
    x = torch.randn(2, 5, H)
    ref = ffn(x)
    ffn.experts = only
    torch.testing.assert_close(ffn(x), ref, rtol=1e-5, atol=1e-6)


def test_grouped_and_buffer_layouts_give_the_same_values_and_gradients() -> None:
    x = torch.randn(3, 11, H)
    outs, grads = [], []
    for grouped in (False, True):
        ffn = sparse_ffn(capacity_factor=0.7, grouped=grouped).train()
        ffn.run.aux_loss_coef, ffn.run.loss_scale = 0.1, 0.02
        xg = x.clone().requires_grad_(True)
        out = ffn(xg, MoECall(num_tokens=30))
        (out * torch.linspace(-1, 1, H)).sum().backward()
        outs.append(out)
        grads.append([xg.grad] + [p.grad for p in ffn.parameters()])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_dispatcher_buffer_holds_each_kept_assignment_once() -> None:
    ffn = sparse_ffn()
    x = torch.randn(20, H)
    routing = ffn.router(x, None, 4)
    buf, rows = LocalDispatcher(grouped=False).dispatch(x, routing, ffn.experts)
    assert buf.shape == (E, 4, H)
    for t in range(20):
        for k in range(2):
            if routing.slot[t, k] >= 0:
                assert torch.equal(buf[routing.expert_index[t, k], routing.slot[t, k]], x[t])
    assert int((buf.abs().sum(-1) > 0).sum()) == int((routing.slot >= 0).sum())


def test_expert_output_masking_drops_whole_outputs_and_scales_in_eval() -> None:
    ffn = sparse_ffn(token_dropout=0.5)
    x = torch.randn(2, 10, H)
    ffn.eval()
    scaled = ffn(x)
    ffn.settings.token_dropout = 0.0
    torch.testing.assert_close(scaled, 0.5 * ffn(x))
    ffn.settings.token_dropout = 0.5
    ffn.train()
    flat = x.reshape(-1, H)
    routing = ffn.router(flat, None, ffn.capacity(20))
    masked = ffn._mask_outputs(routing, x.device, MoECall())
    kept = masked.gate != 0
    assert torch.equal(masked.gate[kept], routing.gate[kept])  # no rescaling of what is kept
    assert 0 < int(kept.sum()) < int((routing.gate != 0).sum())
    torch.testing.assert_close(ffn(x).reshape(-1, H), naive_ffn(ffn, flat, masked), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ffn(x), ffn(x))  # keyed: the same draw for the same (step, slot)


def test_aux_loss_gradient_is_scale_times_d_aux() -> None:
    ffn = sparse_ffn().train()
    ffn.run.aux_loss_coef, ffn.run.loss_scale, ffn.run.n_sparse_layers = 0.1, 1 / 50, 2
    x = torch.randn(3, 8, H)
    call = MoECall(num_tokens=20)
    out = ffn(x, call)
    w = ffn.router.classifier.weight
    (g_ours,) = torch.autograd.grad((out * 0.3).sum(), w)
    scale = 0.1 * 20 / 50 / 2
    ffn.run.loss_scale = 0.0  # no scaler: add scale * aux by hand
    flat = x.reshape(-1, H)
    out = ffn(x, call)
    aux = ffn.router(flat, None, ffn.capacity(24)).aux_loss
    (g_ref,) = torch.autograd.grad((out * 0.3).sum() + scale * aux, w)
    torch.testing.assert_close(g_ours, g_ref)
    assert AuxLossScaler.apply(out, aux, scale) is not out


def test_expert_activation_dropout_draws_per_tp_rank() -> None:
    """Each expert's F is split over tp, so its hidden dropout draws per tp rank as a dense FFN's
    does (`parallel.tp.rng`): the hook reaches `Experts` and the tp shard built from them (both
    used to draw from the shared stream, the same mask pattern on every rank's F slice)."""
    from parallel.expert.apply import TensorParallelExperts
    from parallel.tp.rng import install_tensor_parallel_rng

    torch.manual_seed(1)
    x = torch.randn(E, 5, H)
    outs = []
    for tp_rank in (0, 1):
        ex = Experts(H, FF, E, F.relu, activation_dropout=0.5).train()
        for p in ex.parameters():
            torch.nn.init.normal_(p, generator=torch.Generator().manual_seed(2))
        assert install_tensor_parallel_rng(ex, tp_rank, sequence_parallel=False) == 1
        shard = TensorParallelExperts.from_experts(ex, None, 1, 0)  # type: ignore[arg-type]
        assert shard.activation_dropout_rng == ex.activation_dropout_rng
        torch.manual_seed(0)  # the shared stream: the same state on every tp rank
        outs.append(ex(x))
    assert not torch.equal(outs[0], outs[1])


def test_keyed_expert_init_slices_equal_the_whole() -> None:
    name = "encoder.layers.3.ffn.experts.fc1_weight"
    whole = keyed_expert_init(name, LocalSlice.whole((E, FF, H)), 7, 0.02)
    part = keyed_expert_init(name, LocalSlice((E, FF, H), 0, 2, 3, 3), 7, 0.02)
    torch.testing.assert_close(part, whole[2:5])
    cols = keyed_expert_init(name, LocalSlice((E, FF, H), 1, 4, 8, 8), 7, 0.02)
    torch.testing.assert_close(cols, whole[:, 4:12])
    assert not torch.equal(whole[0], whole[1])


def test_expert_name_mapping_round_trips() -> None:
    stacked = "decoder.layers.3.ffn.experts.fc2_bias"
    hf = expert_param_name(stacked, 17)
    assert hf == "decoder.layers.3.ffn.experts.expert_17.fc2.bias"
    assert split_expert_name(hf) == (stacked, 17)
    assert split_expert_name("decoder.layers.3.ffn.router.classifier.weight") is None
    assert is_expert_param(stacked) and not is_expert_param(hf)
    with pytest.raises(ValueError, match="not a stacked expert parameter"):
        expert_param_name("decoder.layers.3.fc1.weight", 0)


def test_tensor_parallel_experts_take_the_grouped_layout() -> None:
    """The tp shard runs the grouped rows as `Experts` does (no padding to the busiest expert):
    with a one-rank tp group its grouped output and gradients equal the buffer layout's."""
    from models.moe.experts import GroupedRows, takes_groups
    from parallel.expert.apply import TensorParallelExperts
    from parallel.tp.comm import ShardOnlyGroup

    ffn = sparse_ffn()
    shard = TensorParallelExperts.from_experts(ffn.experts, ShardOnlyGroup(1, 0), 1, 0)
    assert takes_groups(shard)
    x = torch.randn(20, H)
    outs = []
    for grouped in (True, False):
        d = LocalDispatcher(grouped=grouped)
        xi = x.clone().requires_grad_(True)
        routing = ffn.router(xi, None, 4)
        rows, ctx = d.dispatch(xi, routing, shard)
        assert isinstance(ctx, GroupedRows) == grouped
        y = d.combine(shard(rows, ctx) if grouped else shard(rows), routing, ctx)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, shard.fc2_bias.grad.clone(), shard.fc1_weight.grad.clone()))
        shard.zero_grad()
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
