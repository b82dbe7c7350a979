#!/usr/bin/env bash
# The efficient-NP-transformers chapter's Table 0.5.1 at a budget that fits a 2-core machine: HyperMixNP, LinearTNP,
# PT-TETNP, TETNP and ConvNP on the chapter's 2-D GP and Sawtooth tasks (N_c = 64, N_t = 128), each trained on ONE
# thread for about the same wall time (the chapter: 4 h per model on a GPU; here the steps below, chosen from each
# model's measured step rate so that a run takes about SECONDS seconds), then scored on the first EVAL_BATCHES
# batches of 16 tasks of the fixed-seed evaluation sets. ConvNP's grid has 16 points per unit (a 2-D grid of 64
# per unit made one step take 17 s). Default sizes of the library's models (docs/models.md), not the chapter's 1M.
# Usage: [MODELS="tetnp ..."] [TASKS="sawtooth gp"] bench/np/chapter_losses.sh [SECONDS] [EVAL_BATCHES] [RUNS_DIR]
# Then `python -m bench.np.chapter_losses RUNS_DIR` writes the table (chapter_losses.md). Rerun to resume.
set -euo pipefail
SECONDS_PER_RUN=${1:-360}
EVAL_BATCHES=${2:-100}
RUNS=${3:-runs/chapter-losses}
PY=${PYTHON:-python}
MODELS=${MODELS:-tetnp linear_tnp hypermix_np pt_tetnp convnp}
TASKS=${TASKS:-sawtooth gp}
export OMP_NUM_THREADS=1
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)${PYTHONPATH:+:${PYTHONPATH}}"
# Training steps per second on one thread of the AMD EPYC machine of the notes (2-D tasks, batch 16).
declare -A RATE=([hypermix_np]=9.8 [linear_tnp]=9.5 [pt_tetnp]=1.17 [tetnp]=2.8 [convnp]=1.6)
for model in $MODELS; do
  steps=$(awk -v r="${RATE[$model]}" -v s="$SECONDS_PER_RUN" 'BEGIN { printf "%d", r * s }')
  extra=()
  [ "$model" = convnp ] && extra=(--points-per-unit 16)
  for task in $TASKS; do
    size=()
    [ "$task" = gp ] && size=(--chapter-2d)
    $PY -m bench train "$task" "${size[@]}" --model "$model" --steps "$steps" --out "$RUNS/$task-$model" \
      --log-every 100 --checkpoint-every 250 "${extra[@]}"
    $PY -m bench eval "$task" --ckpt "$RUNS/$task-$model" --num-batches "$EVAL_BATCHES"
  done
done
