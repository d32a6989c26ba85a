#!/bin/bash
# Submit the page's benchmark sweep: one job for the whole node, every task count a step inside it, so the
# queue is waited for once (not once per count).
#     slurm/submit_sweep.sh 4     # 4-GPU node: ntasks 1..4  (1 = pure model parallel, 4 = pure data parallel)
#     slurm/submit_sweep.sh 8     # 8-GPU node: ntasks 2..8
# Counts the checker refuses (GPUs not divisible by tasks) are left out with its reason, before submitting.
# Extra sbatch options go after the GPU count: slurm/submit_sweep.sh 4 --account=abc@v100
# The sweep's other dimensions (BATCH_PER_GPU, CHUNKS, PRECISIONS, CHECKPOINTING, ZERO, MODEL, EXTRA: see
# slurm/sweep_steps.sh) are read from the environment, which sbatch passes to the job.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
gpus=${1:?usage: submit_sweep.sh 4|8 [sbatch options]}
shift
case $gpus in
  4) template=$here/sweep_4gpus.slurm; cores=40; counts="1 2 3 4" ;;
  8) template=$here/sweep_8gpus.slurm; cores=24; counts="2 3 4 5 6 7 8" ;;
  *) echo "submit_sweep.sh: GPU count $gpus: use 4 (one 4-GPU node) or 8 (one 8-GPU gpu_p2 node)" >&2; exit 2 ;;
esac
runs=""
for n in ${COUNTS:-$counts}; do
  if ! report=$(python "$here/../check_topology.py" --nodes 1 --gpus-per-node "$gpus" --ntasks-per-node "$n" \
                  ${MODEL:---nlayers 16} --cpus-per-task $(( cores / n ))); then  # MODEL: sweep_steps.sh's
    echo "skip ntasks=$n: $(echo "$report" | grep ERROR | head -1 | sed 's/^ *//')"
    continue
  fi
  runs="$runs $n"
done
[ -n "$runs" ] || { echo "submit_sweep.sh: no task count left to run" >&2; exit 1; }
cd "$here/.."  # the job runs from the kit's folder: it sources slurm/sweep_steps.sh and runs the scripts there
job=$(COUNTS="${runs# }" sbatch --parsable "$@" "$template")
echo "job ${job%%;*}: ntasks${runs} on one node, one srun step per count"
