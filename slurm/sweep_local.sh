#!/bin/bash
# The page's sweep at small scale on this machine's CPU: tasks are local processes (torchrun), every part on
# the CPU, gloo. It shows the method and the report on a laptop or CI machine; it is not a GPU result.
#     slurm/sweep_local.sh [results.jsonl]        (make sweep: this, then slurm/report.py)
# PARTS "devices" in all = tasks x nb_part; the global batch is the same for every split (batch per part x PARTS).
# (On a cluster the sweep is slurm/sweep_4gpus.slurm: every task count a step of one allocation.)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
RESULTS=${1:-report/cpu_sweep.jsonl}
PARTS=${PARTS:-4}
TASKS=${TASKS:-"1 2 4"}
BATCH_PER_PART=${BATCH_PER_PART:-"8 16"}
CHUNKS=${CHUNKS:-"1 2 4 8"}
SYNTHETIC=${SYNTHETIC:-2000}
# the page's memory techniques as dimensions, as in slurm/sweep_steps.sh (on the CPU: bf16, or fp16 with a
# GradScaler), e.g.  PRECISIONS="fp32 bf16" CHECKPOINTING="off on" ZERO="off on" slurm/sweep_local.sh
mkdir -p "$(dirname "$RESULTS")"
launch() {  # $1 local processes (torchrun) sharing the cores
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$1" "${@:3}" > /dev/null
}
# the cluster sweep's own loop (slurm/sweep_steps.sh), with parts for GPUs
# (MODEL empty: the trainer's CPU defaults; the stage runs below take the same MODEL)
GPUS=$PARTS CORES=$(nproc) COUNTS=$TASKS BATCH_PER_GPU=$BATCH_PER_PART EPOCHS=1 WHERE="" MODEL=${MODEL-} \
  EXTRA="--synthetic $SYNTHETIC" source slurm/sweep_steps.sh
# Beyond the page: the same model and global batch on torch.distributed.pipelining, a process per part.
if [ -n "${STAGE_PP-2 4}" ] && "$PYTHON" -c "import torch.distributed.pipelining" 2>/dev/null; then
  for pp in ${STAGE_PP-2 4}; do
    for per_part in $BATCH_PER_PART; do
      batch=$(( per_part * pp ))  # per pipeline; PARTS/pp pipelines: same global batch as above
      for chunks in $CHUNKS; do
        if [ "$chunks" -lt "$pp" ] || [ $(( batch % chunks )) -ne 0 ]; then
          echo "skip: stage pp=$pp batch=$batch chunks=$chunks (1f1b wants chunks >= pp, dividing the batch)"; continue
        fi
        echo "run: stage layout pp=$pp x dp=$(( PARTS / pp )) batch=$batch chunks=$chunks"
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$PARTS" bench_stage.py \
            --pp "$pp" --schedule 1f1b --chunks "$chunks" --batch-size "$batch" --epochs 1 \
            --synthetic "$SYNTHETIC" ${MODEL-} --json-out "$RESULTS" > /dev/null 2>&1
      done
    done
  done
fi
echo "results in $RESULTS"
