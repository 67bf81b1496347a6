#!/usr/bin/env bash
# Shared by demo.sh and test.sh: create .venv if missing and install the project.
# CPU PyTorch is installed first and pinned, so the project's `torch>=2.5` range is
# already satisfied and pip never pulls CUDA packages. Set TORCH_SPEC to choose
# another build (e.g. TORCH_SPEC="torch==2.13.0" TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu).
set -euo pipefail
EXTRAS="${1:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
STAMP=".venv/.installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  python -m pip install -q --upgrade pip
  if ! python -c "import torch" 2>/dev/null; then
    TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      python -m pip install -q "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
    else
      python -m pip install -q "$TORCH_SPEC"
    fi
  fi
  python -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
  touch "$STAMP"
fi
