#!/usr/bin/env bash
# The README's main job: create .venv if missing, install, then train the multilingual
# model on the built-in corpus as pp=2 x dp=2 x tp=2 on 8 CPU gloo ranks, and print a
# summary (loss and BLEU before/after, tokens/s, bubble measured vs theory, timeline).
#   scripts/demo.sh [--field value ...]    # extra flags override configs/demo.yaml
# Run again, it keeps the earlier demo run: the new one writes outputs/demo-2 (-3, ...) and says
# so, unless the flags name --output_dir, --overwrite_output_dir or --resume_from_checkpoint.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/_setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export HF_DATASETS_DISABLE_PROGRESS_BARS=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
NPROC="${NPROC:-8}"
OUT=outputs/demo  # configs/demo.yaml's output_dir
args=("$@")
named=false  # the flags say where the run goes, or that it resumes or overwrites
for a in "$@"; do
  [[ "$a" =~ ^--(output|overwrite[-_]output|resume[-_]from)[-_](dir|checkpoint)(=|$) ]] && named=true
done
holds_run() { [[ -d "$1" && -n "$(ls -A "$1" | grep -vxF .lock)" ]]; }
if [[ "$named" == false ]] && holds_run "$OUT"; then
  n=2
  while holds_run "$OUT-$n"; do n=$((n + 1)); done
  echo "scripts/demo.sh: $OUT holds an earlier demo run, kept; this run writes $OUT-$n" \
    "(--output_dir DIR to choose, --overwrite_output_dir true to replace $OUT)"
  args+=(--output_dir "$OUT-$n")
fi
torchrun --standalone --nproc-per-node "$NPROC" -m trainer.train --config configs/demo.yaml "${args[@]}"
