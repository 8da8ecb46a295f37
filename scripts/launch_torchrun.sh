#!/usr/bin/env bash
# Multi-node launch with torchrun, one command per node (or via pdsh/your scheduler):
#   NNODES=8 NODE_RANK=0 MASTER_ADDR=node0 NPROC_PER_NODE=8 \
#     scripts/launch_torchrun.sh configs/flash-196b-4k-gpu.yaml --model.checkpoint /data/Step-3.5-Flash ...
# Everything after the config goes to `step35 fit` as command-line overrides.
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [overrides...]}
shift
: "${NNODES:=1}" "${NODE_RANK:=0}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}"
: "${NPROC_PER_NODE:=$(python - <<'PY'
import torch
print(torch.cuda.device_count() or 1)
PY
)}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m step35 fit --config "$CONFIG" --trainer.num_nodes "$NNODES" --trainer.devices "$NPROC_PER_NODE" "$@"
