"""The GPU tests' pinned autotuning (python_tests/gpu/_pinned_autotuning.py): under ``ATTN_EXT_TRITON_PIN=1`` on a
GPU, Triton's autotuners run their one candidate once, untimed; elsewhere nothing changes. Without a GPU here, a
stand-in for Triton's active driver receives the benchmarker."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).resolve().parents[2] / "python_tests" / "gpu"
sys.path.insert(0, str(GPU_TESTS))
import _pinned_autotuning as pinned  # noqa: E402

sys.path.remove(str(GPU_TESTS))


def test_run_once_launches_once_and_times_nothing():
    calls = []
    assert pinned.run_once(lambda: calls.append(1), quantiles=(0.5, 0.2, 0.8)) == [0.0, 0.0, 0.0]
    assert pinned.run_once(lambda: calls.append(1)) == 0.0
    assert calls == [1, 1]


def test_only_pinned_gpu_runs_get_it(monkeypatch):
    runtime = pytest.importorskip("triton.runtime")

    class Driver:  # Triton's active driver, as far as the autotuner asks it for a benchmarker
        def get_benchmarker(self):
            return "do_bench"

    stand_in = Driver()
    monkeypatch.setattr(runtime.driver, "_active", stand_in)
    monkeypatch.setattr(pinned.torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(pinned.PIN_ENV, raising=False)
    assert not pinned.untimed_when_pinned() and stand_in.get_benchmarker() == "do_bench"  # autotuned: timed
    monkeypatch.setenv(pinned.PIN_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pinned.untimed_when_pinned() and stand_in.get_benchmarker() == "do_bench"  # the interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(pinned.torch.cuda, "is_available", lambda: False)
    assert not pinned.untimed_when_pinned() and stand_in.get_benchmarker() == "do_bench"  # no GPU
    monkeypatch.setattr(pinned.torch.cuda, "is_available", lambda: True)
    assert pinned.untimed_when_pinned() and stand_in.get_benchmarker() is pinned.run_once
