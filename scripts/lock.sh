#!/usr/bin/env bash
# Refresh the hashed CPU locks from pyproject.toml's ranges (needs `uv`: pip install uv).
#   requirements/lock-cpu.txt         runtime dependencies        (scripts/demo.sh)
#   requirements/lock-cpu-extras.txt  runtime + every extra       (scripts/test.sh)
# torch is resolved as the CPU build (requirements/torch-cpu.txt) so its dependencies
# are pinned, but it is not emitted: scripts/_setup_env.sh installs it with pip.
# TORCH_FIND_LINKS: where uv reads the CPU torch wheel's metadata (default: /opt/wheels
# when it holds one, else the PyTorch CPU wheel page).
#   scripts/lock.sh [--upgrade | --upgrade-package NAME ...]   # extra args go to uv
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
UV="${UV:-uv}"
if ! command -v "$UV" >/dev/null; then
  echo "scripts/lock.sh: '$UV' not found; install it with 'pip install uv' or set UV=/path/to/uv" >&2
  exit 1
fi
if [ -z "${TORCH_FIND_LINKS:-}" ]; then
  if compgen -G "/opt/wheels/torch-*+cpu-*.whl" >/dev/null; then
    TORCH_FIND_LINKS=/opt/wheels
  else
    TORCH_FIND_LINKS=https://download.pytorch.org/whl/cpu/torch/
  fi
fi
# The Python the locks are for; the header line below names it, and scripts/_setup_env.sh reads
# it there to refuse another interpreter before installing.
LOCK_PYTHON=3.11
lock() {
  local out="$1"
  shift
  "$UV" pip compile pyproject.toml "$@" \
    --python-version "$LOCK_PYTHON" --python-platform x86_64-manylinux_2_28 \
    --override requirements/torch-cpu.txt --find-links "$TORCH_FIND_LINKS" \
    --no-emit-package torch --generate-hashes --quiet \
    --custom-compile-command "scripts/lock.sh  # Python $LOCK_PYTHON, Linux x86_64, CPU torch 2.13.0 (not emitted)" \
    -o "$out"
}
lock requirements/lock-cpu.txt "${@}"
lock requirements/lock-cpu-extras.txt --all-extras "${@}"
echo "locked: $(grep -c '^[a-z0-9]' requirements/lock-cpu.txt) runtime packages," \
  "$(grep -c '^[a-z0-9]' requirements/lock-cpu-extras.txt) with extras"
