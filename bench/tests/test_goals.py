"""Goal verdicts (bench.harness.goals): "NOT met" only when a quiet re-measurement agrees."""
import pytest

from bench.harness import goals


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(goals, "QUIET_WAIT_S", 0.0)


def _quiet(monkeypatch, load):
    monkeypatch.setattr(goals, "load_average", lambda: load)
    monkeypatch.setattr(goals.os, "cpu_count", lambda: 2)


def test_a_clear_pass_is_not_remeasured():
    calls = []
    judged = goals.confirm(0.5, 1.2, False, lambda: calls.append(1) or 0.5, "x")
    assert judged["met"] is True and judged["verdict"] == "met" and not judged["remeasured"] and not calls


def test_a_failure_that_passes_on_remeasurement_is_met(monkeypatch):
    _quiet(monkeypatch, 0.5)
    judged = goals.confirm(3.0, 1.2, False, lambda: 1.0, "x")
    assert judged["values"] == [3.0, 1.0] and judged["met"] is True
    assert goals.confirmed_text(judged, lambda v: f"{v:.1f}x") == "3.0x, re-measured 1.0x, **met**"


def test_not_met_needs_two_failures_the_second_on_a_quiet_machine(monkeypatch):
    _quiet(monkeypatch, 0.5)
    assert goals.confirm(3.0, 1.2, False, lambda: 2.5, "x")["verdict"] == "NOT met"
    _quiet(monkeypatch, 3.5)  # busy: two failures are not a verdict
    judged = goals.confirm(3.0, 1.2, False, lambda: 2.5, "x")
    assert judged["met"] is None and judged["verdict"] == "not confirmed"
    assert "not confirmed" in goals.confirmed_text(judged, str) and "3.5" in goals.confirmed_text(judged, str)


def test_a_borderline_pass_is_remeasured_and_either_pass_counts(monkeypatch):
    _quiet(monkeypatch, 0.5)
    judged = goals.confirm(1020.0, 1000.0, True, lambda: 900.0, "x")
    assert judged["remeasured"] and judged["met"] is True


def test_without_a_remeasurement_a_failure_is_not_met():
    assert goals.confirm(0.5, 1.0, True, None, "x")["verdict"] == "NOT met"
    assert goals.confirm(None, 1.0, True, lambda: 2.0, "x")["verdict"] == "not measured"


def test_combined_verdicts():
    met, nm, nc = ({"verdict": v} for v in ("met", "NOT met", "not confirmed"))
    assert goals.combined([met, met]) == (True, "met")
    assert goals.combined([met, nc]) == (None, "not confirmed")
    assert goals.combined([nc, nm]) == (False, "NOT met")


def test_grid_notes_and_steps():
    assert goals.grid_note(False, "N = 1", None) == ""
    assert goals.grid_note(True, "N = 1, 2", "N = 1, 2") == ""
    assert "not judged on the quick grid" in goals.grid_note(True, "N = 1,000,000", None)
    assert "judged on the quick grid's N = 1" in goals.grid_note(True, "N = 1, 2", "N = 1")
    assert goals.max_step([1.0, 3.0, 1.5]) == (3.0, 0) and goals.max_step([1.0, None]) == (None, None)
