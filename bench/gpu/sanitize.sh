#!/usr/bin/env bash
# Stage "sanitize" of `make gpu-check` (or on its own): compute-sanitizer over the small cases of the GPU
# tests (python_tests/gpu with ATTN_EXT_GPU_SANITIZE=1, opcheck left out: 36 tests of the cuda backend for
# racecheck, 95 of both backends for memcheck; every kernel, fp32 and fp16, key padding with fully padded
# rows, bool and additive masks, causal; every tile config of the Triton attention
# (cross attention path), tree and Intention kernels):
#   memcheck   out-of-bounds and misaligned accesses, leaks          (backends cuda and triton)
#   racecheck  shared-memory data races (a missing __syncthreads)    (cuda: the hand-written kernels)
#   synccheck  invalid barrier use (divergent __syncthreads)         (cuda; only when asked for)
#   initcheck  reads of uninitialised device memory                  (cuda; only when asked for)
# Usage: bash bench/gpu/sanitize.sh [tool ...]   (default: memcheck racecheck; SANITIZE_TOOLS works too)
# PYTHON picks the interpreter (default python3). Each tool slows the tests 10-100x; a failing tool does not
# stop the next one (GPU_CHECK_KEEP_GOING=0 does). `make gpu-check` runs it with ATTN_EXT_TRITON_PIN=1
# (one tile config per Triton kernel: fewer compiles under the tool). SANITIZE_PROGRESS_DIR=<folder> writes
# each tool's pytest progress record there (sanitize-<tool>.progress, bench/gpu/pytest_progress.py), which
# names the tests a tool had not finished when its time ran out.
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

# Under `make gpu-check` (GPU_CHECK_STAGE_LIMIT: the stage's seconds) each tool gets an equal share of
# what is left of the stage when it starts: a slow memcheck cannot leave racecheck no time at all, and the
# time a tool leaves unused goes to the tools after it.
tool_limit() {
  local left=$1 limit
  limit=$(( (GPU_CHECK_STAGE_LIMIT - 10 - SECONDS) / left ))
  echo $(( limit < 5 ? 5 : limit ))
}
progress_dir="${SANITIZE_PROGRESS_DIR:-}"
[[ -n "$progress_dir" ]] && rm -f "$progress_dir"/sanitize-*.progress  # records of an earlier run
failed=()
tools_left=${#tools[@]}
for tool in "${tools[@]}"; do
  limit=0  # no limit outside make gpu-check
  [[ -n "${GPU_CHECK_STAGE_LIMIT:-}" ]] && limit="$(tool_limit "$tools_left")"
  tools_left=$((tools_left - 1))
  # opcheck adds tracing, not kernel launches worth instrumenting.
  selection="cuda and not opcheck"
  [[ $tool == memcheck ]] && selection="(cuda or triton) and not opcheck"
  echo "== compute-sanitizer --tool $tool, tests selected by -k '$selection'"
  started=$(date +%s)
  progress=""
  [[ -n "$progress_dir" ]] && progress="$(realpath -m "$progress_dir")/sanitize-$tool.progress"
  # -p no:benchmark: the GPU tests use no benchmark fixture (as in the tests stage of check.sh).
  ATTN_EXT_TEST_PROGRESS="$progress" timeout -k 5 "$limit" "$sanitizer" --tool "$tool" --error-exitcode 1 \
    --target-processes all "$python" -m pytest python_tests/gpu -q -x -p no:cacheprovider -p no:benchmark \
    -k "$selection"
  rc=$?
  if ((rc == 0)); then
    echo "== $tool: no error ($(($(date +%s) - started)) s)"
  elif ((rc == 124 || rc == 137)); then
    echo "== $tool: TIMED OUT after its share of $limit s (no error found before; the rest untested)"
    [[ -n "$progress" ]] && "$python" -m bench.gpu.pytest_progress "$progress"
    failed+=("$tool(timed out)")
  else
    # The next tool still runs (unless GPU_CHECK_KEEP_GOING=0): one window, as much found as it allows.
    echo "== $tool: FAILED (a sanitizer error, or a test failed under the tool; see above)"
    failed+=("$tool")
    [[ "${GPU_CHECK_KEEP_GOING:-1}" == 0 ]] && exit 1
  fi
done
if ((${#failed[@]})); then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "OK: no sanitizer errors (${tools[*]})"
