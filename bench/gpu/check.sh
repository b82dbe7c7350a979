#!/usr/bin/env bash
# `make gpu-check`: validate attn_ext on a machine with an NVIDIA GPU, offline, with the Python, torch and
# CUDA toolkit already there (nothing is installed). User documentation: docs/gpu_check.md.
#
#   bash bench/gpu/check.sh [stage ...]        default: env build tests sanitize bench
#
# Stages (env always runs first and stops everything at once when the machine cannot run the check):
#   env       nvidia-smi answers, nvcc found, torch >= 2.4 is a CUDA build that sees the GPU, Triton,
#             pytest and hypothesis import; prints the card, its capability and the versions
#   build     python setup.py build_ext --inplace for this card's architecture only, then checks that
#             the CUDA kernels are registered and that the extension has machine code for the card
#   tests     python_tests/gpu with CUDA tensors for the cuda and triton backends (TRITON_INTERPRET=0;
#             pytest -x; a skipped GPU test counts as a failure here)
#   sanitize  compute-sanitizer memcheck (cuda, triton) and racecheck (cuda) on the small cases
#   bench     TFLOP/s of cross attention fwd and fwd+bwd vs SDPA's flash kernel, state update, tree
#             attention, state merge, Intention, Cholesky (bench/gpu/bench_cuda.py)
#   suite     optional, not in the default list: the CPU test suite (python_tests, bench/tests)
#
# Everything goes to bench/out/gpu/ (GPU_CHECK_OUT): <stage>.log, bench.md/.json, report.md (one file
# with every stage's result, rebuilt after each run from the stages recorded so far) and stages.tsv.
# Variables: PYTHON (default: .venv/bin/python if present, else python3), CUDA_HOME, MAX_JOBS,
# TORCH_CUDA_ARCH_LIST (default: this card's capability), GPU_CHECK_DEADLINE (seconds for the whole run,
# default 570: under the 10 minutes of a lent machine's command), GPU_CHECK_BUDGET_<STAGE> (seconds per
# stage), GPU_CHECK_KEEP_GOING=1 (run the later stages after a failed tests/sanitize stage, let pytest
# report up to 25 failures and the benchmark go on past a wrong result),
# GPU_CHECK_WORKERS (pytest-xdist workers for the tests, when xdist is installed).
# Exit status: 0 all stages passed (or were skipped with a stated reason); 2 the env stage failed;
# 1 another stage failed or timed out; 64 bad usage.
# shellcheck disable=SC2329  # the body_* functions are called by name: "body_$stage"
set -uo pipefail  # no -e: a failed stage is recorded and decides what runs next
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/../.." || exit 1
out_dir="${GPU_CHECK_OUT:-bench/out/gpu}"
nvidia_smi="${GPU_CHECK_NVIDIA_SMI:-nvidia-smi}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHON
# The repository's attn_ext and bench packages, whatever the current directory of a child process.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The Triton kernels must be compiled for the GPU: under TRITON_INTERPRET=1 (which python_tests/conftest.py
# sets by default) CUDA tensors would go through the interpreter and the GPU kernels would not be tested.
export TRITON_INTERPRET=0
unset ATTN_EXT_BACKEND

STAGES_ALL=(env build tests sanitize bench suite)
declare -A BUDGET=([env]=60 [build]=240 [tests]=150 [sanitize]=120 [bench]=200 [suite]=400)

# The CUDA toolkit: $CUDA_HOME, else the first nvcc whose install has the runtime headers (an nvcc on PATH
# may be a wrapper script in /usr/local/bin, whose parent is not the toolkit).
find_cuda_home() {
  if [[ -n "${CUDA_HOME:-}" ]]; then echo "$CUDA_HOME"; return; fi
  local nvcc root
  for nvcc in "$(command -v nvcc 2>/dev/null)" /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc; do
    [[ -n "$nvcc" && -x "$nvcc" ]] || continue
    root="$(dirname "$(dirname "$(readlink -f "$nvcc")")")"
    if [[ -f "$root/include/cuda_runtime.h" ]]; then echo "$root"; return; fi
  done
}

# ------------------------------------------------------------------------------------------ stage bodies
# Each runs in its own process (`check.sh __body <stage>`) so that `timeout` can stop it with its children.

