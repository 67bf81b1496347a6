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
# The lock is compiled for one Python minor version (its header: "# Python 3.11, ..."): another
# one may lack wheels or need other pins, and would fail halfway through the install. Check the
# interpreter (or the existing .venv's) first, before anything is created.
# SKIP_PYTHON_CHECK=1 tries anyway.
LOCK_PY="$(sed -n 's/^#.*# Python \([0-9][0-9]*\.[0-9][0-9]*\),.*/\1/p' "$LOCK" | sed -n 1p)"
if [ -x .venv/bin/python ]; then CHECK_PY=.venv/bin/python; WHAT=".venv"; else CHECK_PY="$PY"; WHAT="$PY"; fi
if ! HAVE_PY="$("$CHECK_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)"; then
  echo "scripts/_setup_env.sh: no Python at PYTHON=$PY; $LOCK is locked for Python ${LOCK_PY:-?}: set PYTHON=python${LOCK_PY:-3}" >&2
  exit 2
fi
if [ -n "$LOCK_PY" ] && [ "$HAVE_PY" != "$LOCK_PY" ] && [ "${SKIP_PYTHON_CHECK:-0}" != 1 ]; then
  if [ "$WHAT" = ".venv" ]; then
    echo "scripts/_setup_env.sh: .venv has Python $HAVE_PY but $LOCK is locked for Python $LOCK_PY: remove .venv and rerun with PYTHON=python$LOCK_PY" >&2
  else
    echo "scripts/_setup_env.sh: $PY is Python $HAVE_PY but $LOCK is locked for Python $LOCK_PY: rerun with PYTHON=python$LOCK_PY (any Python $LOCK_PY interpreter)" >&2
  fi
  exit 2
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
STAMP=".venv/.installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || [ "$LOCK" -nt "$STAMP" ]; then
  # One pip unpacks and hash-checks on one core (56 s for the lock on the two-core machine): the
  # lock goes in two halves at once, and the default torch (whose dependencies the lock pins)
  # beside them with --no-deps: 24 s for all three. A TORCH_SPEC / TORCH_INDEX_URL of the user's
  # installs after, with its own dependencies (a CUDA build brings more). `pip check` below checks
  # the whole. pip byte-compiles in one process (40 s, mostly torch): compileall does it below.
  DEFAULT_TORCH="torch==2.13.0"
  NEED_TORCH=0
  python -c "import torch" 2>/dev/null || NEED_TORCH=1
  SPLIT="$(mktemp -d)"
  # Each entry (a name line and its hash lines) to one half; pip options (`--index-url`) to both.
  awk -v dir="$SPLIT" 'BEGIN { n = -1 }
    /^-/ { print > (dir "/half0.txt"); print > (dir "/half1.txt"); next }
    /^[A-Za-z0-9]/ { n++ }
    n >= 0 { print > (dir "/half" (n % 2) ".txt") }' "$LOCK"
  PIDS=()
  for half in "$SPLIT"/half*.txt; do
    python -m pip install -q --no-compile --require-hashes --no-deps -r "$half" &
    PIDS+=($!)
  done
  if [ "$NEED_TORCH" = 1 ] && [ -z "${TORCH_SPEC:-}${TORCH_INDEX_URL:-}" ]; then
    python -m pip install -q --no-compile --no-deps "$DEFAULT_TORCH" &
    PIDS+=($!)
    NEED_TORCH=0
  fi
  FAILED=0
  for pid in "${PIDS[@]}"; do wait "$pid" || FAILED=1; done
  rm -rf "$SPLIT"
  if [ "$FAILED" != 0 ]; then
    echo "scripts/_setup_env.sh: pip could not install from $LOCK (its messages are above)" >&2
    exit 1
  fi
  if [ "$NEED_TORCH" = 1 ]; then
    TORCH_SPEC="${TORCH_SPEC:-$DEFAULT_TORCH}"
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      python -m pip install -q --no-compile "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
    else
      python -m pip install -q --no-compile "$TORCH_SPEC"
    fi
  fi
  # setuptools comes from the lock (torch needs it), so the build needs no isolation.
  python -m pip install -q --no-deps --no-build-isolation -e ".${EXTRAS:+[$EXTRAS]}"
  python -m pip check
  # The packages' bytecode, in parallel (-j 0: a process per core), but not the packages' own
  # tests nor the ~550 transformers models the project never imports (a third of the sources:
  # 45 -> 23 s); what is not compiled here compiles on import, as without this step. A file that
  # does not compile (a package's Python 2 test data) is left to import-time compilation too.
  KEEP_MODELS="auto|m2m_100|nllb|nllb_moe|encoder_decoder"
  python -m compileall -q -j 0 -x "/tests/|/transformers/models/(?!($KEEP_MODELS)/)[^/]+/" \
    "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
  # The project's own bytecode too (1 s): where PYTHONDONTWRITEBYTECODE is set (this CI machine's
  # environment), nothing else writes it, and every process compiled the ~140 modules it imports
  # from source (0.15-0.2 CPU-s a process start: each rank server, served command and torchrun).
  python -m compileall -q -j 0 models parallel trainer tests scripts >/dev/null || true
  touch "$STAMP"
fi
