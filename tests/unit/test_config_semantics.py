"""What a config means when file and flags meet: `null` unsets, two data sources or two ways
of naming directions are an error, `report_to` the HF Trainer's way, `--help` by section.

Regressions: `--train_file my.jsonl` over a config with `dataset_name: builtin` trained on the
built-in corpus, silently; `--dataset_name null` looked for a Hub dataset called "null";
`--source_lang/--target_lang` were ignored when the config had `language_pairs`;
`report_to: [wandb]` (HF's list form) was rejected.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.served import Served
from trainer.config.parse import parse_config
from trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs/tiny.yaml")


def test_null_on_the_command_line_unsets_the_file_value(tmp_path: Path) -> None:
    cfg = parse_config(["--config", TINY, "--dataset_name", "null", "--train_file", "t.jsonl"])
    assert cfg.data.dataset_name is None and cfg.data.train_file == "t.jsonl"
    cfg = parse_config(["--config", TINY, "--dataset_name=null", "--train_file=t.jsonl"])
    assert cfg.data.dataset_name is None
    cfg = parse_config(["--config", TINY, "--max_eval_samples", "null"])  # an int field
    assert cfg.data.max_eval_samples is None


def test_dataset_name_with_train_file_names_both() -> None:
    with pytest.raises(ConfigError, match=r"dataset_name='builtin' and train_file='my\.jsonl' are both set"):
        parse_config(["--config", TINY, "--train_file", "my.jsonl"])


def test_source_target_conflicting_with_language_pairs() -> None:
    with pytest.raises(
        ConfigError, match=r"source_lang='en' / target_lang='cs' conflict with language_pairs"
    ):
        parse_config(["--config", TINY, "--source_lang", "en", "--target_lang", "cs"])
    cfg = parse_config(
        ["--config", TINY, "--language_pairs", "null", "--source_lang", "en", "--target_lang", "cs"]
    )
    assert cfg.data.directions() == [("en", "cs")]
    cfg = parse_config(
        ["--config", TINY, "--language_pairs", "en-de", "--source_lang", "en", "--target_lang", "de"]
    )
    assert cfg.data.directions() == [("en", "de")]  # the same single direction twice is no conflict


@pytest.mark.parametrize(
    ("flags", "want"),
    [
        (["--report_to", "none"], []),
        (["--report_to", "wandb"], ["wandb"]),
        (["--report_to", "wandb", "tensorboard"], ["wandb", "tensorboard"]),
        (["--report_to", "tensorboard,wandb"], ["tensorboard", "wandb"]),
    ],
)
def test_report_to_takes_a_name_a_list_or_none(flags: list[str], want: list[str]) -> None:
    assert parse_config(["--config", TINY, *flags]).training.report_to == want


def test_report_to_all_and_bad_names(tmp_path: Path) -> None:
    import importlib.util

    installed = [n for n in ("wandb", "tensorboard") if importlib.util.find_spec(n)]
    assert parse_config(["--config", TINY, "--report_to", "all"]).training.report_to == installed
    yaml_list = tmp_path / "c.yaml"
    yaml_list.write_text(Path(TINY).read_text().replace("report_to: none", "report_to: [wandb]"))
    assert parse_config(["--config", str(yaml_list)]).training.report_to == ["wandb"]
    with pytest.raises(ConfigError, match=r"'comet' is not valid; choose from \['wandb', 'tensorboard'\]"):
        parse_config(["--config", TINY, "--report_to", "comet"])


def test_help_opens_with_config_usage_and_groups_by_section(served: Served) -> None:
    out = subprocess.run(
        served.cmd("-m", "trainer.train", "--help"),
        cwd=ROOT,
        env=served.environ(),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith("usage: python -m trainer.train --config FILE.yaml")
    heads = [
        ln.split(":")[0] for ln in out.splitlines() if ln and not ln.startswith(" ") and ln.endswith(":")
    ]
    assert [h for h in heads if h in ("model", "data", "parallel", "training")] == [
        "model",
        "data",
        "parallel",
        "training",
    ]
