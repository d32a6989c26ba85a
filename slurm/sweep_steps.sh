# The sweep's loop, sourced by sweep_4gpus.slurm and sweep_8gpus.slurm inside their one allocation (which holds
# the whole node), and by sweep_local.sh on a CPU. Each run is `launch K CORES/K bench_ddp_transformer.py ...`,
# the caller's launcher: in the templates a job step with its own srun options, so the user queues once:
#     srun --ntasks-per-node=K -n K -c CORES/K python bench_ddp_transformer.py ...
# A step gets all the job's GPUs unless it asks otherwise (man srun, --gres), so each of the K tasks owns
# GPUS/K of them, as in a job submitted with K tasks per node. Dimensions (environment, space-separated):
#   COUNTS         tasks per node (the template's list; counts the checker refuses are skipped with its reason)
#   BATCH_PER_GPU  batch per GPU; the global batch is the same for every count (per GPU x all GPUs)
#   CHUNKS         micro-batches per batch (1 = naive model parallel)
#   PRECISIONS     fp32 bf16 fp16 (--precision; V100 has no bf16: fp16, which comes with a GradScaler)
#   CHECKPOINTING  off on (--activation-checkpointing)
#   ZERO           off on (--zero; skipped for one replica, whose optimizer state has nobody to share it with)
#   MODEL          the model's arguments, for the checker (will it fit?) and the trainer (default "--nlayers 16")
#   EXTRA          the trainer's other arguments (e.g. "--data-dir $DSDIR/IMDB")
#   MODE           all (the default: every combination above), or predict: profile the node first
#                  (benchmarks/speed_profile.py, one step of the most tasks in COUNTS, to $PROFILE), rank every split
#                  that fits at the global batches BATCH_PER_GPU x GPUS by predicted samples/s (check_topology.py
#                  --advise --profile), then measure only the TOP (default 3) and the page's own configuration
#                  (nb_part 2, the trainer's defaults), REPEATS (default 3) times each, the repeats interleaved;
#                  then: python slurm/report.py $RESULTS --profile $PROFILE   (predicted against measured);
#                  PROFILE_OPTIONS: the profile's own options (e.g. --max-micro 128)
# Needs GPUS, CORES (per node) and WHERE (the checker's -C or -p, for the GPU's memory) from the template.
# Every run appends one line to $RESULTS.
RESULTS=${RESULTS:-sweep_results.jsonl}
EPOCHS=${EPOCHS:-1}
MODEL=${MODEL-"--nlayers 16"}
if [ "${MODE:-all}" = predict ]; then
  PROFILE=${PROFILE:-${RESULTS%.jsonl}.profile.json}
  most=0
  for n in $COUNTS; do [ "$n" -gt "$most" ] && most=$n; done
  echo "profile: $most task(s) -> $PROFILE"
  # shellcheck disable=SC2086
  launch "$most" $(( CORES >= most ? CORES / most : 1 )) benchmarks/speed_profile.py --out "$PROFILE" $MODEL \
    ${PROFILE_OPTIONS:-} < /dev/null || { echo "profile failed: nothing predicted"; return 1 2>/dev/null || exit 1; }
  batches=""
  for per_gpu in $BATCH_PER_GPU; do batches="$batches,$(( per_gpu * GPUS ))"; done
  # the splits to measure, a line each: tasks per node, the trainer, its arguments (the checker's own mapping)
  # shellcheck disable=SC2086
  if ! plan=$("${PYTHON:-python}" check_topology.py --advise --profile "$PROFILE" --nodes 1 --gpus-per-node "$GPUS" \
                $WHERE $MODEL --global-batch "${batches#,}" --top "${TOP:-3}" --commands); then
    echo "predict: no split fits: $plan"; return 1 2>/dev/null || exit 1
  fi
  echo "$plan" | sed 's/^/predicted best: /'
  plan="$plan
$(( GPUS >= 2 ? GPUS / 2 : 1 )) bench_ddp_transformer.py $MODEL --nb-part $(( GPUS >= 2 ? 2 : 1 ))"  # the page's own
  for rep in $(seq "${REPEATS:-3}"); do
    while read -r n script args; do
      echo "run $rep: ntasks=$n $script $args"
      # shellcheck disable=SC2086
      launch "$n" $(( CORES >= n ? CORES / n : 1 )) "$script" $args $EXTRA --epochs "$EPOCHS" \
             --json-out "$RESULTS" < /dev/null || echo "failed: ntasks=$n $script $args (see the .err file)"
    done <<< "$plan"
  done
  COUNTS=""  # the full sweep below is not run
fi
for ntasks in $COUNTS; do
  cpus=$(( CORES >= ntasks ? CORES / ntasks : 1 ))
  nb_part=$(( GPUS / ntasks ))
  step=(--nodes 1 --gpus-per-node "$GPUS" --ntasks-per-node "$ntasks" --cpus-per-task "$cpus")
  # shellcheck disable=SC2086  # MODEL, EXTRA and WHERE are lists of arguments
  if ! report=$("${PYTHON:-python}" check_topology.py "${step[@]}" $WHERE $MODEL); then
    echo "skip ntasks=$ntasks: $(echo "$report" | grep ERROR | head -1 | sed 's/^ *//')"; continue
  fi
  for per_gpu in $BATCH_PER_GPU; do
    batch=$(( per_gpu * nb_part ))  # per replica (task)
    for chunks in $CHUNKS; do
      if [ "$nb_part" -eq 1 ] && [ "$chunks" -gt 1 ]; then
        echo "skip: ntasks=$ntasks nb_part=1 chunks=$chunks (no pipeline to fill)"; continue
      fi
      for precision in ${PRECISIONS:-fp32}; do
        for ckpt in ${CHECKPOINTING:-off}; do
          for zero in ${ZERO:-off}; do
            if [ "$zero" = on ] && [ "$ntasks" -eq 1 ]; then
              echo "skip: ntasks=1 --zero (one replica: nothing to shard)"; continue
            fi
            options=()  # the page's run (fp32, no checkpointing, no ZeRO) has none
            [ "$precision" = fp32 ] || options+=(--precision "$precision")
            [ "$ckpt" = on ] && options+=(--activation-checkpointing)
            [ "$zero" = on ] && options+=(--zero)
            run=(--nb-part "$nb_part" --chunks "$chunks" --batch-size "$batch" "${options[@]}")
            # the checker knows the GPU's memory from $WHERE (-C / -p): a run that would not fit is skipped
            # shellcheck disable=SC2086
            if ! report=$("${PYTHON:-python}" check_topology.py "${step[@]}" $WHERE $MODEL "${run[@]}"); then
              echo "skip: ntasks=$ntasks ${run[*]}: $(echo "$report" | grep ERROR | head -1 | sed 's/^ *//')"
              continue
            fi
            echo "run: ntasks=$ntasks nb_part=$nb_part ${run[*]}"
            # shellcheck disable=SC2086
            launch "$ntasks" "$cpus" bench_ddp_transformer.py $MODEL $EXTRA "${run[@]}" --epochs "$EPOCHS" \
                   --json-out "$RESULTS" \
              || echo "failed: ntasks=$ntasks ${run[*]} (see the .err file)"
          done
        done
      done
    done
  done
done
