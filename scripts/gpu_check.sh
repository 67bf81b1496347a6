#!/usr/bin/env bash
# The one prepared command for a session that holds a GPU (issue 34): run it as it is.
#
#     scripts/gpu_check.sh [OUT]          # OUT default outputs/gpu_check
#
# On one H100 it ends within 8 minutes (a time budget skips what would not fit, each skip one
# line) and writes benchmarks/gpu_<card>.md and .json: tests/gpu, the trainer's GPU paths
# (NLLB-MoE bf16 with async saves, evaluation and export; word-level distillation from that
# NLLB-MoE checkpoint into the tiny dense student; fp16 loss scaling; torch_compile and
# its recompiles; streaming with 2 data workers per rank; trainer.evaluate on a checkpoint and
# an export), scripts/bench.py on 418M, 1.2B and 418M m=8 (eager and compiled, against
# transformers) and scripts/bench_moe.py on CUDA in bf16 against transformers' NllbMoe. Without
# CUDA it runs its CPU parts (tests/gpu skipping, the trainer paths at 4 steps) and skips each
# GPU part with one line, in under 3 minutes; the report then goes to OUT only.
#
# Packages the device image lacks travel as wheels (docs/development.md, "A GPU session"): a
# `.whl/` folder in the checkout is installed into /tmp/site first.
set -u
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_check}
PY=${PYTHON:-python}
BUDGET_S=${GPU_CHECK_BUDGET_S:-465}  # every part ends by then (8 min less the report and start-up)
mkdir -p "$OUT"
: >"$OUT/parts.jsonl"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" HF_DATASETS_DISABLE_PROGRESS_BARS=1 \
    TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
if $PY -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    GPU=1 STEPS=20 PRECISION="--bf16 true"  # the trainer parts are mostly start-up on a GPU (30-80 s each at 40 steps)
else
    GPU=0 STEPS=4 PRECISION=""
fi
START=$(date +%s)

# part NAME KIND TIMEOUT_S COMMAND...: KIND gpu is skipped without CUDA; a part gets at most what
# is left of the budget (skipped under 20 s); each writes one JSON line to parts.jsonl and its
# output to NAME.log.
part() {
    local name=$1 kind=$2 limit=$3
    shift 3
    local now=$(($(date +%s) - START)) status rc
    local left=$((BUDGET_S - now))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$kind" = gpu ] && [ "$GPU" = 0 ]; then
        status="skipped: needs CUDA"
    elif [ "$limit" -lt 20 ]; then
        status="skipped: time budget (${now} s of ${BUDGET_S} s spent)"
    else
        local t0=$(date +%s)
        timeout "$limit" bash -c '"$@"' part "$@" >"$OUT/$name.log" 2>&1  # functions too (export -f)
        rc=$?
        status=$([ $rc = 0 ] && echo ok || echo "failed (exit $rc; $OUT/$name.log)")
        status="$status in $(($(date +%s) - t0)) s"
    fi
    echo "gpu_check: $name: $status"
    printf '{"part": "%s", "kind": "%s", "status": "%s"}\n' "$name" "$kind" "$status" >>"$OUT/parts.jsonl"
}

train() {  # train NAME CONFIG FLAGS...: one process of trainer.train into OUT/NAME
    local name=$1 config=$2
    shift 2
    $PY -m trainer.train --config "$config" --output_dir "$OUT/$name" --report_to none "$@"
}

compile_recompiles() {  # torch_compile, then run_summary.json: nothing recompiled after the first step
    train tiny_compile configs/tiny.yaml $PRECISION --torch_compile true --max_steps $((STEPS * 2)) --do_eval false \
        && $PY -c "import json, sys; c = json.load(open('$OUT/tiny_compile/run_summary.json'))['compile']; \
print(c); sys.exit(c['recompiles_after_warmup'] != 0)"
}

