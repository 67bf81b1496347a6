"""NLLB-MoE speed: our sparse model against `transformers`' NllbMoe, measured side by side.

    python scripts/bench_moe.py                      # one process, CPU: writes benchmarks/moe_cpu.{md,json}
    python scripts/bench_moe.py --experts 32 --steps 8 --out ''   # print only

One process (`one_process`): the same NLLB-MoE config (32 experts in every 2nd encoder and
decoder layer), the same weights and the same batch, trained one optimizer step at a time
(fused AdamW, clipping at 1.0, fp32, dropout 0.1 and expert output masking 0.2 on both sides):

    ours             `build_parallel_model` on a one-rank mesh driven by `trainer.run.step.train_step`
                     (what `trainer.train` runs), capacity C = 2 ceil(N / E) (fairseq's): experts
                     as one `torch._grouped_mm` per projection over the rows sorted by expert
                     (the CPU default, `models.moe.experts`)
    ours buffer      the same on the (E, C, d) capacity buffer, one `baddbmm` per projection
    ours dropless    grouped, `moe_dropless` (no capacity)
    HF               `NllbMoeForConditionalGeneration` (eager attention, its only one) in a plain loop,
                     `expert_capacity` set to the same C and the load-balancing loss on
                     (`output_router_logits`), as transformers 5.x ships it: its expert combine is
                     wrong (tests/unit/test_hf_nllb_moe.py) but its cost is that of its loop
    HF 4.57          the same with transformers 4.57.6's `NllbMoeSparseMLP.forward` (correct) ported
                     as it is: the (E, N, d) masked copy of the tokens, a loop over the experts,
                     each on the tokens routed to it, and the sum over E

The sides alternate step by step so machine noise hits them alike; the table gives the median
CPU seconds of the (single-threaded: OMP_NUM_THREADS=1) process per step, which other jobs on a
shared machine disturb less than wall time (also recorded), and ours / HF as the median of the
alternating steps' ratios. Goal (issue 24): ours <= 0.5x HF on 32 experts.

Expert parallelism (`--parts ep`, `scripts/bench_moe_ep.py`): peak memory per rank of an
expert-heavy model on (dp 4, ep 4) against one process (goal <= 0.40x), and the all-to-all bytes
the dispatcher sent against the planner's formula (goal: within 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.config import ModelConfig  # noqa: E402
from models.hf import to_hf_config, to_hf_state_dict  # noqa: E402
from models.m2m100 import IGNORE_INDEX, M2M100Translation, Seq2SeqBatch  # noqa: E402
from trainer.data.batching import FixedBatch  # noqa: E402

GOAL = 0.5


def moe_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=args.ffn,
        decoder_ffn_dim=args.ffn,
        dropout=0.1,
        attention_dropout=0.1,
        max_position_embeddings=1024,
        num_experts=args.experts,
        encoder_sparse_step=2,
        decoder_sparse_step=2,
        moe_token_dropout=0.2,
        router_aux_loss_coef=0.01,
    )


def make_batch(mc: ModelConfig, b: int, s: int, seed: int = 0) -> Seq2SeqBatch:
    """Random ids, source and target lengths uniform in [s/2, s] (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, mc.vocab_size, (b, s), generator=g)
    lab = torch.randint(4, mc.vocab_size, (b, s), generator=g)
    src_len = torch.randint(s // 2, s + 1, (b,), generator=g)
    tgt_len = torch.randint(s // 2, s + 1, (b,), generator=g)
    for i in range(b):
        src[i, src_len[i] :] = mc.pad_token_id
        lab[i, tgt_len[i] :] = IGNORE_INDEX
    dec = torch.full_like(lab, mc.pad_token_id)
    dec[:, 0] = mc.decoder_start_token_id
    dec[:, 1:] = lab[:, :-1].masked_fill(lab[:, :-1] == IGNORE_INDEX, mc.pad_token_id)
    return Seq2SeqBatch(src, (src != mc.pad_token_id).long(), dec, lab)


def ours(
    base: M2M100Translation, batch: Seq2SeqBatch, dropless: bool, grouped: bool = True, device: str = "cpu"
) -> Any:
    """One optimizer step of our engine on a one-rank mesh (CUDA: bf16, as `bf16: true` runs)."""
    import copy

    from parallel.mesh import ParallelDims, build_mesh
    from parallel.parallelize import build_parallel_model
    from trainer.config.training_args import TrainingArguments
    from trainer.run.step import build_optimizer, build_scheduler, train_step

    mesh = build_mesh(ParallelDims(pp=1, dp=1, tp=1, world_size=1), device)
    bf16 = torch.bfloat16 if device == "cuda" else None
    model = copy.deepcopy(base).to(device)
    pm = build_parallel_model(model, mesh, [len(base.blocks)], 1, "1f1b", 1, "none", 0.0, autocast_dtype=bf16)
    pm.model.moe.dropless = dropless
    from models.moe import LocalDispatcher

    for (
        ffn
    ) in pm.model.sparse_ffns().values():  # CUDA: grouped where `_grouped_mm` takes the call (bf16, sm90)
        ffn.dispatcher = LocalDispatcher(grouped=None if grouped and device == "cuda" else grouped)
    args = TrainingArguments(output_dir="/tmp/bench_moe", learning_rate=1e-4, max_steps=10**6)
    optimizer = build_optimizer(pm.model, args, only=pm.optimizer_params())
    scheduler = build_scheduler(optimizer, args)
    gb = FixedBatch([batch])
    count = [0]

    def step() -> float:
        count[0] += 1
        st = train_step(pm, optimizer, scheduler, gb, 0, 1.0, count[0])
        assert st.loss_sum is not None
        return float(st.loss_sum) / gb.num_tokens

    return step


def hf(
    base: M2M100Translation, batch: Seq2SeqBatch, capacity: int, fixed_combine: bool, device: str = "cpu"
) -> Any:
    """One optimizer step of transformers' NllbMoe with the same weights, in a plain loop (CUDA:
    under bf16 autocast)."""
    from transformers import NllbMoeForConditionalGeneration
    from transformers.models.nllb_moe import modeling_nllb_moe

    cfg = to_hf_config(base.config)
    cfg.expert_capacity = capacity
    model = NllbMoeForConditionalGeneration(cfg)
    missing, unexpected = model.load_state_dict(
        to_hf_state_dict(base.state_dict(), base.config), strict=False
    )
    assert not unexpected and all("embed_tokens" in k or "embed_positions" in k for k in missing), missing
    model.to(device).train()
    batch = batch.to(device)
    if fixed_combine:
        for module in model.modules():
            if isinstance(module, modeling_nllb_moe.NllbMoeSparseMLP):
                module.forward = _sparse_mlp_4_57.__get__(module)  # type: ignore[method-assign]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> float:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                decoder_input_ids=batch.decoder_input_ids,
                labels=batch.labels,
                output_router_logits=True,
            )
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    return step


def _sparse_mlp_4_57(self: Any, hidden_states: torch.Tensor, padding_mask: Any = None) -> torch.Tensor:
    """transformers 4.57.6's `NllbMoeSparseMLP.forward`, as it is, on 5.x's module (its router
    takes the flat tokens and returns three values; the layer expects the hidden states alone)."""
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    flat = hidden_states.reshape(batch_size * sequence_length, hidden_dim)
    _, router_probs, _ = self.router(flat, padding_mask)
    router_mask = router_probs.bool()
    masked_hidden_states = torch.einsum("bm,be->ebm", flat, router_mask)
    experts = self.experts
    for idx in range(self.num_experts):
        token_indices = router_mask[:, idx]
        combining_weights = router_probs[token_indices, idx]
        expert_output = experts[f"expert_{idx}"](masked_hidden_states[idx, token_indices])
        if experts.moe_token_dropout > 0:
            if self.training:
                expert_output = experts.token_dropout(expert_output)
            else:
                expert_output *= 1 - experts.moe_token_dropout
        masked_hidden_states[idx, token_indices] = torch.einsum("b,be->be", combining_weights, expert_output)
    return masked_hidden_states.sum(dim=0).reshape(batch_size, sequence_length, hidden_dim)


def one_process(args: argparse.Namespace, b: int, seq: int) -> dict[str, Any]:
    """Step times of ours (grouped, buffer, dropless) and HF (as shipped, with 4.57.6's forward)
    on a batch of `b` pairs of up to `seq` tokens."""
    mc = moe_config(args)
    base = M2M100Translation(mc, seed=0)
    batch = make_batch(mc, b, seq)
    n = batch.input_ids.numel()
    capacity = 2 * -(-n // mc.num_experts)
    dev = args.device
    sides = {
        "ours": ours(base, batch, dropless=False, device=dev),
        "ours_buffer": ours(base, batch, dropless=False, grouped=False, device=dev),
        "ours_dropless": ours(base, batch, dropless=True, device=dev),
        "hf": hf(base, batch, capacity, fixed_combine=False, device=dev),
        "hf_4_57": hf(base, batch, capacity, fixed_combine=True, device=dev),
    }
    for step in sides.values():
        for _ in range(args.warmup):
            step()
    times: dict[str, list[float]] = {k: [] for k in sides}
    walls: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(args.steps):
        for name, step in sides.items():
            t0, c0 = time.perf_counter(), time.process_time()
            step()  # reads the loss back: on CUDA the step has ended when it returns
            # CPU: process time (other jobs disturb it less); CUDA: wall time (the device's)
            times[name].append(time.process_time() - c0 if dev == "cpu" else time.perf_counter() - t0)
            walls[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = {
        f"{a}_over_{b}": statistics.median([x / y for x, y in zip(times[a], times[b])])
        for a in ("ours", "ours_buffer", "ours_dropless")
        for b in ("hf", "hf_4_57")
    }
    return {
        "config": {
            "d_model": mc.d_model,
            "layers": f"{mc.encoder_layers}+{mc.decoder_layers}",
            "ffn": mc.encoder_ffn_dim,
            "vocab": mc.vocab_size,
            "num_experts": mc.num_experts,
            "sparse_layers": mc.sparse_layers(),
            "batch": f"{b} x {seq} (lengths in [{seq // 2}, {seq}])",
            "capacity": capacity,
            "parameters": mc.num_parameters(),
        },
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "precision": "bf16 autocast" if args.device == "cuda" else "fp32",
        "steps": args.steps,
        "step_s": med,
        "wall_step_s": {k: statistics.median(v) for k, v in walls.items()},
        "load_average": os.getloadavg(),
        "ratios": ratio,
        "goal_ours_over_hf": GOAL,
    }


def report(results: list[dict[str, Any]], expert_parallel: dict[str, Any] | None = None) -> str:
    lines = [
        f"# NLLB-MoE speed, {results[0].get('device', 'cpu') if results else 'cpu'}",
        "",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch {torch.__version__}. "
        "Produced by `scripts/bench_moe.py`.",
        "",
        "## One process: our step vs transformers' NllbMoe (same config, weights, batch)",
    ]
    for res in results:
        lines += ["", *_one_table(res)]
    if expert_parallel:
        from bench_moe_ep import report as ep_report

        lines += ["", "## Expert parallelism (4 gloo ranks): memory per rank, all-to-all bytes", "",
                  ep_report(expert_parallel["memory"], expert_parallel["a2a"])]  # fmt: skip
    return "\n".join(lines) + "\n"


def _one_table(res: dict[str, Any]) -> list[str]:
    c, s, r = res["config"], res["step_s"], res["ratios"]
    lines = [
        f"d_model {c['d_model']}, layers {c['layers']}, FFN {c['ffn']}, vocab {c['vocab']}, "
        f"**{c['num_experts']} experts** in {len(c['sparse_layers'])} sparse layers "
        f"({', '.join(c['sparse_layers'])}), {c['parameters'] / 1e6:.1f}M parameters; batch {c['batch']}; "
        f"capacity {c['capacity']} on both sides; {res.get('precision', 'fp32')}, fused AdamW, dropout 0.1, "
        f"EOM 0.2, aux loss on. Median of {res['steps']} alternating steps, "
        + (
            "process CPU seconds"
            if res.get("device", "cpu") == "cpu"
            else "wall seconds (the loss read back)"
        )
        + f" (load average during the run {res['load_average'][0]:.1f}).",
        "",
        "| side | s/step | / HF 5.x as shipped | / HF 4.57's SparseMLP |",
        "|---|---:|---:|---:|",
        f"| ours (grouped, capacity; default) | {s['ours']:.3f} | {r['ours_over_hf']:.2f} | {r['ours_over_hf_4_57']:.2f} |",
        f"| ours (buffer, capacity) | {s['ours_buffer']:.3f} | {r['ours_buffer_over_hf']:.2f} "
        f"| {r['ours_buffer_over_hf_4_57']:.2f} |",
        f"| ours (grouped, dropless) | {s['ours_dropless']:.3f} | {r['ours_dropless_over_hf']:.2f} "
        f"| {r['ours_dropless_over_hf_4_57']:.2f} |",
        f"| HF 5.x as shipped (wrong combine) | {s['hf']:.3f} | - | - |",
        f"| HF 5.x with 4.57.6's SparseMLP.forward | {s['hf_4_57']:.3f} | - | - |",
        "",
        f"Goal: ours <= {res['goal_ours_over_hf']}x HF (the correct one, 4.57.6's forward): "
        + ("met." if r["ours_over_hf_4_57"] <= GOAL else "not met."),
    ]
    return lines


def _init_single_process_group(device: str = "cpu") -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4, help="encoder and decoder layers each")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--batches", default="16x48,32x64", help="pairs x longest length, comma-separated")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--out", default=str(ROOT / "benchmarks" / "moe_cpu"), help="PATH: writes PATH.md and PATH.json"
    )
    ap.add_argument(
        "--parts",
        default="one,ep",
        help="one: one process vs transformers; ep: expert parallelism on 4 gloo ranks (scripts/bench_moe_ep.py: "
        "memory per rank, all-to-all bytes). A part left out keeps its earlier results from PATH.json.",
    )
    ap.add_argument("--ep_skip_memory", action="store_true", help="ep part: the all-to-all bytes only")
    ap.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="cuda: both sides in bf16 autocast (ours: `bf16: true`), wall-clock step times (part one)",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    earlier: dict[str, Any] = {}
    if args.out and Path(args.out + ".json").is_file():
        earlier = json.loads(Path(args.out + ".json").read_text())
    res: dict[str, Any] = {k: earlier[k] for k in ("one_process", "expert_parallel") if k in earlier}
    ep_file = ROOT / "benchmarks" / "moe_ep_cpu.json"  # what scripts/bench_moe_ep.py wrote on its own
    if "expert_parallel" not in res and ep_file.is_file():
        res["expert_parallel"] = json.loads(ep_file.read_text())
    if "one" in parts:
        _init_single_process_group(args.device)
        shapes = [tuple(int(v) for v in x.split("x")) for x in args.batches.split(",") if x]
        res["one_process"] = [one_process(args, b, seq) for b, seq in shapes]
    if "ep" in parts:
        from bench_moe_ep import expert_parallel

        res["expert_parallel"] = expert_parallel(skip_memory=args.ep_skip_memory)
    text = report(res.get("one_process", []), res.get("expert_parallel"))
    print(text)
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(res, indent=1) + "\n")
        Path(args.out + ".md").write_text(text)
    return res


if __name__ == "__main__":
    main()
