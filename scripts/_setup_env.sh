#!/usr/bin/env bash
# Shared by demo.sh and test.sh: create .venv if missing and install the project from the
# hashed lock (requirements/lock-cpu.txt; with extras, requirements/lock-cpu-extras.txt,
# which holds every extra; refresh both with scripts/lock.sh).
# The lock pins torch's dependencies but not torch: CPU PyTorch is installed next by pip,
# so pip never pulls CUDA packages. Set TORCH_SPEC to choose another build
# (e.g. TORCH_SPEC="torch==2.13.0" TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu).
# Re-installs when pyproject.toml or the lock is newer than the venv's stamp.
#   scripts/_setup_env.sh [EXTRAS]    # EXTRAS: comma-separated names from pyproject.toml
set -euo pipefail
EXTRAS="${1:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOCK="requirements/lock-cpu${EXTRAS:+-extras}.txt"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
STAMP=".venv/.installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ "$LOCK" -nt "$STAMP" ]; then
  python -m pip install -q --require-hashes --no-deps -r "$LOCK"
  if ! python -c "import torch" 2>/dev/null; then
    TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      python -m pip install -q "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
    else
      python -m pip install -q "$TORCH_SPEC"
    fi
  fi
  # setuptools comes from the lock (torch needs it), so the build needs no isolation.
  python -m pip install -q --no-deps --no-build-isolation -e ".${EXTRAS:+[$EXTRAS]}"
  python -m pip check
  touch "$STAMP"
fi