streaming() {  # 8 directions of sharded JSON lines, streamed by 2 data workers per rank
    if $PY -c "import sys; sys.path.insert(0, 'scripts'); import make_sharded_corpus as m; sys.exit(not m.DATA.is_dir())"; then
        $PY scripts/make_sharded_corpus.py --out "$OUT/corpus" --pairs $((GPU ? 80000 : 4000)) --directions 8 \
            --shard_pairs 5000 || return 1
        local files="$OUT/corpus/train-*.jsonl" pairs="en-de de-en en-fr fr-en de-fr fr-de en-cs cs-en"
    else  # no multi30k beside the checkout: the built-in corpus as one shard
        $PY -m tests.dist.doc_fixtures jsonl "$OUT/corpus" en de fr || return 1
        local files="$OUT/corpus/train.jsonl" pairs="en-de de-en en-fr fr-en"
    fi
    train streaming configs/tiny.yaml --dataset_name null --train_file "$files" --language_pairs $pairs \
        --streaming true --dataloader_num_workers 2 $PRECISION --max_steps $((STEPS + STEPS / 2)) --do_eval false
}

evaluate() {  # trainer.evaluate on the dense checkpoint, the NLLB-MoE checkpoint and its export
    $PY -m tests.dist.doc_fixtures flores "$OUT/flores" en de fr --pattern '{lang}.txt' || return 1
    for model in "$OUT/tiny_fp16/checkpoint-$STEPS" "$OUT/tiny_moe/checkpoint-$STEPS" "$OUT/tiny_moe_export"; do
        $PY -m trainer.evaluate --model "$model" --data_dir "$OUT/flores" --file_pattern '{lang}.txt' \
            --directions en-de de-en --max_length 16 --output_dir "$OUT/eval_$(basename "$model")" || return 1
    done
}

export -f train compile_recompiles streaming evaluate
export OUT PY GPU STEPS PRECISION
part environment cpu 60 $PY -c "import torch, transformers, platform; print(platform.python_version(), torch.__version__, \
transformers.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA')"
# The issue's measurements first (a run on a GPU skipped them all when they came last),
# then the trainer's GPU paths, then the largest cases.
for case in 418m 418m_m8; do  # one part each: a case cut by the budget leaves the others' rows
    part "bench_$case" gpu 180 $PY scripts/bench.py --skip_cpu --no_save --output "$OUT/bench_$case" \
        --gpu_cases "$case" --gpu_compile_cases "$case" --gpu_impls ours,hf,ours_compile --gpu_steps 3
done
part bench_moe_32 gpu 120 $PY scripts/bench_moe.py --device cuda --parts one --experts 32 --d_model 1024 --ffn 4096 \
    --layers 4 --batches 32x64 --steps 5 --out "$OUT/moe_32"
part tiny_compile gpu 180 compile_recompiles
part tests_gpu cpu 240 $PY -m pytest -q -p no:cacheprovider -rs tests/gpu
part tiny_moe cpu 150 train tiny_moe configs/tiny_moe.yaml $PRECISION --max_steps "$STEPS" \
    --save_steps $((STEPS / 2)) --async_save true --eval_steps $((STEPS / 2))
part tiny_moe_export cpu 60 $PY -m trainer.export --checkpoint "$OUT/tiny_moe/checkpoint-$STEPS" --output "$OUT/tiny_moe_export"
part distill cpu 90 train distill configs/tiny.yaml $PRECISION --teacher_model_name_or_path "$OUT/tiny_moe/checkpoint-$STEPS" \
    --distillation_alpha 0.5 --distillation_temperature 2 --max_steps "$STEPS" --do_eval false
part tiny_fp16 cpu 90 train tiny_fp16 configs/tiny.yaml --fp16 true --max_steps "$STEPS" --do_eval false
part evaluate cpu 150 evaluate
part streaming cpu 150 streaming
for case in 1.2b; do  # one part each: a case cut by the budget leaves the others' rows
    part "bench_$case" gpu 180 $PY scripts/bench.py --skip_cpu --no_save --output "$OUT/bench_$case" \
        --gpu_cases "$case" --gpu_compile_cases "$case" --gpu_impls ours,hf,ours_compile --gpu_steps 3
done
part bench_moe_128 gpu 120 $PY scripts/bench_moe.py --device cuda --parts one --experts 128 --d_model 512 --ffn 2048 \
    --layers 4 --batches 64x64 --steps 5 --out "$OUT/moe_128"
$PY scripts/gpu_report.py "$OUT" --seconds $(($(date +%s) - START))
