#!/usr/bin/env bash
# Multi-node launch with torchrun, one command per node (or via pdsh/your scheduler):
#   NNODES=8 MASTER_ADDR=node0 NPROC_PER_NODE=8 \
#     scripts/launch_torchrun.sh configs/flash-196b-4k-gpu.yaml --model.checkpoint /data/Step-3.5-Flash ...
# Everything after the config goes to `step35 fit` as command-line overrides.
#
# Failures and pre-emption (README "Failures, pre-emption and restarts"):
#   MAX_RESTARTS (3)       torchrun restarts all ranks this many times after a rank fails (exit != 0,
#                          e.g. 1 = an error, 76 = the hang watchdog); every start resumes from the newest
#                          complete checkpoint of the run (CKPT_PATH=auto). 0: fail at the first error.
#   SHUTDOWN_TIMEOUT (300) seconds torchrun gives the ranks after it is signalled (SIGTERM, SIGUSR1, ...)
#                          to write their pre-emption checkpoint and exit (75), before SIGKILL.
#   CKPT_PATH (auto)       `--ckpt_path` of every start: auto = resume if the run has a checkpoint.
# Rendezvous: c10d on MASTER_ADDR:MASTER_PORT (RDZV_ID names the job), so that after a failure the
# torchrun of every node restarts its ranks together (node ranks are assigned at each rendezvous).
# Stop a job by signalling torchrun (this script's process): it forwards the signal to every rank, which
# stop at the next step boundary with a checkpoint. Signalling only the ranks counts as their failure
# and torchrun restarts them (while MAX_RESTARTS lasts). If torchrun itself is SIGKILLed (OOM killer,
# kill -9), its ranks notice within a second and exit (77, no checkpoint): rerun this script to resume.
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [overrides...]}
shift
: "${NNODES:=1}" "${MASTER_ADDR:=127.0.0.1}" "${MASTER_PORT:=29500}" "${RDZV_ID:=step35}"
: "${MAX_RESTARTS:=3}" "${SHUTDOWN_TIMEOUT:=300}" "${CKPT_PATH:=auto}"
: "${NPROC_PER_NODE:=$(python - <<'PY'
import torch
print(torch.cuda.device_count() or 1)
PY
)}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RDZV_ID" \
    --max-restarts "$MAX_RESTARTS" --shutdown-timeout "$SHUTDOWN_TIMEOUT" \
    --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    -m step35 fit --config "$CONFIG" --trainer.num_nodes "$NNODES" --trainer.devices "$NPROC_PER_NODE" \
    --ckpt_path "$CKPT_PATH" "$@"
