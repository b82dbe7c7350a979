"""The GPU test folder as ``make gpu-check`` runs it: alone, in a fresh process, and under sanitize.sh's ``-k``.

The tests and sanitize stages run ``pytest python_tests/gpu`` on its own. A module there that imports
a helper from another test folder works in the full suite, where collecting that folder first put it
on ``sys.path``, and fails to import when the GPU folder runs alone: the first GPU window lost its
sanitize stage that way. Collection needs no GPU (the tests skip at run time), so the CPU suite can
prove that the folder collects alone, that every test module in it contributes tests, and that each
of sanitize.sh's selections picks at least one test from the sanitize-sized grids.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ROOT / "python_tests" / "gpu"
SANITIZE = ROOT / "bench" / "gpu" / "sanitize.sh"


def sanitize_selections() -> list[str]:
    """The ``-k`` expressions sanitize.sh passes to pytest (its ``selection=`` assignments)."""
    return re.findall(r'selection="([^"]+)"', SANITIZE.read_text())


@pytest.fixture(scope="module")
def collections() -> dict:
    """``pytest python_tests/gpu --collect-only -q`` in fresh interpreters from the repository root, all
    at once (each spends seconds importing torch): ``None`` as the tests stage runs it, and each of
    sanitize.sh's selections with ``ATTN_EXT_GPU_SANITIZE=1`` as sanitize.sh sets it (smaller grids)."""
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("PYTEST_", "ATTN_EXT_GPU_SANITIZE", "ATTN_EXT_TEST_PROGRESS"))}
    environment["OMP_NUM_THREADS"] = "1"
    command = [sys.executable, "-m", "pytest", "python_tests/gpu", "--collect-only", "-q", "-p", "no:cacheprovider"]
    runs = {None: subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)}
    for selection in sanitize_selections():
        runs[selection] = subprocess.Popen([*command, "-k", selection], cwd=ROOT,
                                           env={**environment, "ATTN_EXT_GPU_SANITIZE": "1"},
                                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done = {}
    for key, process in runs.items():
        stdout, stderr = process.communicate(timeout=300)
        done[key] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return done


def _collected(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_gpu_folder_collects_alone_in_a_fresh_process(collections):
    done = collections[None]
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # Not a test id: pytest's own lines ("1 error", "ERROR collecting ...", a warning naming an error).
    assert not [line for line in output.splitlines() if "::" not in line and "error" in line.lower()], output
    modules = {path.name for path in GPU_TESTS.glob("test_*.py")}
    assert len(modules) >= 5  # the folder as it is: a glob that found nothing would pass the next line
    contributing = {line.split("::")[0].rsplit("/", 1)[-1] for line in _collected(done)}
    assert contributing == modules, f"test modules with no test collected: {sorted(modules - contributing)}"


def test_sanitize_sh_has_one_selection_per_tool_family():
    # memcheck covers both backends, the other tools the hand-written CUDA kernels.
    assert sanitize_selections() == ["cuda and not opcheck", "(cuda or triton) and not opcheck"]


@pytest.mark.parametrize("selection", sanitize_selections())
def test_each_sanitize_selection_selects_tests(collections, selection):
    done = collections[selection]
    assert done.returncode == 0, done.stdout + done.stderr
    selected = _collected(done)
    assert selected, f"-k '{selection}' selects no GPU test:\n{done.stdout[-2000:]}"
    assert not any("opcheck" in nodeid for nodeid in selected)
    # Every GPU test's last parameter is its backend (python_tests/gpu/_gpu.py): each named one is there.
    named = {backend for backend in ("cuda", "triton") if backend in selection}
    found = {match.group(1) for nodeid in selected for match in [re.search(r"[\[-](cuda|triton)\]$", nodeid)] if match}
    assert found == named, selected


def _cost_class():
    sys.path.insert(0, str(GPU_TESTS))
    try:
        from _order import cost_class
    finally:
        sys.path.remove(str(GPU_TESTS))
    return cost_class


def test_the_tests_stage_starts_the_longest_tests_first(collections):
    cost_class = _cost_class()
    order = _collected(collections[None])
    classes = [cost_class(nodeid) for nodeid in order]
    assert classes == sorted(classes), "the GPU tests are not collected longest first"
    assert set(classes) == {0, 1, 2, 3}
    # The fp32 Triton forward-and-backward tests first (their compiles took 15-90 s each on sm_90), the cuda
    # backend's tests (no compile) last.
    first = [nodeid for nodeid, c in zip(order, classes) if c == 0]
    assert any("test_backward_flash_rule" in n and "float32-triton" in n for n in first)
    assert all(n.endswith("triton]") and not re.search(r"float16|bfloat16", n) for n in first)
    assert all(n.endswith("cuda]") for n, c in zip(order, classes) if c == 3)
    assert cost_class("m.py::test_forward_flash_rule[x-torch.bfloat16-triton]") == 2
    config_test = "test_gpu_triton_configs.py::test_attention_config_forward_and_backward[causal-M16_N16_w2_s1]"
    assert cost_class(config_test) == 1
    assert cost_class("m.py::test_intention_backward_matches_cpu[False-triton]") == 0  # fp32 by default


def test_sanitize_runs_in_collection_order_and_only_tests_the_tests_stage_compiled_for(collections):
    full = set(_collected(collections[None]))
    for selection in sanitize_selections():
        selected = _collected(collections[selection])
        # Under compute-sanitizer the Triton kernels must come from the tests stage's compiles (the same test
        # ids: the same grids' small cases), or each would compile under the tool and eat its time.
        assert set(selected) <= full, sorted(set(selected) - full)
        # One process: the collection order, modules in their order (no reordering by cost).
        modules = [nodeid.split("::")[0] for nodeid in selected]
        assert modules == sorted(modules), selection
