#!/usr/bin/env bash
# The README's main job: create .venv if missing, install, then train the multilingual
# model on the built-in corpus as pp=2 x dp=2 x tp=2 on 8 CPU gloo ranks, and print a
# summary (loss and BLEU before/after, tokens/s, bubble measured vs theory, timeline).
#   scripts/demo.sh [--field value ...]    # extra flags override configs/demo.yaml
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/_setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
NPROC="${NPROC:-8}"
torchrun --standalone --nproc-per-node "$NPROC" -m trainer.train --config configs/demo.yaml "$@"
