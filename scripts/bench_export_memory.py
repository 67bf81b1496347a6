"""Peak host memory of `python -m trainer.export`, as a share of the model's fp32 bytes.

    python scripts/bench_export_memory.py --work /tmp/exportmem [--code_root /path/to/other/checkout]
    python scripts/bench_export_memory.py --work /tmp/exportmem --model 361m --max_shard_size 300MB

Writes a DCP checkpoint of a random model (the layout `trainer.checkpoint.dcp.save_checkpoint`
gives it: "model" tensors by single-device name, trainer_state.json, COMMITTED) and a run
tokenizer once, then runs the export in a fresh subprocess per setting and reads its peak RSS
(`resource.getrusage(RUSAGE_SELF).ru_maxrss`, read in that process at its end). `--code_root`
runs the export from another checkout (e.g. main, for a before/after). A baseline subprocess
that only imports the export's modules gives the part of the peak that is the interpreter,
torch and transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_D1024 = dict(d_model=1024, encoder_attention_heads=16, decoder_attention_heads=16, encoder_ffn_dim=4096,
              decoder_ffn_dim=4096, max_position_embeddings=256)  # fmt: skip
MODELS = {
    # a 268M-parameter M2M100 (1.07 GB in fp32): d_model 1024, 8 + 8 layers, ffn 4096, 32k vocabulary
    "268m": dict(vocab_size=32000, encoder_layers=8, decoder_layers=8, **_D1024),
    # scripts/bench_memory.py's 361M model (configs/bench_memory_361m.yaml): 12 + 12 layers, 8k vocabulary
    "361m": dict(vocab_size=8000, encoder_layers=12, decoder_layers=12, **_D1024),
}
_PEAK = (
    "import resource, runpy, sys\n"
    "sys.argv = ['trainer.export', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('trainer.export', run_name='__main__')\n"
    "except SystemExit as e:\n"
    "    assert not e.code, e.code\n"
    "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
)
_BASELINE = (
    "import resource\n"
    "import torch, transformers, torch.distributed.checkpoint, safetensors.torch  # noqa\n"
    "from transformers import HfArgumentParser  # noqa\n"
    "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
)


def make_run(work: Path, model_name: str) -> tuple[Path, int]:
    """work/run-<model>/{tokenizer, checkpoint-1}; returns the checkpoint and the model's fp32 bytes."""
    import torch
    import torch.distributed.checkpoint as dcp

    from models.config import ModelConfig
    from models.m2m100 import M2M100Translation
    from trainer.checkpoint.commit import hash_files, unlisted_files, write_marker
    from trainer.tokenizer.vocab import train_tokenizer

    run = work / f"run-{model_name}"
    ckpt = run / "checkpoint-1"
    texts = [f"{w} number {i} is here and there" for i in range(200) for w in ("hello", "hallo", "welt")]
    tok = train_tokenizer(texts, ["de", "en"], 200)
    config = ModelConfig.from_dict({**MODELS[model_name], **tok.special_ids()})
    with torch.device("meta"):
        numel = sum(p.numel() for p in M2M100Translation(config).parameters())
    if (ckpt / "COMMITTED").is_file():
        return ckpt, numel * 4
    tok.save(run / "tokenizer")
    model = M2M100Translation(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(
            {"model": {k: p.detach() for k, p in model.named_parameters()}},
            checkpoint_id=str(ckpt),
            no_dist=True,
        )
    state = {"step": 1, "mesh": {"pp": 1, "dp": 1, "tp": 1}, "model_config": config.to_dict()}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    write_marker(ckpt, 1, hash_files(ckpt, unlisted_files(ckpt, {})))
    return ckpt, numel * 4


def peak_kib(code: str, args: list[str], code_root: Path) -> int:
    env = {**os.environ, "PYTHONPATH": str(code_root), "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=code_root,
        env=env,
        check=False,
    )
    if res.returncode != 0:
        raise RuntimeError(f"export failed: {res.stderr[-2000:]}")
    return int(next(ln for ln in res.stdout.splitlines() if ln.startswith("PEAK_KIB")).split()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--code_root", type=Path, default=ROOT, help="the checkout whose export runs")
    parser.add_argument("--max_shard_size", nargs="*", default=["100MB"], help="settings to measure")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--model", choices=sorted(MODELS), default="268m", help="the checkpoint's model")
    parser.add_argument("--make_only", action="store_true", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.make_only:
        print(json.dumps([str(p) for p in make_run(a.work, a.model)]))
        return
    # The checkpoint is made in a child: a child's ru_maxrss starts at its parent's RSS at fork
    # (Linux keeps the high-water mark across exec), so this process stays small.
    made = subprocess.run(
        [sys.executable, __file__, "--work", str(a.work), "--model", a.model, "--make_only"],
        capture_output=True,
        text=True,
        check=True,
    )
    ckpt_str, model_bytes_str = json.loads(made.stdout.splitlines()[-1])
    ckpt, model_bytes = Path(ckpt_str), int(model_bytes_str)
    base = peak_kib(_BASELINE, [], a.code_root) * 1024
    print(
        f"model {a.model}: fp32 bytes {model_bytes / 2**20:.0f} MiB; baseline (imports) {base / 2**20:.0f} MiB"
    )
    for size in a.max_shard_size:
        out = a.work / f"hf-{a.model}-{size}"
        args = ["--checkpoint", str(ckpt), "--output", str(out), "--overwrite"]
        if size != "none":  # "none": a checkout without --max_shard_size and --dtype
            args += ["--max_shard_size", size, "--dtype", a.dtype]
        peak = peak_kib(_PEAK, args, a.code_root) * 1024
        shutil.rmtree(out, ignore_errors=True)  # GBs: only the peak is kept
        print(
            f"max_shard_size {size} dtype {a.dtype}: peak RSS {peak / 2**20:.0f} MiB = "
            f"{peak / model_bytes:.2f}x the model's fp32 bytes ({(peak - base) / model_bytes:.2f}x above the imports)"
        )


if __name__ == "__main__":
    main()
