#!/usr/bin/env bash
# `make gpu-check`: validate attn_ext on a machine with an NVIDIA GPU, offline, with the Python, torch and
# CUDA toolkit already there (nothing is installed), in one command of at most 575 s (it is made for a lent
# machine: one command of at most 10 minutes, results brought back from $OUT only).
# User documentation: docs/gpu_check.md.
#
#   bash bench/gpu/check.sh [stage ...]        default: env build tests sanitize bench
#
# Stages, in order of value per second (env always runs first and stops everything at once when the
# machine cannot run the check):
#   env       nvidia-smi answers, nvcc found, torch >= 2.4 is a CUDA build that sees the GPU, Triton,
#             pytest and hypothesis import; prints the card, its capability and the versions
#   build     python setup.py build_ext --inplace for this card's architecture only, then checks that
#             the CUDA kernels are registered and that the extension has machine code for the card
#   tests     python_tests/gpu with CUDA tensors for the cuda and triton backends (TRITON_INTERPRET=0;
#             pytest -n 16 when pytest-xdist is there; Triton's tile configs pinned to one per kernel,
#             ATTN_EXT_TRITON_PIN=1; a skipped GPU test counts as a failure here; every test's start and
#             result recorded in tests.progress as it happens, for the report of a stopped run)
#   sanitize  compute-sanitizer memcheck (cuda, triton) and racecheck (cuda) on the small cases
#   bench     the GPU benchmarks (bench/gpu/bench_cuda.py)
#   suite     optional, not in the default list: the CPU test suite (python_tests, bench/tests)
#
# The run keeps going past a failed stage (a failed build skips the stages that need it, a failed env
# stops everything); GPU_CHECK_STOP_ON_FAILURE=1 (or GPU_CHECK_KEEP_GOING=0) stops at the first failure.
# Where things go: the working folder (GPU_CHECK_WORK, default bench/out/gpu-work) gets every file:
# <stage>.log, env.txt, stages.tsv, bench.md/.json, report.md, the pytest progress records (*.progress).
# The result folder (GPU_CHECK_OUT, else $OUT when set, else bench/out/gpu) gets three, rewritten before
# and after every stage so that a run cut off at any point brings back everything done so far: report.md,
# stages.tsv and logs.tar.gz (the whole working folder).
# Variables: PYTHON (default: .venv/bin/python if present, else python3), CUDA_HOME, MAX_JOBS,
# TORCH_CUDA_ARCH_LIST (default: this card's capability), GPU_CHECK_DEADLINE (seconds for the whole run,
# default 575), GPU_CHECK_BUDGET_<STAGE> (seconds per stage), GPU_CHECK_WORKERS (pytest-xdist workers,
# default the number of cores up to 16), GPU_CHECK_TEST_TIMEOUT (seconds per GPU test, only when
# pytest-timeout is installed; default three quarters of the tests stage's limit). GPU_CHECK_DRY_RUN=1 runs
# the stage control only, every stage replaced by a fake of a fraction of a second (no GPU needed):
# GPU_CHECK_DRY_RUN_FAIL="tests ..." makes those stages fail, GPU_CHECK_DRY_RUN_HANG="sanitize ..." makes
# them hang until their time limit.
# Exit status: 0 all stages passed (or were skipped with a stated reason); 2 the env stage failed;
# 1 another stage failed, timed out or was not run; 64 bad usage.
# shellcheck disable=SC2329  # the body_* functions are called by name: "body_$stage"
set -uo pipefail  # no -e: a failed stage is recorded and decides what runs next
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/../.." || exit 1
out_dir="${GPU_CHECK_OUT:-${OUT:-bench/out/gpu}}"
work_dir="${GPU_CHECK_WORK:-bench/out/gpu-work}"
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
# Keep going unless asked to stop; the benchmark and the tests stage read the same variable.
if [[ "${GPU_CHECK_STOP_ON_FAILURE:-0}" == 1 || "${GPU_CHECK_KEEP_GOING:-1}" == 0 ]]; then
  export GPU_CHECK_KEEP_GOING=0
else
  export GPU_CHECK_KEEP_GOING=1
fi

