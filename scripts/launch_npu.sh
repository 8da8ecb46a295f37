#!/usr/bin/env bash
# Ascend NPU launch (run on every node): CANN environment, HCCL settings, then torchrun.
#   NNODES=12 MASTER_ADDR=node0 scripts/launch_npu.sh configs/flash-196b-4k-npu.yaml \
#       --model.checkpoint /data/Step-3.5-Flash --data.files "/data/corpus/*.jsonl"
# Restarts, pre-emption and resume: MAX_RESTARTS, SHUTDOWN_TIMEOUT, CKPT_PATH as in launch_torchrun.sh.
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [overrides...]}
shift
ASCEND_ENV=${ASCEND_ENV:-/usr/local/Ascend/ascend-toolkit/set_env.sh}
# shellcheck disable=SC1090
[ -f "$ASCEND_ENV" ] && source "$ASCEND_ENV"
export HCCL_CONNECT_TIMEOUT=${HCCL_CONNECT_TIMEOUT:-1800}     # slow first rendezvous on large jobs
# HCCL's own execution timeout: a backstop behind step35's watchdog (trainer.strategy.timeout_minutes,
# default 10 min), which ends a stuck rank first and names the phase it waited in.
export HCCL_EXEC_TIMEOUT=${HCCL_EXEC_TIMEOUT:-1800}
export HCCL_BUFFSIZE=${HCCL_BUFFSIZE:-200}                   # MB per communicator: all-to-all of 4K x 8 tokens
export PYTORCH_NPU_ALLOC_CONF=${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}
export TASK_QUEUE_ENABLE=${TASK_QUEUE_ENABLE:-2}             # asynchronous operator dispatch
export CPU_AFFINITY_CONF=${CPU_AFFINITY_CONF:-1}             # bind each rank to its NUMA-local cores
export COMBINED_ENABLE=${COMBINED_ENABLE:-1}
export NPROC_PER_NODE=${NPROC_PER_NODE:-16}
exec "$(dirname "$0")/launch_torchrun.sh" "$CONFIG" "$@"
