#!/usr/bin/env bash
# Launch the trainer on ONE node of a multi-node job (run it once on every node).
#
# Usage:
#   [NNODES=N] [NODE_RANK=R] [NPROC_PER_NODE=P] [MASTER_ADDR=host] [MASTER_PORT=port] \
#   [JOB_ID=id] [MAX_RESTARTS=k] scripts/launch_multinode.sh --config configs/X.yaml [--field value ...]
#
# Every argument is passed to `python -m trainer.train`. The nodes meet through
# torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT (a TCP store hosted by
# the node whose address is MASTER_ADDR; no etcd needed); JOB_ID must be the
# same on every node of a job and different between jobs that share the endpoint.
#
# Examples:
#   # one node, 8 GPUs (pp * dp * tp = 8)
#   NPROC_PER_NODE=8 scripts/launch_multinode.sh --config configs/tiny.yaml \
#       --tensor_parallel_size 8
#   # 4 nodes x 8 GPUs: run on each node, with the same MASTER_ADDR (node 0's address)
#   NNODES=4 NODE_RANK=$i NPROC_PER_NODE=8 MASTER_ADDR=node0 MASTER_PORT=29500 JOB_ID=run42 \
#       scripts/launch_multinode.sh --config configs/m2m100_1b_4x8.yaml \
#       --pipeline_parallel_size 4 --tensor_parallel_size 8
#   # SLURM: see scripts/slurm_example.sbatch
#
# Environment (defaults in brackets; SLURM variables are used when present):
#   NNODES          number of nodes, or "MIN:MAX" for an elastic range     [$SLURM_NNODES or 1]
#   NODE_RANK       this node's index; only used with RDZV_BACKEND=static: c10d
#                   assigns node ranks (GROUP_RANK) in join order        [$SLURM_NODEID or 0]
#   NPROC_PER_NODE  processes (GPUs) on this node                        [GPU count, or 1 without GPUs]
#   MASTER_ADDR     rendezvous host, reachable from every node           [127.0.0.1]
#   MASTER_PORT     rendezvous port (free on MASTER_ADDR)                [29500]
#   JOB_ID          rendezvous id, identical on all nodes                [$SLURM_JOB_ID or m2m100-3d]
#   MAX_RESTARTS    times torchrun restarts the WHOLE worker group after
#                   a worker fails                                       [0]
#   RDZV_BACKEND    c10d (elastic, restarts) or static (fixed NODE_RANK)  [c10d]
#   RDZV_CONF       extra --rdzv-conf, e.g. "join_timeout=900"           [join_timeout=600]
#   TORCHRUN        torchrun executable                                  [.venv/bin/torchrun if present]
#
# MAX_RESTARTS defaults to 0 (fail fast): a restarted group starts the trainer
# from the top, so restarts are only useful together with
# `--resume_from_checkpoint latest --save_steps K` (the trainer then resumes from
# the newest complete checkpoint-N/ in output_dir; with no checkpoint yet it starts
# fresh). Without that, a restart re-trains from step 0 over the same output_dir
# (the trainer logs a warning saying so).
# With MAX_RESTARTS > 0 this script exports TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# (unless set): each attempt then gets a fresh TCPStore hosted by its rank 0, so a
# restarted group never reads the dead attempt's keys, on any number of nodes
# (pytorch/pytorch#135712; see parallel/mesh.py::elastic_attempt_store for plain torchrun).
#
# Preemption: SIGTERM and SIGUSR1 make the trainer save a checkpoint at the next step
# boundary and exit 75; this script has torchrun forward SIGUSR1 (where torchrun
# supports --signals-to-handle) instead of dying on it.
#
# Placement: ranks are numbered node by node (rank = GROUP_RANK * NPROC_PER_NODE +
# LOCAL_RANK), and the mesh puts tp innermost, so choose tp <= NPROC_PER_NODE
# (the trainer refuses tp > LOCAL_WORLD_SIZE) and put pp across nodes.
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(dirname "$SCRIPT_DIR")"

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=1
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
        if [[ "${gpus:-0}" -gt 0 ]]; then
            NPROC_PER_NODE="$gpus"
        fi
    fi
fi
NNODES="${NNODES:-${SLURM_NNODES:-1}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
if [[ -z "${MASTER_ADDR:-}" && "$NNODES" != "1" ]]; then
    echo "[launch_multinode] warning: MASTER_ADDR unset with NNODES=$NNODES; using 127.0.0.1," \
        "which only works when all 'nodes' run on this machine" >&2
fi
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
JOB_ID="${JOB_ID:-${SLURM_JOB_ID:-m2m100-3d}}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
RDZV_CONF="${RDZV_CONF:-join_timeout=600}"

if [[ -z "${TORCHRUN:-}" ]]; then
    if [[ -x "$REPO_DIR/.venv/bin/torchrun" ]]; then
        TORCHRUN="$REPO_DIR/.venv/bin/torchrun"
    else
        TORCHRUN="torchrun"
    fi
fi

if [[ $# -eq 0 ]]; then
    echo "usage: $0 --config configs/X.yaml [--field value ...]   (see the header of $0)" >&2
    exit 2
fi

# Relative paths in the arguments stay relative to the caller's directory; the
# trainer package is found through PYTHONPATH when run from elsewhere (from the
# clone itself `python -m` finds it, and PYTHONPATH stays as the caller set it).
if [[ "$(pwd -P)" != "$(cd "$REPO_DIR" && pwd -P)" ]]; then
    case ":${PYTHONPATH:-}:" in
        *":$REPO_DIR:"*) ;;
        *) export PYTHONPATH="$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}" ;;
    esac
fi
if [[ "$MAX_RESTARTS" != "0" ]]; then
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
fi
echo "[launch_multinode] node ${NODE_RANK}/${NNODES}: ${NPROC_PER_NODE} procs," \
    "rendezvous ${RDZV_BACKEND} ${MASTER_ADDR}:${MASTER_PORT} id=${JOB_ID}, max_restarts=${MAX_RESTARTS}" >&2

if [[ "$RDZV_BACKEND" == "static" ]]; then
    # Fixed node ranks from NODE_RANK; node 0 hosts the store at MASTER_ADDR:MASTER_PORT.
    rdzv_args=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
else
    # c10d assigns node ranks itself (in join order), so --node-rank is not passed.
    rdzv_args=(--rdzv-backend "$RDZV_BACKEND" --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}"
               --rdzv-id "$JOB_ID" --rdzv-conf "$RDZV_CONF")
fi

# SIGUSR1 (SLURM's --signal) is forwarded to the workers, which save a checkpoint at
# the next step boundary and exit 75; torchrun's default list lacks it and would die.
signal_args=()
if "$TORCHRUN" --help 2>/dev/null | grep -q -- "--signals-to-handle"; then
    signal_args=(--signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
fi

exec "$TORCHRUN" \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    "${rdzv_args[@]}" \
    --max-restarts "$MAX_RESTARTS" \
    "${signal_args[@]}" \
    -m trainer.train "$@"
