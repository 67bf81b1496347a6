#!/usr/bin/env bash
# Create .venv if missing, install with test extras, then lint, type-check and run every test.
#   scripts/test.sh                 # everything (CPU; gloo multi-process tests included)
#   scripts/test.sh -m "not slow"   # quick tier (extra args go to pytest)
# Tests run in TEST_WORKERS pytest-xdist workers (default 2: the suite's single-process phases
# run one thread each, OMP_NUM_THREADS=1); a module stays on one worker, its fixtures built
# once, in xdist's order (most tests first: the unit modules fill the cores while the group tests
# wait; tests/conftest.py); docs/development.md has the times. TEST_WORKERS=0: in this process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/_setup_env.sh test
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1 WANDB_MODE=disabled
echo "== ruff"; ruff check . && ruff format --check models parallel trainer tests scripts
echo "== mypy"; mypy
WORKERS="${TEST_WORKERS:-2}"
XDIST=()
[ "$WORKERS" != 0 ] && XDIST=(-n "$WORKERS" --dist loadfile)
echo "== pytest"; python -m pytest -q -p no:cacheprovider "${XDIST[@]}" "$@"
