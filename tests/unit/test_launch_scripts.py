"""The launch scripts, run by bash with their external commands (`srun`, `scontrol`,
`torchrun`) replaced by recorders (no SLURM or cluster here): what they hand on.

The sbatch tests pin three bugs of its first version: `srun` did not pass --cpus-per-task
(Slurm >= 22.05 steps do not inherit it, so each node's 8 workers shared one CPU), the
GPU count was hard-coded to 8, and its flags overrode the config's documented schedule
and micro-batches. The launcher tests pin SIGUSR1 forwarding (torchrun dies on it by
default, orphaning the workers) and the per-attempt rendezvous store under restarts.
Issue 30: the output directory held SLURM_JOB_ID, so a resubmitted job (new id) started from
scratch beside the first one's checkpoints despite `--resume_from_checkpoint latest`.
Issue 36: configs/demo.yaml set overwrite_output_dir, so `scripts/demo.sh` run twice deleted the
first demo run; without it a second run would be refused, so the script gives it a directory of
its own and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run_sbatch(
    tmp_path: Path, *args: str, gpus: str = "4", job_id: str = "4242"
) -> tuple[list[str], dict[str, str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun.txt"
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho node-a; echo node-b\n")
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        f'printf "%s\\n" "$@" > {record}\n'
        f'echo "NPROC_PER_NODE=$NPROC_PER_NODE MASTER_ADDR=$MASTER_ADDR NNODES=$NNODES" >> {record}.env\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RUN_NAME", "OUTPUT_DIR")},
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "m2m100-3d",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_CPUS_PER_TASK": "64",
        "SLURM_GPUS_ON_NODE": gpus,
        "SLURM_SUBMIT_DIR": str(REPO),
    }
    subprocess.run(
        ["bash", str(REPO / "scripts/slurm_example.sbatch"), *args],
        env=env,
        check=True,
        capture_output=True,
        timeout=30,
    )
    env_line = (tmp_path / "srun.txt.env").read_text().split()
    return record.read_text().splitlines(), dict(kv.split("=", 1) for kv in env_line)


def test_sbatch_passes_cpus_gpus_and_keeps_the_config_layout(tmp_path: Path) -> None:
    argv, env = _run_sbatch(tmp_path, "--max_steps", "5", gpus="4")
    assert "--cpus-per-task=64" in argv
    assert env == {"NPROC_PER_NODE": "4", "MASTER_ADDR": "node-a", "NNODES": "2"}
    launcher = argv.index("scripts/launch_multinode.sh")
    trainer_args = argv[launcher + 1 :]
    assert trainer_args[:2] == ["--config", "configs/m2m100_1b_4x8.yaml"]
    assert trainer_args[-2:] == ["--max_steps", "5"]  # the job's own extra flags come last
    for flag in ("--pipeline_schedule", "--num_microbatches", "--tensor_parallel_size", "--bf16"):
        assert flag not in trainer_args, f"{flag} would override the config's documented layout"


def test_a_resubmitted_job_keeps_its_output_dir(tmp_path: Path) -> None:
    """A resubmission gets a new SLURM_JOB_ID: the output_dir (where `latest` looks) must not change."""
    argv = []
    for job in ("4242", "5353"):
        (tmp_path / job).mkdir()
        argv.append(_run_sbatch(tmp_path / job, job_id=job)[0])
    dirs = [a[a.index("--output_dir") + 1] for a in argv]
    assert dirs[0] == dirs[1] == "outputs/m2m100-3d", dirs  # was outputs/m2m100-3d-4242, -5353
    assert all(a[a.index("--resume_from_checkpoint") + 1] == "latest" for a in argv)
    assert all(a[a.index("--run_name") + 1] == "m2m100-3d" for a in argv)


# `srun` of the resubmission test: parses the trainer flags the job hands on (`trainer.config`), says
# which checkpoint `--resume_from_checkpoint` resolves to, then commits one as a run would.
TRAINER_STUB = """
import json, sys
from pathlib import Path
from trainer.checkpoint.commit import COMMIT_MARKER
from trainer.checkpoint.dcp import resolve_resume
from trainer.config.parse import parse_config
args = sys.argv[sys.argv.index("scripts/launch_multinode.sh") + 1 :]
cfg = parse_config(args)
out = Path(cfg.training.output_dir).resolve()
found = resolve_resume(cfg.training.resume_from_checkpoint, out)
step = 0 if found is None else int(found.name.split("-")[1])
(out / f"checkpoint-{step + 5}").mkdir(parents=True)
(out / f"checkpoint-{step + 5}" / COMMIT_MARKER).write_text("ok")
print(json.dumps({"output_dir": str(out), "resumed_from": found and str(found.resolve()),
                  "run_name": cfg.training.run_name}))
