#!/usr/bin/env bash
# Type-checks the CUDA torch bindings (csrc/cuda/bindings/*.cpp) on machines whose torch is a CPU
# build: they need ATen/cuda and c10/cuda headers that such a torch lacks, so those two headers are
# replaced by stubs (csrc/tests/bindings_stubs/) and the rest — ATen, the op checks, our launchers'
# headers — is the real thing. g++ -fsyntax-only: nothing is linked or run. This catches API misuse
# and typos in code that otherwise compiles only on a CUDA machine; it cannot catch what the stubs hide.
# Environment: PYTHON (interpreter with torch; default .venv/bin/python or python3), CUDA_HOME.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-}"
[[ -n "${python}" ]] || { [[ -x "${repo}/.venv/bin/python" ]] && python="${repo}/.venv/bin/python" || python=python3; }
if ! torch_includes="$("${python}" -c "from torch.utils.cpp_extension import include_paths; print(' '.join(include_paths()))" 2>/dev/null)"; then
  echo "SKIP: no torch for ${python}; bindings not checked."
  exit 0
fi
cuda_home="${CUDA_HOME:-/usr/local/cuda}"
[[ -f "${cuda_home}/include/cuda_runtime_api.h" ]] || { echo "SKIP: no CUDA headers under ${cuda_home}"; exit 0; }
# -Wmissing-declarations: a wrapper whose signature drifts from its declaration in ops.h (the one
# registration.cpp registers) would otherwise compile here and fail only at link time on a CUDA machine.
flags=(-std=c++20 -fsyntax-only -Wall -Wextra -Werror -Wno-unused-parameter -Wmissing-declarations
       -I"${repo}/csrc/tests/bindings_stubs" -I"${repo}/csrc/include" -I"${repo}/csrc" -I"${repo}/csrc/cuda"
       -I"${cuda_home}/include")
for dir in ${torch_includes}; do flags+=(-isystem "${dir}"); done
for source in "${repo}"/csrc/cuda/bindings/*.cpp; do
  echo "== ${source#"${repo}/"}"
  g++ "${flags[@]}" "${source}"
done
echo "OK: bindings type-check against torch $("${python}" -c 'import torch; print(torch.__version__)') with stubbed CUDA torch headers"
