#!/usr/bin/env bash
# Quick GP protocol: every reference model trained for the same number of steps on ONE thread, one
# after the other, then evaluated on the first EVAL_BATCHES batches of the fixed-seed evaluation
# set (RBF and Matern-5/2). The full protocol is 100k steps and 3000 batches (docs/spec.md §6).
# Usage: [MODELS="tnpd lbanp ..."] bench/np/gp_quick.sh [STEPS] [EVAL_BATCHES] [RUNS_DIR]
# MODELS (default: all fifteen) lets two shells each take part of the list on a 2-core machine.
# Then `python -m bench.np.gp_report RUNS_DIR` writes the table (gp_quick.md).
set -euo pipefail
STEPS=${1:-5000}
EVAL_BATCHES=${2:-200}
RUNS=${3:-runs/gp-quick}
PY=${PYTHON:-python}
MODELS=${MODELS:-cmanp tnpd lbanp linear_tnp intention_np retreever cmanp_and tnp_nd lbanp_nd hypermix_np ist convnp tetnp perceiver_io transformer_ca}
export OMP_NUM_THREADS=1
# The harness runs from the clone: put its root on the path, wherever this is called from.
export PYTHONPATH="$(cd "$(dirname "$0")/../.." && pwd)${PYTHONPATH:+:${PYTHONPATH}}"
for model in $MODELS; do
  $PY -m bench train gp --model "$model" --steps "$STEPS" --out "$RUNS/$model" --log-every 100 --checkpoint-every 250
done
for model in $MODELS; do
  for kernel in rbf matern52; do
    $PY -m bench eval gp --ckpt "$RUNS/$model" --kernel "$kernel" --num-batches "$EVAL_BATCHES"
  done
done
