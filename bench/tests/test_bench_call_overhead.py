"""The call_overhead benchmark: its rows, the check against SDPA, the calls per sample, goal verdicts with
re-measurement, and a run on a tiny plan (no timing is asserted)."""
import json
import time

import pytest
import torch

import attn_ext
import bench
import bench.bench_call_overhead as co
from bench.harness import BenchOptions, goals
from bench.harness.timing import torch_threads


@pytest.fixture(autouse=True)
def _no_waiting_one_thread(monkeypatch):
    monkeypatch.setattr(goals, "QUIET_WAIT_S", 0.0)
    monkeypatch.setattr(goals, "load_average", lambda: 0.1)
    with torch_threads(1):  # rows at "default" threads run on one here; the 2-thread rows are dropped below
        yield


def test_registered_and_run_by_default():
    assert bench.BENCHMARKS["call_overhead"] == "bench.bench_call_overhead"
    assert "call_overhead" in bench.DEFAULT_BENCHMARKS


def test_rows_are_the_issues():
    rows = co.make_rows()
    assert [(r.shape, r.pass_, r.threads) for r in rows[:3]] == [
        ((1, 1, 1, 1, 16), "no_grad", None), ((1, 1, 1, 1, 16), "requires_grad", None),
        ((1, 1, 1, 1, 16), "fwd+bwd", None)]
    np_rows = [(r.shape, r.threads) for r in rows[3:]]
    assert np_rows == [(s, t) for s in ((1, 4, 128, 16, 64), (16, 4, 128, 50, 16), (16, 4, 128, 128, 16))
                       for t in (2, 1)]
    assert [r.goal for r in rows] == ["no_grad_overhead"] + ["grad_overhead"] * 2 + ["np_shapes"] * 6
    assert {g: limit for g, (limit, _) in co.GOALS.items()} == {"no_grad_overhead": 2.0, "grad_overhead": 2.0,
                                                                 "np_shapes": 1.0}


def test_inputs_and_implementations_follow_the_pass():
    no_grad, fwd_bwd = co.ROWS[0], co.ROWS[2]
    assert not any(t.requires_grad for t in co.make_inputs(no_grad))
    assert all(t.requires_grad for t in co.make_inputs(fwd_bwd))
    assert set(co.implementations(no_grad, "cpp")) == {"ours", "sdpa", "raw"}
    assert set(co.implementations(fwd_bwd, "cpp")) == {"ours", "sdpa"}  # the raw op has no autograd


def test_fwd_bwd_call_reaches_the_gradients():
    q, k, v = co.make_inputs(co.ROWS[2])
    co.make_calls(co.ROWS[2], "cpp", q, k, v)["ours"]()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v))


def test_check_passes_and_flags_a_wrong_op(monkeypatch):
    assert all(co.check_row(row, "cpp") <= co.CHECK_ATOL for row in co.ROWS[:4])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attn_ext, "cross_attention", lambda q, k, v, backend=None: 1.5 * sdpa(q, k, v))
    assert co.check_row(co.ROWS[2], "cpp") > 1e-2  # outputs and gradients 50 % off
    assert co.check_row(co.ROWS[3], "cpp") > 1e-2


def test_calls_per_sample_fills_a_sample_with_the_fastest_call():
    assert co.calls_per_sample({"slow": lambda: time.sleep(0.002), "fast": lambda: time.sleep(0.001)}, 0.01) <= 10
    assert co.calls_per_sample({"nothing": lambda: None}, 0.01) > 1000


def _result(index, goal, ours, sdpa=10.0, threads=1):
    return {"index": index, "label": f"row {index}", "goal": goal, "threads": threads,
            "impls": {"ours": {"median_ms": ours}, "sdpa": {"median_ms": sdpa}}}


def test_goals_re_measure_a_failing_row_once():
    rows = [_result(0, "no_grad_overhead", 15.0), _result(1, "grad_overhead", 25.0), _result(2, "grad_overhead", 5.0),
            _result(3, "np_shapes", 8.0), _result(4, "np_shapes", 10.5)]
    seen = []

    def remeasure(row):
        seen.append(row["index"])
        return {"impls": {"ours": {"median_ms": 24.0 if row["index"] == 1 else 9.5}, "sdpa": {"median_ms": 10.0}}}

    judged = co.judge_goals(rows, remeasure)
    assert seen == [1, 4]  # 2.5x fails, 1.05x is borderline; the others are clear
    assert {g: v["verdict"] for g, v in judged.items()} == {"no_grad_overhead": "met", "grad_overhead": "NOT met",
                                                            "np_shapes": "met"}
    assert rows[1]["judged"]["values"] == [pytest.approx(2.5), pytest.approx(2.4)]
    assert judged["np_shapes"]["rows_met"] == 2 and judged["grad_overhead"]["rows_met"] == 1


def test_run_on_a_tiny_plan_writes_the_report(monkeypatch, tmp_path):
    monkeypatch.setattr(co, "ROWS", tuple(co.make_rows(np_threads=(1,))))
    monkeypatch.setattr(co, "timing_plan", lambda options: co.TimingPlan(repeats=2, min_timed_s=0.0, sample_s=0.001,
                                                                          min_warmup_s=0.0))
    status = co.run(BenchOptions(quick=True, out_dir=tmp_path, repeats=1))
    assert status == 0
    assert {p.name for p in tmp_path.iterdir()} == {f"call_overhead.{ext}" for ext in ("md", "json", "png")}
    result = json.loads((tmp_path / "call_overhead.json").read_text())
    assert len(result["rows"]) == 6 and set(result["goals"]) == set(co.GOALS) and not result["warnings"]
    for row in result["rows"]:
        assert row["impls"]["ours"]["median_ms"] > 0 and row["impls"]["sdpa"]["median_ms"] > 0
        assert ("raw" in row["impls"]) == (row["pass"] == "no_grad") and row["number"] >= 1
        assert row["judged"]["verdict"] in ("met", "NOT met") and row["max_abs_diff"] <= co.CHECK_ATOL
    text = (tmp_path / "call_overhead.md").read_text()
    assert "| row | shape | pass | threads | ours µs | SDPA µs | ours / SDPA |" in text
    assert "| per-call overhead | B=1, H=1, M=1, N=1, D=16 | no_grad | 1 |" in text
    assert text.count("- Goal: ") == 3 and "logical CPUs" in text and "quick grid" in text
    table, sentence = co.summary(result)
    assert len(table.splitlines()) == 2 + 6 and "issue 29" in sentence
