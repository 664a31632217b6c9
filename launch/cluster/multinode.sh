#!/usr/bin/env bash
# Start train_demo.py on THIS node of a multi-node job; run the same command on every node.
#
#   NNODES=2 NPROC_PER_NODE=8 MASTER_ADDR=node0 launch/cluster/multinode.sh --model llama3_8b --tp 8 --pp 2 --no-check
#
# The nodes meet through torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT (the
# first node to arrive hosts it; every node must be able to reach that address), so
# there is no per-node rank to set. Everything after the script name goes to
# launch/train_demo.py. See docs/multinode.md.
#
# Environment (defaults in brackets):
#   NNODES          number of nodes, or MIN:MAX for an elastic range          [1]
#   NPROC_PER_NODE  processes per node (one per GPU)                 [GPU count, else 8]
#   MASTER_ADDR     host of the rendezvous (a node of the job)               [127.0.0.1]
#   MASTER_PORT     its port                                                  [29500]
#   RDZV_ID         job id shared by the nodes (SLURM: $SLURM_JOB_ID)     [vparallel_ce_demo]
#   MAX_RESTARTS    restarts of the whole group after a worker fails          [0]
#   PYTHON          interpreter                                               [python3]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
launch="$(dirname "$here")"
repo="$(dirname "$launch")"
python="${PYTHON:-python3}"

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE="$("$python" -c 'import torch; print(torch.cuda.device_count() or 8)')"
fi

# Use this checkout's vparallel_ce even when the package is not installed.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"

exec "$python" -m torch.distributed.run \
    --nnodes "${NNODES:-1}" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "${MASTER_ADDR:-127.0.0.1}:${MASTER_PORT:-29500}" \
    --rdzv-id "${RDZV_ID:-vparallel_ce_demo}" \
    --max-restarts "${MAX_RESTARTS:-0}" \
    "$launch/train_demo.py" "$@"
