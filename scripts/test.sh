#!/usr/bin/env bash
# Create .venv if missing, install with test extras, then lint, type-check (beside pytest) and run every test.
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
# mypy runs on one core for about 26 s: beside pytest (whose workers keep both cores busy), it
# costs the suite half that. Its report and status come after pytest's; either failing fails.
MYPY_LOG="$(mktemp)"
mypy >"$MYPY_LOG" 2>&1 &
MYPY_PID=$!
trap 'kill "$MYPY_PID" 2>/dev/null || true; rm -f "$MYPY_LOG"' EXIT  # also when pytest is interrupted
WORKERS="${TEST_WORKERS:-2}"
XDIST=()
[ "$WORKERS" != 0 ] && XDIST=(-n "$WORKERS" --dist loadfile)
PYTEST_RC=0
echo "== pytest"; python -m pytest -q -p no:cacheprovider "${XDIST[@]}" "$@" || PYTEST_RC=$?
MYPY_RC=0
wait "$MYPY_PID" || MYPY_RC=$?
echo "== mypy (ran beside pytest)"; cat "$MYPY_LOG"
[ "$MYPY_RC" = 0 ] || echo "mypy failed (exit $MYPY_RC)" >&2
[ "$PYTEST_RC" = 0 ] || exit "$PYTEST_RC"
exit "$MYPY_RC"