"""


@pytest.mark.slow  # two trainer-config parses in fresh processes (torch and transformers imports)
def test_a_resubmitted_job_resumes_in_the_same_output_dir(tmp_path: Path) -> None:
    """Two submissions of the job (new SLURM_JOB_ID each, as a resubmission gets): one output_dir,
    and the second resumes from the first one's checkpoint."""
    submit = tmp_path / "submit"  # the submit directory: where outputs/ goes, not the repository
    submit.mkdir()
    for name in ("configs", "scripts"):
        (submit / name).symlink_to(REPO / name)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "trainer_stub.py").write_text(TRAINER_STUB)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho node-a\n")
    (bin_dir / "srun").write_text(
        f'#!/usr/bin/env bash\nexec {sys.executable} {tmp_path / "trainer_stub.py"} "$@"\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    runs = []
    for job_id in ("4242", "5353"):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RUN_NAME", "OUTPUT_DIR"))}
        env.update({
            "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO), "SLURM_JOB_ID": job_id,
            "SLURM_JOB_NAME": "m2m100-3d", "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node-a",
            "SLURM_SUBMIT_DIR": str(submit),
        })  # fmt: skip
        done = subprocess.run(
            ["bash", str(REPO / "scripts/slurm_example.sbatch")],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    out = submit / "outputs" / "m2m100-3d"
    assert first["output_dir"] == second["output_dir"] == str(out.resolve())
    assert first["resumed_from"] is None
    assert second["resumed_from"] == str((out / "checkpoint-5").resolve())
    assert first["run_name"] == second["run_name"] == "m2m100-3d"


def test_sbatch_log_path_needs_no_directory() -> None:
    text = (REPO / "scripts/slurm_example.sbatch").read_text()
    outputs = [
        ln.split("=", 1)[1]
        for ln in text.splitlines()
        if ln.startswith(("#SBATCH --output", "#SBATCH --error"))
    ]
    assert outputs and all("/" not in o for o in outputs), outputs


def test_sbatch_signals_the_workers_before_the_time_limit() -> None:
    text = (REPO / "scripts/slurm_example.sbatch").read_text()
    assert "#SBATCH --signal=USR1@" in text and "--signal=B:" not in text


def _run_launcher(tmp_path: Path, *, with_signal_flag: bool, max_restarts: str) -> tuple[list[str], str]:
    """launch_multinode.sh with TORCHRUN pointing at a recorder: its argv and the store variable."""
    fake = tmp_path / "torchrun"
    record = tmp_path / "argv.txt"
    help_text = "  --signals-to-handle SIGNALS_TO_HANDLE" if with_signal_flag else "  --max-restarts"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$1" == "--help" ]]; then echo "{help_text}"; exit 0; fi\n'
        f'printf "%s\\n" "$@" > {record}\n'
        f'echo "${{TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-unset}}" > {record}.store\n'
    )
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCH_DISABLE"))}
    env.update({"TORCHRUN": str(fake), "NPROC_PER_NODE": "2", "MAX_RESTARTS": max_restarts})
    subprocess.run(
        ["bash", str(REPO / "scripts/launch_multinode.sh"), "--config", "configs/tiny.yaml"],
        env=env,
        check=True,
        capture_output=True,
        timeout=30,
    )
    return record.read_text().splitlines(), (tmp_path / "argv.txt.store").read_text().strip()


def test_launcher_forwards_sigusr1_and_isolates_restart_stores(tmp_path: Path) -> None:
    argv, store = _run_launcher(tmp_path, with_signal_flag=True, max_restarts="1")
    i = argv.index("--signals-to-handle")
    assert "SIGUSR1" in argv[i + 1].split(",") and "SIGTERM" in argv[i + 1].split(",")
    assert argv[argv.index("--max-restarts") + 1] == "1" and store == "1"
    assert argv[-4:] == ["-m", "trainer.train", "--config", "configs/tiny.yaml"]


def test_launcher_without_the_signal_flag_or_restarts(tmp_path: Path) -> None:
    argv, store = _run_launcher(tmp_path, with_signal_flag=False, max_restarts="0")
    assert "--signals-to-handle" not in argv  # an older torchrun would reject the flag
    assert store == "unset"


def _run_demo(tmp_path: Path, *args: str) -> tuple[list[str], str]:
    """scripts/demo.sh in a copy of the repository's layout whose set-up does nothing and whose
    torchrun records its arguments: (the trainer's arguments, the script's stdout)."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    (tmp_path / "scripts/demo.sh").write_text((REPO / "scripts/demo.sh").read_text())
    (tmp_path / "scripts/_setup_env.sh").write_text("true\n")
    bin_dir, record = tmp_path / ".venv/bin", tmp_path / "argv.txt"
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    (bin_dir / "torchrun").write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {record}\n')
    (bin_dir / "torchrun").chmod(0o755)
    done = subprocess.run(
        ["bash", str(tmp_path / "scripts/demo.sh"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    argv = record.read_text().splitlines()
    return argv[argv.index("--config") + 2 :], done.stdout


def test_demo_run_twice_keeps_the_first_run(tmp_path: Path) -> None:
    assert _run_demo(tmp_path, "--max_steps", "2") == (["--max_steps", "2"], "")  # a fresh clone
    (tmp_path / "outputs/demo").mkdir(parents=True)
    (tmp_path / "outputs/demo/.lock").write_text("")
    assert _run_demo(tmp_path)[0] == []  # only the lock of a run that was refused: nothing to keep
    (tmp_path / "outputs/demo/checkpoint-400").mkdir()
    (tmp_path / "outputs/demo-2").mkdir()  # empty: free
    args, out = _run_demo(tmp_path, "--max_steps", "2")
    assert args == ["--max_steps", "2", "--output_dir", "outputs/demo-2"]
    assert out.startswith(
        "scripts/demo.sh: outputs/demo holds an earlier demo run, kept; this run writes outputs/demo-2"
    )
    (tmp_path / "outputs/demo-2/metrics.jsonl").write_text("{}\n")
    assert _run_demo(tmp_path)[0] == ["--output_dir", "outputs/demo-3"]
    for named in (["--output_dir", "x"], ["--output-dir=x"], ["--overwrite_output_dir", "true"],
                  ["--resume_from_checkpoint", "latest"]):  # fmt: skip
        assert _run_demo(tmp_path, *named) == (named, ""), named  # the user's choice stands


def _gpu_check(tmp_path: Path, budget: str) -> tuple[str, list[str]]:
    """scripts/gpu_check.sh with `python` a recorder that has no CUDA (its CUDA probe exits 1)."""
    record = tmp_path / "python.txt"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'printf "%s\\n" "$*" >> {record}\n'
        'case "$*" in *"0 if torch.cuda.is_available()"*) exit 1;; esac\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "GPU_CHECK_BUDGET_S": budget}
    out = subprocess.run(["bash", str(REPO / "scripts/gpu_check.sh"), str(tmp_path / "out")], env=env,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return out, record.read_text().splitlines()


def test_gpu_check_without_cuda_runs_its_cpu_parts_and_skips_each_gpu_part_in_one_line(
    tmp_path: Path,
) -> None:
    out, calls = _gpu_check(tmp_path, "465")
    lines = [line for line in out.splitlines() if line.startswith("gpu_check: ")]
    gpu = ["tiny_compile", "bench_418m", "bench_418m_m8", "bench_1.2b", "bench_moe_32", "bench_moe_128"]
    for part in gpu:
        assert f"gpu_check: {part}: skipped: needs CUDA" in lines, out
    cpu = [line for line in lines if not any(f": {p}:" in line for p in gpu)]
    assert len(cpu) == 8 and all(": ok in " in line for line in cpu), out
    assert any("trainer.train --config configs/tiny_moe.yaml" in c and "--max_steps 4" in c for c in calls)
    assert any("--teacher_model_name_or_path" in c and "tiny_moe/checkpoint-4" in c for c in calls)
    assert any(c.startswith("scripts/gpu_report.py") for c in calls)
    assert not any("bench.py" in c or "bench_moe.py" in c for c in calls)


def test_gpu_check_skips_what_its_time_budget_leaves_no_room_for(tmp_path: Path) -> None:
    out, calls = _gpu_check(tmp_path, "0")
    lines = [line for line in out.splitlines() if line.startswith("gpu_check: ")]
    assert len(lines) == 14 and all("skipped" in line for line in lines), out
    assert not any("trainer" in c for c in calls)
