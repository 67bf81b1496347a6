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
    """configs/tiny.yaml, deterministic (dropout 0), small data, no eval, 5 steps."""
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
        hist = summary.get("history") or []
        out.append([(r["step"], r["loss"], r["grad_norm"]) for r in hist if "loss" in r] or None)
    return out
