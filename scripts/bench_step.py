"""One process, one device: our training step against a plain `transformers` M2M100 loop.

    python scripts/bench_step.py --cases cpu_small            # CPU (what `bench.py --quick` runs)
    python scripts/bench_step.py --cases 418m,1.2b --compile  # a GPU

Both sides train the same M2M100 architecture from the same weights on the same
batch (fp32 on a CPU, bf16 on a GPU), with fused AdamW (what `build_optimizer`
uses) and clipping at 1.0. "Ours" is `build_parallel_model` on a one-rank mesh
driven by `trainer.run.step.train_step`, exactly what `trainer.train` runs; "HF" is
`M2M100ForConditionalGeneration` (sdpa attention) in a plain loop, with m
micro-batches accumulated when the case has m > 1; "HF compile" the same under
`torch.compile`.

Per case it reports step time (medians; on a CPU the two sides alternate step by
step so machine noise hits both alike), tokens/s, MFU (GPU: model FLOPs from
`trainer.run.flops` over the device's peak), peak memory, the device-to-host reads
and the aten ops of one micro-batch's forward and backward
(`parallel.dispatch_count`), and on a GPU the synchronisations of a whole step
(`torch.cuda.set_sync_debug_mode`). Prints one JSON line per case (`RESULT {...}`)
and a table; `--json PATH` writes all of them.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.config import ModelConfig  # noqa: E402
from models.hf import to_hf_config, to_hf_state_dict  # noqa: E402
from models.m2m100 import IGNORE_INDEX, M2M100Translation, Seq2SeqBatch  # noqa: E402
from parallel.dispatch_count import DispatchCounter  # noqa: E402
from trainer.data.batching import FixedBatch  # noqa: E402
from trainer.run.flops import peak_flops, step_flops  # noqa: E402


@dataclass(frozen=True)
class Case:
    """A model size and batch: d_model, layers (each side), heads, FFN, vocab; B x (S, T); m."""

    d: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    b: int
    s: int
    m: int = 1
    variable: bool = False  # lengths uniform in [s/4, s]
    remat: str = "none"


CASES = {
    "cpu_small": Case(256, 3, 4, 1024, 8000, 16, 32),
    "cpu_small_m4": Case(256, 3, 4, 1024, 8000, 16, 32, m=4),
    "60m": Case(512, 6, 8, 2048, 32000, 64, 256),
    "418m": Case(1024, 12, 16, 4096, 128112, 32, 256),
    "418m_var": Case(1024, 12, 16, 4096, 128112, 32, 256, variable=True),
    "418m_m4": Case(1024, 12, 16, 4096, 128112, 32, 256, m=4),
    "418m_m8": Case(1024, 12, 16, 4096, 128112, 32, 256, m=8),
    "1.2b": Case(1024, 24, 16, 8192, 128112, 16, 256),
}


def model_config(c: Case, dropout: float) -> ModelConfig:
    return ModelConfig(
        vocab_size=c.vocab,
        d_model=c.d,
        encoder_layers=c.layers,
        decoder_layers=c.layers,
        encoder_attention_heads=c.heads,
        decoder_attention_heads=c.heads,
        encoder_ffn_dim=c.ffn,
        decoder_ffn_dim=c.ffn,
        dropout=dropout,
        attention_dropout=dropout,
        activation_dropout=0.0,
        max_position_embeddings=1024,
    )


def make_batch(c: Case, mc: ModelConfig, seed: int = 0) -> Seq2SeqBatch:
    """Random token ids (CPU), right-padded when the case has variable lengths."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, c.vocab, (c.b, c.s), generator=g)
    lab = torch.randint(4, c.vocab, (c.b, c.s), generator=g)
    if c.variable:
        src_len = torch.randint(c.s // 4, c.s + 1, (c.b,), generator=g)
        tgt_len = torch.randint(c.s // 4, c.s + 1, (c.b,), generator=g)
        for i in range(c.b):
            src[i, src_len[i] :] = mc.pad_token_id
            lab[i, tgt_len[i] :] = IGNORE_INDEX
    dec = torch.full_like(lab, mc.pad_token_id)
    dec[:, 0] = mc.decoder_start_token_id
    dec[:, 1:] = lab[:, :-1].masked_fill(lab[:, :-1] == IGNORE_INDEX, mc.pad_token_id)
    return Seq2SeqBatch(src, (src != mc.pad_token_id).long(), dec, lab)


# ----------------------------------------------------------------------------- the two sides


def ours(
    base: M2M100Translation,
    c: Case,
    batch: Seq2SeqBatch,
    device: torch.device,
    bf16: bool,
    compile_layers: bool = False,
    working_weights: bool = True,
) -> Any:
    """Our engine on a one-rank mesh; returns (step function, forward+backward-only function).

    `working_weights=False` is the ablation: bf16 by autocast over fp32 weights alone.
    """
    import copy

    from parallel.mesh import ParallelDims, build_mesh
    from parallel.parallelize import build_parallel_model
    from trainer.config.training_args import TrainingArguments
    from trainer.run.step import build_optimizer, build_scheduler, train_step

    mesh = build_mesh(ParallelDims(pp=1, dp=1, tp=1, world_size=1), device.type)
    model = copy.deepcopy(base).to(device)
    pm = build_parallel_model(
        model, mesh, [len(model.blocks)], c.m, "1f1b", 1, c.remat, 0.0,
        autocast_dtype=torch.bfloat16 if bf16 else None, compile_layers=compile_layers,
    )  # fmt: skip
    if not working_weights:
        pm.working = None
    args = TrainingArguments(output_dir="/tmp/bench_step", learning_rate=1e-4, max_steps=10**6)
    optimizer = build_optimizer(pm.model, args, only=pm.optimizer_params())
    scheduler = build_scheduler(optimizer, args)
    gb = FixedBatch(batch.split(c.m))
    count = [0]

    def step() -> torch.Tensor:
        count[0] += 1
        st = train_step(pm, optimizer, scheduler, gb, 0, 1.0, count[0])
        assert st.loss_sum is not None
        return st.loss_sum / gb.num_tokens

    def forward_backward() -> None:
        pm.train_step([gb.microbatches], 1.0 / gb.num_tokens, timed=False)
        pm.model.zero_grad(set_to_none=True)

    return step, forward_backward


def hf(
    base: M2M100Translation, c: Case, batch: Seq2SeqBatch, device: torch.device, bf16: bool, compile_: bool
) -> Any:
    """`transformers` M2M100 with the same weights in a plain loop; returns (step, forward+backward)."""
    from transformers import M2M100ForConditionalGeneration

    model = M2M100ForConditionalGeneration._from_config(to_hf_config(base.config), attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(
        to_hf_state_dict(base.state_dict(), base.config), strict=False
    )
    tied = ("embed_positions", "embed_tokens")  # computed positions; tied copies of model.shared
    assert not unexpected and all(any(t in k for t in tied) for k in missing), (missing, unexpected)
    model = model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    fwd = torch.compile(model) if compile_ else model
    chunks = [mb.to(device) for mb in batch.split(c.m)]
    ntok = batch.num_tokens()

    def forward_backward() -> torch.Tensor:
        total = torch.zeros((), device=device)
        for mb in chunks:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                out = fwd(
                    input_ids=mb.input_ids,
                    attention_mask=mb.attention_mask,
                    decoder_input_ids=mb.decoder_input_ids,
                    labels=mb.labels,
                )
            # HF's loss is the micro-batch mean: weight it by its share of the batch's tokens.
            (out.loss * (mb.num_tokens() / ntok)).backward()
            total += out.loss.detach() * (mb.num_tokens() / ntok)
        return total

    def step() -> torch.Tensor:
        loss = forward_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def fb_only() -> None:
        forward_backward()
        model.zero_grad(set_to_none=True)

    return step, fb_only


# ----------------------------------------------------------------------------- measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_steps(step: Any, device: torch.device, n: int) -> list[float]:
    out = []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def time_blocks(step: Any, device: torch.device, steps: int, blocks: int = 3) -> float:
    """Seconds per step: median over `blocks` runs of `steps` steps with one sync at the end of
    each, as a training loop runs (the host may run ahead of the device between syncs)."""
    out = []
    for _ in range(blocks):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync(device)
        out.append((time.perf_counter() - t0) / steps)
    return statistics.median(out)


def count_dispatch(fn: Any) -> DispatchCounter:
    with DispatchCounter() as counter:
        fn()
    return counter


def cuda_syncs(step: Any) -> int:
    """Synchronising CUDA calls in one step, as `torch.cuda.set_sync_debug_mode` reports them."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(1)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def measure(name: str, c: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    bf16 = device.type == "cuda"
    mc = model_config(c, args.dropout)
    torch.manual_seed(0)
    base = M2M100Translation(mc)
    batch = make_batch(c, mc)
    src, tgt = batch.lengths()
    flops = step_flops(mc, src, tgt)
    peak = peak_flops(device, bf16)
    impls: dict[str, Any] = {"ours": lambda: ours(base, c, batch, device, bf16)}
    impls["hf"] = lambda: hf(base, c, batch, device, bf16, False)
    if args.ablation and bf16:
        impls["ours_autocast_only"] = lambda: ours(base, c, batch, device, bf16, working_weights=False)
    if args.compile and device.type == "cuda":
        impls["ours_compile"] = lambda: ours(base, c, batch, device, bf16, compile_layers=True)
        impls["hf_compile"] = lambda: hf(base, c, batch, device, bf16, True)
    if args.impls:  # a chosen subset, in the chosen order (for ablations)
        impls["ours_autocast_only"] = lambda: ours(base, c, batch, device, bf16, working_weights=False)
        impls = {k: impls[k] for k in args.impls.split(",")}
    row: dict[str, Any] = {"case": name, **c.__dict__, "params": sum(p.numel() for p in base.parameters())}
    row["tokens_per_step"] = sum(src) + sum(tgt)
    if device.type == "cuda":
        for impl, build in impls.items():  # one at a time: a 1.2B model and its optimizer are ~20 GB
            step, fb = build()
            for _ in range(args.warmup):
                step()
            torch.cuda.reset_peak_memory_stats()
            row[f"{impl}_step_s"] = time_blocks(step, device, args.steps)
            row[f"{impl}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row[f"{impl}_loss"] = float(step())
            row[f"{impl}_cuda_syncs_per_step"] = cuda_syncs(step)
            counter = count_dispatch(fb)
            row[f"{impl}_host_reads_per_microbatch"] = counter.host_reads / c.m
            row[f"{impl}_ops_per_microbatch"] = counter.num_ops / c.m
            if peak:
                row[f"{impl}_mfu"] = flops / row[f"{impl}_step_s"] / peak
            del step, fb
            gc.collect()
            torch.cuda.empty_cache()
    else:  # alternate step by step: machine noise hits both sides alike
        built = {impl: build() for impl, build in impls.items()}
        for impl, (step, fb) in built.items():
            for _ in range(args.warmup):
                step()
            counter = count_dispatch(fb)
            row[f"{impl}_host_reads_per_microbatch"] = counter.host_reads / c.m
            row[f"{impl}_ops_per_microbatch"] = counter.num_ops / c.m
        samples: dict[str, list[float]] = {impl: [] for impl in built}
        for _ in range(args.steps):
            for impl, (step, _fb) in built.items():
                samples[impl] += time_steps(step, device, 1)
        ratios = [a / b for a, b in zip(samples["ours"], samples["hf"])]
        row["ours_over_hf_alternating"] = statistics.median(ratios)
        for impl in built:
            row[f"{impl}_step_s"] = statistics.median(samples[impl])
            row[f"{impl}_loss"] = float(built[impl][0]())
    for impl in impls:
        row[f"{impl}_tokens_per_s"] = row["tokens_per_step"] / row[f"{impl}_step_s"]
    if "hf" not in impls:
        return row
    row["step_time_vs_hf"] = row.get("ours_over_hf_alternating", row["ours_step_s"] / row["hf_step_s"])
    if "hf_compile_step_s" in row:
        row["step_time_vs_hf_compile"] = row["ours_step_s"] / row["hf_compile_step_s"]
    row["ops_per_microbatch_vs_hf"] = row["ours_ops_per_microbatch"] / row["hf_ops_per_microbatch"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    rows = [r for r in rows if "step_time_vs_hf" in r]
    head = "| case | ours s/step | HF s/step | ours / HF | ours / HF compile | MFU ours / HF | peak GiB ours / HF | host reads per mb | ops per mb ours / HF |"
    lines = [head, "|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for r in rows:
        mfu = f"{r['ours_mfu']:.1%} / {r['hf_mfu']:.1%}" if "ours_mfu" in r else "-"
        mem = f"{r['ours_peak_gib']:.1f} / {r['hf_peak_gib']:.1f}" if "ours_peak_gib" in r else "-"
        comp = f"{r['step_time_vs_hf_compile']:.2f}" if "step_time_vs_hf_compile" in r else "-"
        if "ours_compile_step_s" in r:  # against HF compiled where it ran, else HF eager
            peer = "hf_compile_step_s" if "hf_compile_step_s" in r else "hf_step_s"
            comp += f" (compiled ours / {peer[:-7]} {r['ours_compile_step_s'] / r[peer]:.2f})"
        lines.append(
            f"| {r['case']} | {r['ours_step_s']:.4f} | {r['hf_step_s']:.4f} | {r['step_time_vs_hf']:.2f} | {comp} "
            f"| {mfu} | {mem} | {r['ours_host_reads_per_microbatch']:.0f} "
            f"| {r['ours_ops_per_microbatch']:.0f} / {r['hf_ops_per_microbatch']:.0f} |"
        )
    return "\n".join(lines)


def profile(name: str, c: Case, args: argparse.Namespace, device: torch.device) -> None:
    """torch.profiler tables (device time) of one step of each side."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    mc = model_config(c, args.dropout)
    torch.manual_seed(0)
    base = M2M100Translation(mc)
    batch = make_batch(c, mc)
    for impl, build in (
        ("ours", lambda: ours(base, c, batch, device, True)),
        ("hf", lambda: hf(base, c, batch, device, True, False)),
    ):
        step, _ = build()
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step()
            torch.cuda.synchronize()
        print(f"===== profile {name} {impl}: top by device time (2 steps)")
        print(
            prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=22, max_name_column_width=70)
        )
        del step
        gc.collect()
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="cpu_small", help=f"comma-separated, from {list(CASES)}")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side (GPU: per block of 3)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--compile", action="store_true", help="also time ours and HF compiled (GPU)")
    ap.add_argument(
        "--ablation", action="store_true", help="also ours with autocast alone (no working weights)"
    )
    ap.add_argument(
        "--impls", default="", help="only these sides, in this order (GPU), e.g. ours_autocast_only,ours"
    )
    ap.add_argument("--profile", default="", help="comma-separated cases to profile (GPU)")
    ap.add_argument("--json", default="", help="write the rows here")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _init_single_process_group(device)
    rows = []
    for name in [n for n in args.cases.split(",") if n]:
        row = measure(name, CASES[name], args, device)
        print("RESULT " + json.dumps(row), flush=True)
        rows.append(row)
    for name in [n for n in args.profile.split(",") if n]:
        profile(name, CASES[name], args, device)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def _init_single_process_group(device: torch.device) -> None:
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


if __name__ == "__main__":
    main()
