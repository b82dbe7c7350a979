# The two entry points of the README. Both set the project up in .venv on first use:
#   make bench         set-up, then `python -m bench run --quick` (the main job: 5-15 minutes on 2 cores, writes only
#                      to the git-ignored bench/out/)
#   make test          set-up, then the test suite (the library's python_tests and the harness's bench/tests)
#   make bench-update  set-up, then `python -m bench run --update-results`: the full grids (about half an
#                      hour), rewriting the committed bench/results/ and the README's summary blocks
#   make gpu-check     on a machine with an NVIDIA GPU: build, GPU tests, compute-sanitizer, GPU benchmarks,
#                      with the Python and CUDA toolkit already there and no network (no set-up, no .venv
#                      needed), within 8 minutes, report and logs into $OUT (else bench/out/gpu/);
#                      STAGES="build tests" runs some stages only; GPU_CHECK_DRY_RUN=1 runs the stage
#                      control alone on any machine (fake stages); docs/gpu_check.md
#   make sass-report   set-up, then the machine code of the attention kernels without a GPU (Triton for sm_80 and
#                      sm_90a, every kept tile config; CUDA by nvcc -cubin): registers, spills, shared memory,
#                      MMA/ldmatrix/cp.async/TMA counts, judged by issue 43's criteria; bench/out/sass_report.md.
#                      ~30 minutes cold on 2 cores (Triton; cached after: seconds) + ~1.5 (CUDA); docs/backends.md
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU wheel of torch: a bare `torch` requirement would pull a multi-GB CUDA build. Unquoted below, so
# that it may carry pip options, e.g. TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.attn_ext-installed
SOURCES := setup.py pyproject.toml $(wildcard build_support/*.py) $(shell find csrc -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null)

.PHONY: setup test bench bench-update cuda-check gpu-check sass-report clean

setup: $(STAMP)

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet $(TORCH_SPEC)
	$(PIP) install --quiet "setuptools>=77" wheel ninja "triton>=3.0"
	# --no-build-isolation: compile against the torch installed above, not a fresh download.
	$(PIP) install --quiet --no-build-isolation -e ".[dev,triton]"
	touch $@

test: setup
	$(PY) -m pytest python_tests bench/tests -q -rs

# The harness (bench/) runs from the clone, never installed: `python -m bench` from this directory.
bench: setup
	$(PY) -m bench run --quick

bench-update: setup
	$(PY) -m bench run --update-results

cuda-check:
	bash .ci/cuda_compile_check.sh

sass-report: setup
	$(PY) bench/gpu/sass_report.py

# Not `setup`: a GPU machine brings its own CUDA torch, and nothing may be downloaded. The interpreter is
# $$PYTHON when given (`make gpu-check PYTHON=/path/to/python`), else .venv/bin/python if present, else python3.
STAGES ?=
gpu-check:
	bash bench/gpu/check.sh $(STAGES)

clean:
	rm -rf build dist $(VENV) *.egg-info attn_ext/*.so attn_ext/_build_info.json attn_ext/_op_schemas.json bench/out