body_env() {
  local problems=()
  if ! command -v "$nvidia_smi" >/dev/null 2>&1; then
    problems+=("no NVIDIA GPU driver: '$nvidia_smi' not found (this check needs a machine with an NVIDIA GPU)")
  elif ! listing="$(timeout 30 "$nvidia_smi" -L 2>&1)" || ! grep -q "^GPU" <<<"$listing"; then
    problems+=("nvidia-smi found no usable GPU: $(head -c 300 <<<"$listing")")
  fi
  if [[ -z "$CUDA_HOME" ]]; then
    problems+=("nvcc not found (not on PATH, not in /usr/local/cuda*): the CUDA kernels cannot be built; set CUDA_HOME")
  fi
  if ! command -v "$PYTHON" >/dev/null 2>&1; then
    problems+=("PYTHON=$PYTHON is not an executable; give the interpreter that has torch: PYTHON=/path/to/python")
  fi
  if ((${#problems[@]})); then
    echo "gpu-check cannot run on this machine:" >&2
    printf '  - %s\n' "${problems[@]}" >&2
    return 2
  fi
  "$nvidia_smi" --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
    | sed 's/^/nvidia-smi: /'
  echo "cuda_home: $CUDA_HOME"
  "$PYTHON" bench/gpu/env_check.py --nvcc "$CUDA_HOME/bin/nvcc" --out "$out_dir/env.txt" || return 2
  "$nvidia_smi" --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 \
    | sed 's/^/driver: /' >>"$out_dir/env.txt"
  for tool in compute-sanitizer cuobjdump ncu; do
    echo "$tool: $(command -v "$tool" || echo 'not found (the sanitize stage needs compute-sanitizer)')"
  done
}

body_build() {
  local arch
  arch="$(sed -n 's/^arch: //p' "$out_dir/env.txt")"
  # One architecture, this card's, is all a check needs and compiles fastest.
  export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$arch}" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
  if [[ ! -f "$CUDA_HOME/include/cusparse.h" ]]; then
    # A toolkit with nvcc and cudart only lacks the CUDA library headers that torch's ATen/cuda headers
    # include; torch's wheels ship them under site-packages/nvidia/.
    local bundled
    bundled="$("$PYTHON" -c 'import glob, os, torch
root = os.path.dirname(os.path.dirname(torch.__file__))
print(":".join(sorted(glob.glob(os.path.join(root, "nvidia", "*", "include")))))')"
    echo "no cusparse.h in $CUDA_HOME/include: CPATH += $bundled"
    export CPATH="$bundled${CPATH:+:$CPATH}"
  fi
  echo "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST MAX_JOBS=$MAX_JOBS CUDA_HOME=$CUDA_HOME"
  "$PYTHON" setup.py build_ext --inplace || return 1
  "$PYTHON" bench/gpu/build_check.py --cuda-home "$CUDA_HOME"
}

pytest_workers() {
  # pytest-xdist spreads the tests (mostly Triton compiles, CPU-bound) over processes sharing the GPU.
  if "$PYTHON" -c "import xdist" 2>/dev/null; then
    local n="${GPU_CHECK_WORKERS:-$(( $(nproc) < 8 ? $(nproc) : 8 ))}"
    ((n > 1)) && echo "-n $n"
  fi
}

body_tests() {
  # ATTN_EXT_REQUIRE_GPU=1: python_tests/gpu/conftest.py turns a skipped GPU test into a failure.
  # Stop at the first wrong result, or with GPU_CHECK_KEEP_GOING=1 collect up to 25 of them in one run.
  local stop=-x
  [[ "${GPU_CHECK_KEEP_GOING:-0}" == 1 ]] && stop=--maxfail=25
  # shellcheck disable=SC2046  # the worker option is two words or none
  ATTN_EXT_REQUIRE_GPU=1 "$PYTHON" -m pytest python_tests/gpu "$stop" -q -rs -p no:cacheprovider $(pytest_workers)
}

body_sanitize() {
  CUDA_HOME="$CUDA_HOME" bash bench/gpu/sanitize.sh
}

body_bench() {
  # 15 s of the stage's limit for importing torch before the benchmark's own clock starts.
  "$PYTHON" -m bench.gpu.bench_cuda --out "$out_dir" --time-limit "$((${GPU_CHECK_STAGE_LIMIT:-200} - 15))"
}

body_suite() {
  # The CPU suite runs the Triton kernels in the interpreter on CPU tensors; the GPU tests ran in `tests`.
  # shellcheck disable=SC2046
  TRITON_INTERPRET=1 "$PYTHON" -m pytest python_tests bench/tests --ignore=python_tests/gpu -x -q -rs \
    -p no:cacheprovider $(pytest_workers)
}

# ------------------------------------------------------------------------------------------ the driver

CUDA_HOME="$(find_cuda_home)"
export CUDA_HOME
[[ -n "$CUDA_HOME" ]] && export PATH="$CUDA_HOME/bin:$PATH"

if [[ "${1:-}" == "__body" ]]; then
  "body_$2"
  exit $?
fi

stages=("$@")
((${#stages[@]})) || stages=(env build tests sanitize bench)
for stage in "${stages[@]}"; do
  if [[ ! " ${STAGES_ALL[*]} " =~ [[:space:]]${stage}[[:space:]] ]]; then
    echo "usage: bash bench/gpu/check.sh [stage ...]; stages: ${STAGES_ALL[*]} (unknown: '$stage')" >&2
    exit 64
  fi
done
[[ "${stages[0]}" == env ]] || stages=(env "${stages[@]/env/}")
mkdir -p "$out_dir"
run_started="$(date +%s)"
deadline=$((run_started + ${GPU_CHECK_DEADLINE:-570}))
if commit="$(git rev-parse --short HEAD 2>/dev/null)"; then
  git diff --quiet HEAD 2>/dev/null || commit="$commit+changes"
else
  commit="unknown (no git)"
fi
status_file="$out_dir/stages.tsv"

# Replaces the stage's row of stages.tsv: stage, status, seconds, note, finished (UTC), commit.
record() {
  local tmp="$status_file.tmp"
  { [[ -f "$status_file" ]] && grep -v "^$1	" "$status_file"; \
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$commit"; } >"$tmp"
  mv "$tmp" "$status_file"
}

# run_stage <stage>: 0 passed (or skipped with a reason), else failed.
run_stage() {
  local stage=$1 left budget started rc elapsed note=""
  left=$((deadline - $(date +%s) - 10))  # 10 s for the report
  local override="GPU_CHECK_BUDGET_${stage^^}"
  budget="${!override:-${BUDGET[$stage]}}"
  if ((left < 15)); then
    record "$stage" "NOT RUN" 0 "no time left of the ${GPU_CHECK_DEADLINE:-570} s deadline"
    echo "== $stage: not run, no time left of the deadline"
    return 1
  fi
  ((budget > left)) && budget=$left
  echo "== $stage (at most ${budget} s) ..."
  started="$(date +%s)"
  if [[ $stage == build ]]; then  # ninja's lines would bury the rest: the log has them
    GPU_CHECK_STAGE_LIMIT=$budget timeout -k 10 "$budget" bash "$self" __body "$stage" >"$out_dir/$stage.log" 2>&1
    rc=$?
    tail -n 4 "$out_dir/$stage.log"
  else
    GPU_CHECK_STAGE_LIMIT=$budget timeout -k 10 "$budget" bash "$self" __body "$stage" 2>&1 | tee "$out_dir/$stage.log"
    rc=${PIPESTATUS[0]}
  fi
  elapsed=$(($(date +%s) - started))
  if ((rc == 0)); then
    record "$stage" PASS "$elapsed" ""
  elif ((rc == 3)) && [[ $stage == sanitize ]]; then
    note="$(grep -m1 'cannot run' "$out_dir/$stage.log" || echo 'compute-sanitizer unavailable')"
    record "$stage" SKIPPED "$elapsed" "$note"
  else
    if ((rc == 124 || rc == 137)); then note="timed out after ${budget} s"
    elif [[ $stage == env ]]; then note="$(grep -m1 '^  - ' "$out_dir/$stage.log" | sed 's/^  - //')"
    else note="exit status $rc"
    fi
    record "$stage" FAIL "$elapsed" "${note:-exit status $rc}"
    if [[ $stage != env ]]; then  # env's message is already on the screen, and short
      echo "-- $stage FAILED (${note:-exit status $rc}); last lines of $out_dir/$stage.log:"
      tail -n 25 "$out_dir/$stage.log"
    fi
  fi
  echo "== $stage: $(grep "^$stage	" "$status_file" | cut -f2) in ${elapsed} s"
  [[ $(grep "^$stage	" "$status_file" | cut -f2) != FAIL ]]
}

status=0
for stage in "${stages[@]}"; do
  [[ -n "$stage" ]] || continue
  if ((status != 0)); then
    record "$stage" "NOT RUN" 0 "an earlier stage failed"
    continue
  fi
  if ! run_stage "$stage"; then
    if [[ $stage == env ]]; then status=2
    elif [[ "${GPU_CHECK_KEEP_GOING:-0}" == 1 && $stage != build ]]; then status=0; failed_any=1
    else status=1
    fi
  fi
done
((${failed_any:-0})) && ((status == 0)) && status=1

report_python="$PYTHON"
command -v "$report_python" >/dev/null 2>&1 || report_python=python3
"$report_python" bench/gpu/report.py "$out_dir" --elapsed "$(($(date +%s) - run_started))" --stages "${stages[@]}" \
  || echo "(report.py failed; the stage logs are in $out_dir)"
exit "$status"