STAGES_ALL=(env build tests sanitize bench suite)
# Seconds per stage, sized on the H200 window of 2026-11-28 (16 cores; env 8 s, build 65 s measured; tests
# about 100 s and sanitize about 90 s expected, bench measuring until its limit): each a limit for a hang,
# not a share. The deadline for the whole run is 575 s (that window's run took 552 s under it, inside the
# 10 minutes of a lent machine's command with room for its start); a stage gets at most what is left of it,
# the bench (last) at least 170 s when every stage before it uses its whole limit.
declare -A BUDGET=([env]=20 [build]=120 [tests]=130 [sanitize]=130 [bench]=215 [suite]=400)
DEADLINE="${GPU_CHECK_DEADLINE:-575}"
# The stages that use the extension the build stage makes: not run after a failed build.
NEEDS_BUILD=" tests sanitize bench suite "

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
  "$PYTHON" bench/gpu/env_check.py --nvcc "$CUDA_HOME/bin/nvcc" --out "$work_dir/env.txt" || return 2
  "$nvidia_smi" --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 \
    | sed 's/^/driver: /' >>"$work_dir/env.txt"
  for tool in compute-sanitizer cuobjdump ncu; do
    echo "$tool: $(command -v "$tool" || echo 'not found (the sanitize stage needs compute-sanitizer)')"
  done | tee -a "$work_dir/env.txt"
}

