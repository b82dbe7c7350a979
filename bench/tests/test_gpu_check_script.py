"""``make gpu-check`` (bench/gpu/check.sh) on a machine that cannot run it: it must stop at once, in its
first stage, with a message naming the reason, and exit nonzero, having built and run nothing.

The machine's own GPU state does not matter: the tests point the script at a missing or a fake
``nvidia-smi`` (``GPU_CHECK_NVIDIA_SMI``) and, where they need one, at a fake CUDA toolkit, and write to a
temporary output folder. The stage control itself (deadlines, keep-going, what comes back) is tested by
its dry run in test_gpu_check_dry_run.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "check.sh"
#: Seconds a refusal may take: the shell checks are instant, the torch import a few seconds on a busy machine.
QUICK_S = 30


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    return path


def _run(tmp_path: Path, *args: str, command=None, **env: str) -> tuple[int, str, float]:
    """``(exit status, stdout and stderr, seconds)`` (the script shows each stage's output as it comes)."""
    environment = {**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out"), "GPU_CHECK_WORK": str(tmp_path / "work"),
                   "PYTHON": sys.executable, **env}
    environment.pop("GPU_CHECK_DRY_RUN", None)
    started = time.monotonic()
    done = subprocess.run(command or ["bash", str(SCRIPT), *args], cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120)
    return done.returncode, done.stdout, time.monotonic() - started


def _stages(tmp_path: Path) -> dict[str, str]:
    lines = (tmp_path / "out" / "stages.tsv").read_text().splitlines()
    return {line.split("\t")[0]: line.split("\t")[1] for line in lines}


@pytest.fixture
def fake_toolkit(tmp_path: Path) -> Path:
    """A CUDA_HOME whose nvcc only prints a version (the env stage reads nothing else of it)."""
    home = tmp_path / "cuda"
    _executable(home / "bin" / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.48'\n")
    (home / "include").mkdir()
    (home / "include" / "cuda_runtime.h").write_text("")
    return home


def test_no_nvidia_driver_stops_at_once(tmp_path):
    status, output, seconds = _run(tmp_path, GPU_CHECK_NVIDIA_SMI=str(tmp_path / "missing" / "nvidia-smi"))
    assert status == 2, output
    assert seconds < QUICK_S
    assert "gpu-check cannot run on this machine" in output
    assert "no NVIDIA GPU driver" in output and "nvidia-smi' not found" in output
    stages = _stages(tmp_path)
    assert stages == {"env": "FAIL", "build": "NOT RUN", "tests": "NOT RUN", "sanitize": "NOT RUN", "bench": "NOT RUN"}
    report = (tmp_path / "out" / "report.md").read_text()
    assert "no NVIDIA GPU driver" in report and "Not validated by this report: env, build, tests, sanitize, bench" in report
    assert not (tmp_path / "work" / "build.log").exists()  # nothing was built
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs.tar.gz", "report.md", "stages.tsv"]


def test_nvidia_smi_without_gpu_stops_at_once(tmp_path):
    smi = _executable(tmp_path / "bin" / "nvidia-smi",
                      "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
                      "exit 9\n")
    status, output, seconds = _run(tmp_path, "build", GPU_CHECK_NVIDIA_SMI=str(smi))
    assert status == 2 and seconds < QUICK_S, output
    assert "nvidia-smi found no usable GPU" in output and "could not communicate" in output
    assert _stages(tmp_path) == {"env": "FAIL", "build": "NOT RUN"}


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU build of torch (this torch would pass the check)")
def test_cpu_torch_stops_at_once(tmp_path, fake_toolkit):
    smi = _executable(tmp_path / "bin" / "nvidia-smi", "#!/bin/sh\necho 'GPU 0: A fake GPU (UUID: GPU-0)'\n")
    status, output, seconds = _run(tmp_path, "tests", GPU_CHECK_NVIDIA_SMI=str(smi), CUDA_HOME=str(fake_toolkit))
    assert status == 2 and seconds < QUICK_S, output
    assert f"torch {torch.__version__} is a CPU build" in output
    assert f"torch: {torch.__version__}" in output  # the facts are printed with the verdict
    assert _stages(tmp_path) == {"env": "FAIL", "tests": "NOT RUN"}


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_target_runs_the_script(tmp_path):
    status, output, seconds = _run(tmp_path, command=["make", "--no-print-directory", "gpu-check", "STAGES=build tests"],
                                   GPU_CHECK_NVIDIA_SMI=str(tmp_path / "missing"))
    assert status != 0 and seconds < QUICK_S
    assert "no NVIDIA GPU driver" in output
    assert _stages(tmp_path) == {"env": "FAIL", "build": "NOT RUN", "tests": "NOT RUN"}


def test_unknown_stage_is_a_usage_error(tmp_path):
    status, output, _ = _run(tmp_path, "tests", "benchmark")
    assert status == 64 and "unknown: 'benchmark'" in output
    assert not (tmp_path / "out").exists()


def test_work_folder_inside_the_result_folder_is_a_usage_error(tmp_path):
    status, output, _ = _run(tmp_path, GPU_CHECK_WORK=str(tmp_path / "out" / "work"))
    assert status == 64 and "must not be inside the result folder" in output


def test_script_parses():
    for script in (SCRIPT, SCRIPT.parent / "sanitize.sh"):
        assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0, script
