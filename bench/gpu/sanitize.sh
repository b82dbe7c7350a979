#!/usr/bin/env bash
# compute-sanitizer over the CUDA kernels' tests, for a machine WITH a GPU (never run on the project's
# machines, which have none). Runs python_tests/test_cuda_kernels.py under each tool, which covers every
# CUDA kernel: cross-attention forward (WMMA for fp16/bf16, SIMT for fp32), its backward (Δ pre-pass,
# dK/dV, dQ), the state merge, tree attention and aggregation, Intention and batched Cholesky:
#   memcheck   out-of-bounds and misaligned accesses, leaks
#   racecheck  shared-memory data races (missing __syncthreads)
#   synccheck  invalid barrier use (divergent __syncthreads, bad __shfl masks)
#   initcheck  reads of uninitialised device memory (e.g. an output a kernel fails to write)
# Usage: bash bench/gpu/sanitize.sh [tool ...]   (default: all four); PYTHON=... to pick the interpreter.
# Exits nonzero at the first tool that reports an error. Expect each tool to slow the tests 10-100x.
set -euo pipefail
cd "$(dirname "$0")/../.."
python="${PYTHON:-.venv/bin/python}"
sanitizer="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
[[ -x "${sanitizer}" ]] || { echo "compute-sanitizer not found (part of the CUDA toolkit)"; exit 2; }
"${python}" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to sanitize')"
tools=("$@")
[[ ${#tools[@]} -gt 0 ]] || tools=(memcheck racecheck synccheck initcheck)
for tool in "${tools[@]}"; do
  echo "== compute-sanitizer --tool ${tool}"
  # The small cases only (-k): under the sanitizer every launch is serialised and instrumented.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${sanitizer}" --tool "${tool}" --error-exitcode 1 --target-processes all \
    "${python}" -m pytest python_tests/test_cuda_kernels.py -q -x -k "not 256" -p no:cacheprovider
done
echo "OK: no sanitizer errors"
