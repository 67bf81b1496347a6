"""Workers running the real trainer (`trainer.train.run`) on several meshes in one process group.

One spawned group of W ranks trains every W-rank mesh shape in turn (new DeviceMesh
each time), which keeps the multi-process parity suite inside CI's budget.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
GLOBAL_BATCH = 16


def base_config(tmp: str, tokenizer_dir: str | None = None, **extra: Any) -> dict[str, Any]:
    """configs/tiny.yaml, deterministic (dropout 0), small data, no eval, 5 steps, no plots (the
    PNGs cost the logging rank ~0.7 CPU-s a run; tests/dist/test_follow_run.py checks them)."""
    cfg = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    cfg.update(
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        builtin_size=600,
        max_steps=5,
        do_eval=False,
        logging_steps=1,
        report_to="none",
        plots=False,
        disable_tqdm=True,
        overwrite_output_dir=True,
        output_dir=os.path.join(tmp, "run"),
        learning_rate=3e-3,
        warmup_steps=1,
    )
    if tokenizer_dir:
        cfg["tokenizer_name"] = tokenizer_dir
    cfg.update(extra)
    return cfg


def mesh_overrides(
    pp: int = 1, dp: int = 1, tp: int = 1, m: int = 1, gas: int = 1, **extra: Any
) -> dict[str, Any]:
    """Parallel fields for a mesh with the same global batch (GLOBAL_BATCH pairs) as every other."""
    per_device = GLOBAL_BATCH // (dp * m * gas)
    assert per_device * dp * m * gas == GLOBAL_BATCH, (dp, m, gas)
    return {
        "pipeline_parallel_size": pp,
        "data_parallel_size": dp,
        "tensor_parallel_size": tp,
        "num_microbatches": m,
        "gradient_accumulation_steps": gas,
        "per_device_train_batch_size": per_device,
        **extra,
    }


def train_cases(rank: int, world: int, base: dict[str, Any], cases: list[dict[str, Any]]) -> list[Any]:
    """Train each case (base + overrides); returns per case the logging rank's [(step, loss, grad_norm)]."""
    return [hist for hist, _ in train_summaries(rank, world, base, cases)]


def train_summaries(
    rank: int, world: int, base: dict[str, Any], cases: list[dict[str, Any]]
) -> list[tuple[Any, dict[str, Any]]]:
    """`train_cases`, each case's history paired with its run summary (without `history`)."""
    import logging

    import datasets

    from trainer.config.parse import load_config_dict
    from trainer.run.loop import run

    datasets.disable_progress_bars()
    logging.basicConfig(level=logging.WARNING)
    out = []
    for i, case in enumerate(cases):
        values = {**base, **case}
        values.setdefault("output_dir", base["output_dir"])
        values["output_dir"] = case.get("output_dir", f"{base['output_dir']}-{i}")
        summary = run(load_config_dict(values))
        hist = summary.pop("history", None) or []
        out.append(([(r["step"], r["loss"], r["grad_norm"]) for r in hist if "loss" in r] or None, summary))
    return out


def tp_layer_graph_breaks(
    rank: int, world: int, sequence_parallel: bool, dropout: float
) -> dict[str, tuple[int, int]]:
    """(graphs, graph breaks) dynamo captures of a tp=2 encoder and decoder layer: the layers' c10d
    collectives inside autograd functions are traced (dynamo turns them into functional
    collectives), not broken at; with dropout, each tp-split site draws its mask from a per-rank
    generator fork (`parallel.tp.rng`) that dynamo does not trace. Ranks 0 and 1 (the first tp
    pair) capture; the other pairs would capture the same (12 CPU-s a rank), so they return {}."""
    import torch

    from models.config import ModelConfig
    from models.m2m100 import M2M100Translation
    from parallel.mesh import ParallelDims, build_mesh
    from parallel.tp.apply import apply_tensor_parallel

    cfg = ModelConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=dropout,
                      attention_dropout=dropout, activation_dropout=dropout)  # fmt: skip
    mesh = build_mesh(ParallelDims(pp=1, dp=world // 2, tp=2, world_size=world), "cpu")
    model = M2M100Translation(cfg, seed=0)
    apply_tensor_parallel(model, mesh.group("tp"), sequence_parallel=sequence_parallel)
    if rank >= 2:
        return {}
    x = torch.randn(2, 8, 32, requires_grad=True)
    memory = torch.randn(2, 6, 32, requires_grad=True)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 4:] = False
    torch._dynamo.reset()
    enc_layer, dec_layer = model.encoder.layers["0"], model.decoder.layers["0"]
    # through a call of the module, as `Module.compile` traces it (its sequence-parallel hooks inlined)
    enc = torch._dynamo.explain(lambda *a: enc_layer(*a))(memory, mask)
    dec = torch._dynamo.explain(lambda *a: dec_layer(*a))(x, memory, mask)
    return {
        "encoder": (enc.graph_count, enc.graph_break_count),
        "decoder": (dec.graph_count, dec.graph_break_count),
    }


def compile_group(
    rank: int, world: int, base: dict[str, Any], cases: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[tuple[Any, dict[str, Any]]]]:
    """One group for the compiled runs: tp=2 layers' graph breaks, then `train_summaries`."""
    breaks = {f"sp={sp} dropout={p}": tp_layer_graph_breaks(rank, world, sp, p) for sp in (False, True)
              for p in (0.0, 0.1)}  # fmt: skip
    return breaks, train_summaries(rank, world, base, cases)