body_build() {
  local arch
  arch="$(sed -n 's/^arch: //p' "$work_dir/env.txt")"
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

worker_count() {
  # pytest-xdist spreads the tests (mostly Triton compiles, CPU-bound) over processes sharing the GPU: one per
  # core, up to 16; 1 without pytest-xdist.
  if "$PYTHON" -c "import xdist" 2>/dev/null; then
    echo "${GPU_CHECK_WORKERS:-$(( $(nproc) < 16 ? $(nproc) : 16 ))}"
  else
    echo 1
  fi
}

pytest_workers() {
  local n
  n="$(worker_count)"
  ((n > 1)) && echo "-n $n"
}

worker_threads() {
  # CPU threads per pytest process for torch's and the BLAS's pools: the cores shared out among the workers.
  # With 16 workers of 16 OpenMP threads each on 16 cores, each parallel region of the tests' CPU references
  # waits for 16 threads to find cores that the other workers' compiles hold: the likely reason why, on the
  # H200 machine (2026-11-28), a cuda-backend test (no compile) took 2-12 s in the tests stage and 0.04-0.6 s
  # alone under compute-sanitizer.
  local n threads
  n="$(worker_count)"
  threads=$(( $(nproc) / n ))
  echo $(( threads < 1 ? 1 : threads ))
}

pytest_timeout() {
  # A per-test limit when pytest-timeout is installed (it is not required): a test running longer than
  # three quarters of the stage's limit fails with its stack trace instead of holding a worker until the
  # stage is stopped. Not less: the longest tests (fp32 Triton forward and backward, three kernels of 10-30 s
  # of compiles each, one after another) take about 50 s alone. Without the plugin the progress record still
  # names such a test as unfinished.
  if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then
    echo "--timeout=${GPU_CHECK_TEST_TIMEOUT:-$(( ${GPU_CHECK_STAGE_LIMIT:-130} * 3 / 4 ))}"
  fi
}

body_tests() {
  # ATTN_EXT_REQUIRE_GPU=1: python_tests/gpu/conftest.py turns a skipped GPU test into a failure.
  # ATTN_EXT_TRITON_PIN=1: one tile config per Triton kernel instead of autotuning 6-12 of them on every
  # new shape (each compile takes seconds); the tests check results, not speed.
  # ATTN_EXT_TEST_PROGRESS: every test's start, result and end, one line each as they happen, so that a
  # run stopped at the stage's limit (which prints no summary) still says which tests had not finished
  # (python_tests/gpu/_progress_plugin.py; read by bench/gpu/pytest_progress.py for the report).
  # -p no:benchmark: the GPU tests use no benchmark fixture, and pytest-benchmark, when installed, prints
  # a warning per xdist worker that buried the log.
  # Collect up to 25 wrong results in one run, or stop at the first with GPU_CHECK_STOP_ON_FAILURE=1.
  local stop=--maxfail=25 progress
  progress="$(realpath -m "$work_dir")/tests.progress"
  [[ "$GPU_CHECK_KEEP_GOING" == 1 ]] || stop=-x
  : >"$progress"
  local threads
  threads="$(worker_threads)"
  # shellcheck disable=SC2046  # the worker and timeout options are one or two words, or none
  OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads" \
  ATTN_EXT_REQUIRE_GPU=1 ATTN_EXT_TRITON_PIN=1 ATTN_EXT_TEST_PROGRESS="$progress" \
    "$PYTHON" -m pytest python_tests/gpu "$stop" -q -rs -p no:cacheprovider -p no:benchmark \
    $(pytest_workers) $(pytest_timeout)
}

body_sanitize() {
  # Pinned tiles: the sanitizer slows every compile and launch, one config per kernel is what fits.
  # SANITIZE_PROGRESS_DIR: one progress record per tool (sanitize-<tool>.progress), as in the tests stage.
  CUDA_HOME="$CUDA_HOME" ATTN_EXT_TRITON_PIN=1 SANITIZE_PROGRESS_DIR="$work_dir" bash bench/gpu/sanitize.sh
}

body_bench() {
  # 15 s of the stage's limit for importing torch before the benchmark's own clock starts.
  "$PYTHON" -m bench.gpu.bench_cuda --out "$work_dir" --time-limit "$((${GPU_CHECK_STAGE_LIMIT:-120} - 15))"
}

body_suite() {
  # The CPU suite runs the Triton kernels in the interpreter on CPU tensors; the GPU tests ran in `tests`.
  local threads
  threads="$(worker_threads)"
  # shellcheck disable=SC2046
  OMP_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads" TRITON_INTERPRET=1 \
    "$PYTHON" -m pytest python_tests bench/tests --ignore=python_tests/gpu -x -q -rs -p no:cacheprovider \
    $(pytest_workers)
}

# The dry run (GPU_CHECK_DRY_RUN=1): every stage a fake that prints a line and sleeps a moment, fails
# when named in GPU_CHECK_DRY_RUN_FAIL, or sleeps past any limit when named in GPU_CHECK_DRY_RUN_HANG, so
# that the deadlines, the keep-going and the packaging are tested on a machine without a GPU.
body_dry_run() {
  local stage=$1
  echo "dry run: stage $stage (no GPU used)"
  if [[ $stage == env ]]; then
    printf 'card: dry run (no GPU)\ntorch: not imported\n' >"$work_dir/env.txt"
  elif [[ $stage == bench ]]; then
    printf '# Benchmarks\n\ndry run: nothing measured\n' >"$work_dir/bench.md"
    echo '{"dry_run": true}' >"$work_dir/bench.json"
  fi
  if [[ " ${GPU_CHECK_DRY_RUN_HANG:-} " == *" $stage "* ]]; then
    echo "dry run: $stage hangs"
    sleep 100000
  fi
  sleep "${GPU_CHECK_DRY_RUN_SLEEP:-0.1}"
  if [[ " ${GPU_CHECK_DRY_RUN_FAIL:-} " == *" $stage "* ]]; then
    echo "dry run: $stage fails"
    return $([[ $stage == env ]] && echo 2 || echo 1)
  fi
}

# ------------------------------------------------------------------------------------------ the driver

if [[ "${GPU_CHECK_DRY_RUN:-0}" == 1 ]]; then
  CUDA_HOME=""
else
  CUDA_HOME="$(find_cuda_home)"
fi
export CUDA_HOME
[[ -n "$CUDA_HOME" ]] && export PATH="$CUDA_HOME/bin:$PATH"

if [[ "${1:-}" == "__body" ]]; then
  if [[ "${GPU_CHECK_DRY_RUN:-0}" == 1 ]]; then body_dry_run "$2"; else "body_$2"; fi
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
mkdir -p "$out_dir" "$work_dir"
# The result folder must hold the few files meant to come back, and nothing else.
if [[ "$(realpath "$work_dir")/" == "$(realpath "$out_dir")/"* ]]; then
  echo "GPU_CHECK_WORK ($work_dir) must not be inside the result folder ($out_dir)" >&2
  exit 64
fi
run_started="$(date +%s)"
deadline=$((run_started + DEADLINE))
if commit="$(git rev-parse --short HEAD 2>/dev/null)"; then
  git diff --quiet HEAD 2>/dev/null || commit="$commit+changes"
else
  commit="unknown (no git)"
fi
status_file="$work_dir/stages.tsv"
report_python="$PYTHON"
command -v "$report_python" >/dev/null 2>&1 || report_python=python3

# Replaces the stage's row of stages.tsv: stage, status, seconds, note, finished (UTC), commit.
record() {
  local tmp="$status_file.tmp"
  { [[ -f "$status_file" ]] && grep -v "^$1	" "$status_file"; \
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$commit"; } >"$tmp"
  mv "$tmp" "$status_file"
}

# Copies a file into the result folder under a temporary name, then renames it: a run cut off during
# the copy leaves the previous version whole.
publish() {
  cp "$1" "$out_dir/$2.part" && mv -f "$out_dir/$2.part" "$out_dir/$2"
}

# Rewrites report.md, stages.tsv and logs.tar.gz in the result folder from the working folder. A file
# over 4 MiB (a runaway log) goes into the archive as its last 4 MiB, so that the archive stays far
# under the 16 MiB a lent machine brings back.
package() {
  local quiet=$1 pack="$work_dir/.pack" file
  "$report_python" -m bench.gpu.report "$work_dir" --elapsed "$(($(date +%s) - run_started))" \
    --stages "${stages[@]}" ${quiet:+--quiet} || echo "(report.py failed; the stage logs are in $work_dir)"
  rm -rf "$pack" && mkdir -p "$pack"
  for file in "$work_dir"/*; do
    [[ -f "$file" ]] || continue
    if (($(stat -c %s "$file") > 4194304)); then
      { echo "[first $(($(stat -c %s "$file") - 4194304)) bytes cut]"; tail -c 4194304 "$file"; } >"$pack/${file##*/}"
    else
      cp "$file" "$pack/"
    fi
  done
  tar -czf "$work_dir/.logs.tar.gz" -C "$pack" . && publish "$work_dir/.logs.tar.gz" logs.tar.gz
  rm -rf "$pack" "$work_dir/.logs.tar.gz"
  [[ -f "$work_dir/report.md" ]] && publish "$work_dir/report.md" report.md
  publish "$status_file" stages.tsv
}

# run_stage <stage>: runs it under its limit and records PASS, FAIL, TIMEOUT or SKIPPED; 0 when passed
# (or skipped with a reason).
run_stage() {
  local stage=$1 left budget started rc elapsed note="" result
  left=$((deadline - $(date +%s) - 5))  # 5 s for the last report
  local override="GPU_CHECK_BUDGET_${stage^^}"
  budget="${!override:-${BUDGET[$stage]}}"
  if ((left < 1)); then
    record "$stage" "NOT RUN" 0 "no time left of the $DEADLINE s deadline"
    echo "== $stage: not run, no time left of the deadline"
    return 1
  fi
  ((budget > left)) && budget=$left
  record "$stage" RUNNING 0 "started, at most $budget s"
  package quiet
  echo "== $stage (at most ${budget} s) ..."
  started="$(date +%s)"
  # timeout signals its whole process group, so the stage's children (pytest workers) stop with it.
  if [[ $stage == build ]]; then  # ninja's lines would bury the rest: the log has them
    GPU_CHECK_STAGE_LIMIT=$budget timeout -k 5 "$budget" bash "$self" __body "$stage" >"$work_dir/$stage.log" 2>&1
    rc=$?
    tail -n 4 "$work_dir/$stage.log"
  else
    GPU_CHECK_STAGE_LIMIT=$budget timeout -k 5 "$budget" bash "$self" __body "$stage" 2>&1 | tee "$work_dir/$stage.log"
    rc=${PIPESTATUS[0]}
  fi
  elapsed=$(($(date +%s) - started))
  if ((rc == 0)); then
    result=PASS
  elif ((rc == 3)) && [[ $stage == sanitize ]]; then
    result=SKIPPED note="$(grep -m1 'cannot run' "$work_dir/$stage.log" || echo 'compute-sanitizer unavailable')"
  elif ((rc == 124 || rc == 137)); then
    result=TIMEOUT note="stopped at its limit of ${budget} s"
  else
    result=FAIL note="exit status $rc"
    [[ $stage == env ]] && note="$(grep -m1 '^  - ' "$work_dir/$stage.log" | sed 's/^  - //')"
  fi
  [[ $result == FAIL ]] && note="${note:-exit status $rc}"
  record "$stage" "$result" "$elapsed" "$note"
  if [[ $result == FAIL || $result == TIMEOUT ]] && [[ $stage != env ]]; then  # env's message is short
    echo "-- $stage $result (${note}); last lines of $work_dir/$stage.log:"
    tail -n 25 "$work_dir/$stage.log"
  fi
  echo "== $stage: $result in ${elapsed} s"
  [[ $result == PASS || $result == SKIPPED ]]
}

status=0 stopped="" build_failed=0
for stage in "${stages[@]}"; do
  [[ -n "$stage" ]] || continue
  if [[ -n "$stopped" ]]; then
    record "$stage" "NOT RUN" 0 "$stopped"
  elif ((build_failed)) && [[ $NEEDS_BUILD == *" $stage "* ]]; then
    record "$stage" "NOT RUN" 0 "needs the build, which failed"
  elif ! run_stage "$stage"; then
    if [[ $stage == env ]]; then status=2 stopped="the env stage failed: this machine cannot run the check"
    else
      status=1
      [[ $stage == build ]] && build_failed=1
      [[ $GPU_CHECK_KEEP_GOING == 1 ]] || stopped="an earlier stage failed (GPU_CHECK_STOP_ON_FAILURE=1)"
    fi
  fi
  package quiet
done

package ""
echo "results: $out_dir/report.md, $out_dir/logs.tar.gz (every file of $work_dir)"
exit "$status"
