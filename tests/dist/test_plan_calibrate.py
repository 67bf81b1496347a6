"""`python -m trainer.plan` with calibration runs, end to end on 2 gloo ranks.

Each family (mesh, split backward or not) is run once by trainer.train to fit its compute
scale and step offset; the calibration layout's calibrated prediction must then be exactly
its calibration run's median step. (`--validate`'s rounds are tested in tests/unit/test_plan.py.)
(Whether the prediction is within 15% is a property of a quiet machine, shown in the
README's measured results, not asserted here.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.served import Served

ROOT = Path(__file__).resolve().parents[2]


def test_plan_calibrates_each_family(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    cmd = [served.python, "-m", "trainer.plan", "--config", "configs/tiny.yaml", "--world_size", "2",
           "--seq_len", "12", "--link_gbps", "1", "--repeats", "1", "--schedules", "1f1b,zero_bubble",
           "--remat", "none", "--max_microbatches", "2", "--validate_steps", "5",
           "--validate_warmup", "2", "--validate_repeats", "1", "--validate_dir", str(tmp_path / "runs"), "--output", str(out),
           "--builtin_size", "200", "--calibrate", "true"]  # fmt: skip
    env = served.environ()
    if (os.cpu_count() or 1) < 2:
        pytest.skip("calibrating a 2-rank world needs 2 cores")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    families = {(c["mesh"]["pp"], c["mesh"]["tp"], c["mesh"]["dp"], c["schedule"]) for c in result["calibration"]}
    assert families == {(1, 1, 2, "1f1b"), (2, 1, 1, "1f1b"), (2, 1, 1, "zero_bubble"), (1, 2, 1, "1f1b")}
    ranked = 0
    for c in result["calibration"]:
        assert c["compute_scale"] > 0 and c["measured_compute_s"] > 0
        same = [r for r in result["candidates"] if r["args"] == c["args"]]
        if same:  # the calibration layout is still ranked: its prediction is its measurement
            assert same[0]["predicted_step_time_s"] == pytest.approx(c["measured_step_time_s"], rel=1e-9)
            ranked += 1
    assert ranked >= 2, "the calibration layouts (smallest lower bounds) should be among the ranked"
    assert "calibrated pp=2 tp=1 dp=1 zero_bubble: compute x" in proc.stdout
