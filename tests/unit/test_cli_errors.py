"""Bad input: one clear line naming the bad value and what is valid, exit code 2,
raised before any collective could hang and before anything is written."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "unknown-flag": (["--foo", "1"], "unknown flag(s) ['--foo']"),
    # issue 30: argparse's usage block and "train.py: error: argument --max_steps/--max-steps: invalid
    # int value: '1e3'" instead of one line; `--max-steps` (the spelling --help prints) was an unknown flag
    "bad-int": (["--max_steps", "1e3"], "ConfigError: max_steps='1e3' is not an integer; write 1000"),
    "dashed-flag": (["--max-steps", "0"], "max_steps=0 must be >= 1, or -1 to train num_train_epochs"),
    "bad-schedule": (["--pipeline_schedule", "bogus"], "pipeline_schedule='bogus' is not valid"),
    "bad-remat": (["--activation_checkpointing", "some"], "activation_checkpointing='some' is not valid"),
    "mesh-vs-world": (
        ["--tensor_parallel_size", "2"],
        "tensor_parallel_size=2 does not divide 1 rank; valid: 1",
    ),
    "mesh-product": (
        ["--data_parallel_size", "2"],
        "pipeline_parallel_size(1) * data_parallel_size(2) * tensor_parallel_size(1) = 2 != WORLD_SIZE(1)",
    ),
    "nan-policy": (["--nan_policy", "ignore"], "nan_policy='ignore' is not valid"),
    "heads": (["--encoder_attention_heads", "3"], "d_model=64 is not divisible by encoder_attention_heads=3"),
    "negative-lr": (["--learning_rate", "-1"], "learning_rate=-1.0 must be >= 0"),  # was: late, in AdamW
    "balance": (["--partition_method", "3,3"], "balance [3, 3]"),
    "missing-file": (
        ["--dataset_name", "", "--train_file", "/nonexistent/train.jsonl", "--do_eval", "false"],
        "/nonexistent/train.jsonl",
    ),
    # issue 36: failed after config.yaml, tokenizer/ and the data cache were written, with a 49-line trace
    "wandb-not-installed": (
        ["--report_to", "wandb"],
        "report_to=['wandb']: the wandb package is not installed",
    ),
    # issue 23: a model directory with weights and config only exited 0, training a new tokenizer
    "pretrained-without-tokenizer": (
        ["--model_name_or_path", "{bare_model}"],
        "holds no tokenizer files (tokenizer.json, tokenizer_config.json, sentencepiece.bpe.model, "
        "sentencepiece.model, polyglot_tokenizer.json): set tokenizer_name",
    ),
    # issue 36: the shipped configs set overwrite_output_dir, so the same command run again deleted
    # the earlier run (checkpoints 100-800); now it is refused, naming what is there and the ways on
    "rerun": (
        [],
        "already exists and is not empty (checkpoint-100..800 (8 checkpoints), config.yaml, metrics.jsonl, "
        "tokenizer/); nothing was written: continue that run with --resume_from_checkpoint latest; start "
        "over with --overwrite_output_dir true",
    ),
}
EARLIER_RUN = [
    *(f"checkpoint-{s}/" for s in range(100, 900, 100)),
    "tokenizer/",
    "config.yaml",
    "metrics.jsonl",
]


def _earlier_run(out: Path) -> list[str]:
    """`out` as a finished run left it (EARLIER_RUN); its listing."""
    for name in EARLIER_RUN:
        (out / name).mkdir(parents=True) if name.endswith("/") else (out / name).write_text("earlier run\n")
    return sorted(p.name for p in out.iterdir())


# Cases run as `python -m trainer.train` in an interpreter where a package cannot be imported (a
# sys.modules entry of None: how Python blocks an import, as if the package were not installed).
WITHOUT = {"wandb-not-installed": "wandb"}
WITHOUT_CODE = (
    "import runpy, sys; sys.modules[{name!r}] = None; sys.argv[0] = 'trainer.train'; "
    "runpy.run_module('trainer.train', run_name='__main__', alter_sys=True)"
)


def _bare_model(path: Path) -> Path:
    """A Hugging Face M2M100 directory with weights and config only (no tokenizer files)."""
    from models.config import ModelConfig
    from models.hf_save import save_hf_model
    from models.m2m100 import M2M100Translation

    mc = ModelConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32)  # fmt: skip
    save_hf_model(M2M100Translation(mc).state_dict(), mc, path)
    return path


@pytest.fixture(scope="module")
def outcomes(served, tmp_path_factory) -> dict[str, tuple[int, str, Path]]:
    env = served.environ()
    procs = {}
    bare = str(_bare_model(tmp_path_factory.mktemp("bare_model")))
    for name, (args, _) in CASES.items():
        out = tmp_path_factory.mktemp(name) / "out"
        if name == "rerun":
            _earlier_run(out)
        args = [a.replace("{bare_model}", bare) for a in args]
        run = ["-c", WITHOUT_CODE.format(name=WITHOUT[name])] if name in WITHOUT else ["-m", "trainer.train"]
        cmd = served.cmd(*run, "--config", "configs/tiny.yaml", "--output_dir", str(out), *args)
        procs[name] = (
            subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            ),
            out,
        )
    results = {}
    for name, (proc, out) in procs.items():
        try:
            _, err = proc.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        results[name] = (proc.returncode, err, out)
    return results


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_clear_line(outcomes, name: str) -> None:
    code, err, out = outcomes[name]
    expected = CASES[name][1]
    last = [ln for ln in err.strip().splitlines() if ln.strip()][-1]
    assert code == 2, err[-2000:]
    assert last.startswith("error: ") and expected in last, last
    assert "Traceback" not in err and "usage:" not in err
    if name == "rerun":  # the lock was taken and dropped; nothing else touched
        assert sorted(p.name for p in out.iterdir() if p.name != ".lock") == _earlier_run(
            out.parent / "again"
        )
    elif name != "missing-file":  # found before the data is read: nothing written at all
        assert not out.exists() or not any(out.iterdir())
