#!/usr/bin/env bash
# Stage "sanitize" of `make gpu-check` (or on its own): compute-sanitizer over the small cases of the GPU
# tests (python_tests/gpu with ATTN_EXT_GPU_SANITIZE=1, opcheck left out: 26 tests of the cuda backend,
# 22 of triton; every kernel, fp32 and fp16, masks with fully padded rows):
#   memcheck   out-of-bounds and misaligned accesses, leaks          (backends cuda and triton)
#   racecheck  shared-memory data races (a missing __syncthreads)    (cuda: the hand-written kernels)
#   synccheck  invalid barrier use (divergent __syncthreads)         (cuda; only when asked for)
#   initcheck  reads of uninitialised device memory                  (cuda; only when asked for)
# Usage: bash bench/gpu/sanitize.sh [tool ...]   (default: memcheck racecheck; SANITIZE_TOOLS works too)
# PYTHON picks the interpreter (default python3). Each tool slows the tests 10-100x.
# Exit status: 0 no error; 1 a tool reported an error (or a test failed); 3 compute-sanitizer cannot run
# here (not installed, or it refuses the device, as in some sandboxed virtual machines).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
python="${PYTHON:-python3}"
sanitizer="$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
if [[ ! -x "$sanitizer" ]]; then
  echo "compute-sanitizer cannot run: not found on PATH or in \$CUDA_HOME/bin (it comes with the CUDA toolkit)"
  exit 3
fi
read -r -a tools <<<"${*:-${SANITIZE_TOOLS:-memcheck racecheck}}"
# Under the interpreter the "Triton" kernels would be numpy code on host copies: nothing to sanitize.
export TRITON_INTERPRET=0 ATTN_EXT_GPU_SANITIZE=1 ATTN_EXT_REQUIRE_GPU=1
# Without the caching allocator every tensor is its own allocation, so memcheck sees an access past a
# tensor's end instead of landing in a neighbour inside one cached block.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1

# The tool must work on this machine at all: one tiny CUDA op under it first.
if ! self_test="$("$sanitizer" --tool memcheck --error-exitcode 1 "$python" -c \
    "import torch; assert float(torch.ones(8, device='cuda').sum()) == 8" 2>&1)"; then
  echo "compute-sanitizer cannot run on this machine (a one-op torch program fails under it):"
  tail -n 5 <<<"$self_test"
  exit 3
fi

for tool in "${tools[@]}"; do
  # opcheck adds tracing, not kernel launches worth instrumenting.
  selection="cuda and not opcheck"
  [[ $tool == memcheck ]] && selection="(cuda or triton) and not opcheck"
  echo "== compute-sanitizer --tool $tool, tests selected by -k '$selection'"
  started=$(date +%s)
  "$sanitizer" --tool "$tool" --error-exitcode 1 --target-processes all \
    "$python" -m pytest python_tests/gpu -q -x -p no:cacheprovider -k "$selection" || {
      echo "== $tool: FAILED (a sanitizer error, or a test failed under the tool; see above)"
      exit 1
    }
  echo "== $tool: no error ($(($(date +%s) - started)) s)"
done
echo "OK: no sanitizer errors (${tools[*]})"
