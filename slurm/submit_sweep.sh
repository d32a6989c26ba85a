#!/bin/bash
# Submit the page's benchmark sweep: one job per task count (a job can't change its tasks per node).
#     slurm/submit_sweep.sh 4     # 4-GPU node: ntasks 1..4  (1 = pure model parallel, 4 = pure data parallel)
#     slurm/submit_sweep.sh 8     # 8-GPU node: ntasks 2..8
# Counts the checker refuses (GPUs not divisible by tasks) are skipped with its reason.
# Extra sbatch options go after the GPU count: slurm/submit_sweep.sh 4 --account=abc@v100
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
gpus=${1:?usage: submit_sweep.sh 4|8 [sbatch options]}
shift
case $gpus in
  4) template=$here/sweep_4gpus.slurm; cores=40; counts="1 2 3 4" ;;
  8) template=$here/sweep_8gpus.slurm; cores=24; counts="2 3 4 5 6 7 8" ;;
  *) echo "submit_sweep.sh: GPU count $gpus: use 4 (one 4-GPU node) or 8 (one 8-GPU gpu_p2 node)" >&2; exit 2 ;;
esac
for n in $counts; do
  cpus=$(( cores / n ))
  if ! report=$(python "$here/../check_topology.py" --nodes 1 --gpus-per-node "$gpus" --ntasks-per-node "$n" \
                  --nlayers 16 --cpus-per-task "$cpus"); then
    echo "skip ntasks=$n: $(echo "$report" | grep ERROR | head -1 | sed 's/^ *//')"
    continue
  fi
  sbatch --parsable --ntasks-per-node="$n" --cpus-per-task="$cpus" "$@" "$template" | sed "s/^/ntasks=$n: job /"
done
