#!/usr/bin/env bash
# Compile check for the CUDA kernels on machines without a GPU: configures a throw-away build with
# the CUDA target on and torch off, builds attn_ext_cuda_kernels for sm_80 and sm_90 (or CUDA_ARCHS)
# with warnings as errors plus the host tests, runs ctest, prints timings and per-kernel register/spill usage,
# and checks the attention kernels' machine code (bench/gpu/cuda_sass.py, table in bench/out/cuda_sass.md).
#
# Exits 0 with a SKIP message when nvcc is absent, nonzero on any configure/build/test failure.
# Environment: CUDACXX (nvcc to use), JOBS (parallel build jobs, default nproc),
#              CUDA_ARCHS (CMake's CUDA architectures, default "80;90"; e.g. 75 for the T4 build),
#              KEEP_BUILD=1 (keep the build directory and print its path).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
nvcc_bin="${CUDACXX:-$(command -v nvcc || true)}"
if [[ -z "${nvcc_bin}" && -x /usr/local/cuda/bin/nvcc ]]; then
  nvcc_bin=/usr/local/cuda/bin/nvcc
fi
if [[ -z "${nvcc_bin}" ]]; then
  echo "SKIP: nvcc not found (set CUDACXX or put nvcc on PATH); CUDA compile check not run."
  exit 0
fi

build="$(mktemp -d "${TMPDIR:-/tmp}/attn_ext_cuda_check.XXXXXX")"
if [[ "${KEEP_BUILD:-0}" == "1" ]]; then
  trap 'echo "build directory kept: ${build}"' EXIT
else
  trap 'rm -rf "${build}"' EXIT
fi
jobs="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f s", b - a }'; }
# Runs a step quietly into a log; on failure shows the log's tail and exits with the step's status.
step() {
  local name="$1" log="${build}/$1.log"
  shift
  local rc=0
  "$@" >"${log}" 2>&1 || rc=$?
  if [[ ${rc} -ne 0 ]]; then
    echo "FAILED: ${name} (exit ${rc}); last lines of ${log}:"
    tail -n 60 "${log}"
    exit "${rc}"
  fi
}

echo "== attn_ext CUDA compile check: $("${nvcc_bin}" --version | tail -n 1), build dir ${build}"
t0="$(now)"
step configure cmake -S "${repo}" -B "${build}" -DCMAKE_BUILD_TYPE=Release \
  -DATTN_EXT_CUDA=ON -DATTN_EXT_TORCH=OFF -DATTN_EXT_CUDA_PTXAS_VERBOSE=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-80;90}" \
  -DCMAKE_CUDA_COMPILER="${nvcc_bin}"
t1="$(now)"
step build cmake --build "${build}" -j "${jobs}"
t2="$(now)"
ctest --test-dir "${build}" --output-on-failure
t3="$(now)"

echo "== launch plans per opt-in shared-memory limit (tile and bytes; csrc/tests/cuda_plan_limits_test.cpp)"
"${build}/attn_ext_cuda_plan_limits_tests" | grep -v "all checks passed"

echo "== register / spill usage per kernel instantiation (ptxas -v)"
awk '
  /Compiling entry function/ { match($0, /for .sm_[0-9]+./); arch = substr($0, RSTART + 5, RLENGTH - 6) }
  /Function properties for/  { name = $NF }
  /bytes spill stores/       { spill = $5 + $9 }
  /Used [0-9]+ registers/ && name != "" {
    regs = $5; n[arch]++; total++
    if (!(arch in lo) || regs < lo[arch]) lo[arch] = regs
    if (regs > hi[arch]) hi[arch] = regs
    if (spill > 0) { spilled[arch]++; bad = bad "\n  " arch " " name " spills " spill " bytes" }
    name = ""
  }
  END {
    for (a in n) printf "  %s: %d kernels, registers %d..%d, %d with spills\n", a, n[a], lo[a], hi[a], spilled[a] + 0
    if (bad != "") print "spilling kernels:" bad
    if (total == 0) print "  (no ptxas output found)"
  }' "${build}/build.log" | sort
# The full per-instantiation table (registers, spills, stack, static smem), as bench/gpu/cuda_resources.py writes it.
python3 "${repo}/bench/gpu/cuda_resources.py" --log "${build}/build.log" --out "${build}/cuda_resources.md" >/dev/null || true
sed -n '/^| kernel/,$p' "${build}/cuda_resources.md" 2>/dev/null || true
grep -iE "warning" "${build}/build.log" && { echo "unexpected warnings in the build log"; exit 1; } || true

# The attention kernels' machine code against the criteria of issue 43 (bench/gpu/cuda_sass_criteria.py):
# this build's sm_80/sm_90 objects as they are, plus an sm_90a compile of the attention sources with the
# build's own command lines. Fails on a regression and on a known gap that now holds.
t4="$(now)"
sass_rc=0
python3 "${repo}/bench/gpu/cuda_sass.py" --build-dir "${build}" --jobs "${jobs}" || sass_rc=$?
t5="$(now)"

echo "== timings: configure $(elapsed "${t0}" "${t1}"), build $(elapsed "${t1}" "${t2}") (-j ${jobs}), ctest $(elapsed "${t2}" "${t3}"), machine code $(elapsed "${t4}" "${t5}"), total $(elapsed "${t0}" "${t5}")"
if [[ ${sass_rc} -ne 0 ]]; then
  echo "FAILED: the CUDA machine-code criteria (bench/gpu/cuda_sass.py, exit ${sass_rc}); see bench/out/cuda_sass.md"
  exit "${sass_rc}"
fi
echo "OK"
