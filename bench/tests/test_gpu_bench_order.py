"""The GPU benchmark's run order, its time per row and its ``--cases`` option, on the CPU: the attention
section runs on small CPU tensors with a fake clock standing in for CUDA events (``attention.cuda_time``)."""
from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from bench.gpu import attention, bench_cuda, plan, timing, warm
from bench.gpu.timing import Budget, GpuTiming, TooSlow, repeats, warm_up

GOALS = [("bf16", 128, 4096, False), ("bf16", 128, 4096, True), ("bf16", 128, 16384, False),
         ("bf16", 128, 16384, True)]


def _key(p: plan.Planned) -> tuple:
    return (p.case.dtype, p.case.d, p.case.n, p.case.causal)


def test_goal_rows_run_first_then_bf16_then_fp16_then_the_other_sections():
    order = plan.plan()
    attention_part = [_key(p) for p in order if p.section == "attention"]
    assert attention_part[:4] == GOALS
    assert {k[0] for k in attention_part[4:12]} == {"bf16"} and {k[0] for k in attention_part[12:]} == {"fp16"}
    assert [p.section for p in order[:24]] == ["attention"] * 24
    assert [p.section for p in order[24:]] == sorted((p.section for p in order[24:]),
                                                     key=list(plan.SECTIONS).index)
    # Every case once; within a priority the section's own order (smallest problems first).
    every = [f"{s}:{i}" for s, m in plan.SECTIONS.items() for i in range(len(m.cases()))]
    assert sorted(p.id for p in order) == sorted(every)
    for tier in (1, 2):
        indices = [p.index for p in order if p.section == "attention" and p.priority == tier]
        assert indices == sorted(indices)
    assert plan.planned("attention:20") == order[0]


def test_scopes_and_the_order_by_sections():
    assert [_key(p) for p in plan.plan(scope="goals")] == GOALS
    bf16 = plan.plan(scope="bf16")
    assert len(bf16) == 12 and {p.case.dtype for p in bf16} == {"bf16"} and [_key(p) for p in bf16[:4]] == GOALS
    assert plan.plan(["states", "tree"], scope="goals") == []
    by_sections = plan.plan(["tree", "attention"], order="sections")
    assert by_sections[0].section == "tree" and [_key(p) for p in by_sections if p.section == "attention"][:4] == GOALS
    assert plan.plan(["tree", "attention"])[0].section == "attention"  # priority beats the sections' order
    with pytest.raises(ValueError, match="scope"):
        plan.plan(scope="fp8")


def test_cases_option_and_its_environment_variable(monkeypatch, capsys):
    monkeypatch.delenv(bench_cuda.CASES_VARIABLE, raising=False)
    assert bench_cuda.parser().parse_args([]).cases == "all"
    monkeypatch.setenv(bench_cuda.CASES_VARIABLE, "goals")
    assert bench_cuda.parser().parse_args([]).cases == "goals"
    assert bench_cuda.parser().parse_args(["--cases", "bf16"]).cases == "bf16"
    monkeypatch.setenv(bench_cuda.CASES_VARIABLE, "everything")
    assert bench_cuda.main([]) == 2 and "GPU_BENCH_CASES='everything'" in capsys.readouterr().err
    assert bench_cuda.main(["--cases", "goals", "--sections", "states"]) == 2
    assert "nothing to measure" in capsys.readouterr().err


def test_warm_up_stops_early_on_slow_calls_and_raises_over_the_limit():
    def sampler(ms, log):
        return lambda: log.append(ms) or ms

    fast, slow, too_slow = [], [], []
    assert warm_up(sampler(10.0, fast), warmup=2, budget_s=0.25, max_call_s=1.0) == [10.0, 10.0]
    assert warm_up(sampler(600.0, slow), warmup=2, budget_s=0.25, max_call_s=1.0) == [600.0]
    with pytest.raises(TooSlow, match=r"one call took 1\.50 s, over the limit of 1 s per call"):
        warm_up(sampler(1500.0, too_slow), warmup=2, budget_s=0.25, max_call_s=1.0)
    assert too_slow == [1500.0]  # one call, not two
    assert warm_up(sampler(7.0, []), warmup=2, budget_s=0.25, max_call_s=None, number=40) == [7.0]  # 280 ms
    # Samples: as many as fit in the budget, at least 3 (a 1 s call: 3 s of samples at most).
    assert repeats(1000.0, 1, 3, 20, 0.25) == 3 and repeats(1.0, 1, 3, 20, 0.25) == 20
    assert repeats(25.0, 1, 3, 20, 0.25) == 10


def test_budget_predicts_from_the_best_rate_so_far():
    budget = Budget(deadline=math.inf, max_call_s=1.0)
    assert budget.too_slow("k", 1e15) is None  # nothing measured yet: the call is made
    budget.record("k", 1e13, 1000.0, "slow case")  # 10 TFLOP/s
    budget.record("k", 1e13, 500.0, "fast case")  # 20 TFLOP/s, the best
    budget.record("k", 1e13, 2000.0, "slower case")
    assert budget.too_slow("k", 1.9e13) is None  # 0.95 s at 20 TFLOP/s
    reason = budget.too_slow("k", 4e13)
    assert reason.startswith("predicted 2.0 s per call at 20.0 TFLOP/s") and "fast case" in reason
    assert budget.too_slow("other", 4e13) is None
    assert not budget.expired() and Budget(deadline=0.0).expired()


class FakeAttention:
    """Stands in for the GPU: CPU inputs, implementations that log their calls, and a clock at a fixed rate
    per implementation (TFLOP/s), raising TooSlow as cuda_time does."""

    RATES = {"cuda": 1.5, "triton": 300.0}

    def __init__(self, monkeypatch):
        self.calls: list[tuple[str, int]] = []
        self.n = None
        monkeypatch.setattr(attention, "make_inputs", self.make_inputs)
        monkeypatch.setattr(attention, "implementation", self.implementation)
        monkeypatch.setattr(attention, "unavailable", lambda impl, q: None)
        monkeypatch.setattr(attention, "cuda_time", self.cuda_time)

    def make_inputs(self, case, seed=0):
        self.n, self.d, self.causal = case.n, case.d, case.causal
        gen = torch.Generator().manual_seed(seed)
        return [tuple(torch.randn(1, 2, 16, 8, generator=gen) for _ in range(4))]

    def implementation(self, impl):
        def fn(q, k, v, causal):
            self.calls.append((impl, self.n))
            self.impl = impl
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

        return fn

    def cuda_time(self, fn, max_call_s=None, **_):
        fn()
        grads = isinstance(fn(), tuple)
        flops = attention.attention_flops(attention.B, attention.H, self.n, self.n, self.d,
                                          "fwd+bwd" if grads else "fwd", self.causal)
        ms = flops / (self.RATES.get(self.impl, 400.0) * 1e12) * 1e3
        if max_call_s is not None and ms > max_call_s * 1e3:
            raise TooSlow(ms / 1e3, max_call_s)
        return GpuTiming(ms, (ms,) * 3, 1.0)


def test_slow_calls_are_checked_then_left_and_predicted_ones_never_made(monkeypatch):
    fake = FakeAttention(monkeypatch)
    budget = Budget(deadline=math.inf, max_call_s=1.0)
    small, large = (attention.Case("bf16", 128, n) for n in (4096, 16384))

    def cuda_s(n, pass_):  # the fake clock's time of one cuda call
        flops = attention.attention_flops(attention.B, attention.H, n, n, 128, pass_)
        return flops / (FakeAttention.RATES["cuda"] * 1e12)

    # At 1.5 TFLOP/s the cuda forward takes 0.73 s at N=4096 (under the limit), fwd+bwd 2.57 s (over it).
    assert cuda_s(4096, "fwd") < 1.0 < cuda_s(4096, "fwd+bwd")
    rows = attention.measure(small, budget, lambda msg: None)
    by = {(r["impl"], r["pass"]): r for r in rows}
    assert by["cuda", "fwd"]["ms"] == pytest.approx(cuda_s(4096, "fwd") * 1e3)
    slow = by["cuda", "fwd+bwd"]
    assert "ms" not in slow and slow["rel_err"] < 1e-6 and slow["call_s"] == pytest.approx(cuda_s(4096, "fwd+bwd"))
    assert slow["note"] == (f"not measured: one call took {cuda_s(4096, 'fwd+bwd'):.2f} s, over the limit of 1 s per "
                            "call (its result was checked)")
    # The reference first, the goal's columns (cuDNN for context, ours) before the slow-to-compile others, the
    # opt-in TMA forward last.
    assert list(dict.fromkeys(impl for impl, _ in fake.calls)) == ["sdpa-flash", "sdpa-cudnn", "triton", "cuda",
                                                                   "sdpa-efficient", "flex", "triton-tma"]
    fake.calls.clear()
    rows += attention.measure(large, budget, lambda msg: None)
    assert ("cuda", 16384) not in fake.calls and ("triton", 16384) in fake.calls
    notes = {(r["impl"], r["pass"]): r.get("note") for r in rows if r["N"] == 16384}
    fwd_note = f"not measured: predicted {cuda_s(16384, 'fwd'):.1f} s per call at 1.5 TFLOP/s"
    assert notes["cuda", "fwd"].startswith(fwd_note)
    assert "bf16 D=128 N=4096" in notes["cuda", "fwd"] and "over the limit of 1 s per call" in notes["cuda", "fwd"]
    assert notes["cuda", "fwd+bwd"].startswith(f"not measured: predicted {cuda_s(16384, 'fwd+bwd'):.1f} s per call")
    assert notes["triton", "fwd"] is None
    text = attention.markdown(rows)
    assert "Not measured:" in text and f"- cuda bf16 D=128 N=16,384 none fwd: {fwd_note}" in text
    slow_note = f"not measured: one call took {cuda_s(4096, 'fwd+bwd'):.2f} s"
    assert f"- cuda bf16 D=128 N=4,096 none fwd+bwd: {slow_note}" in text


def test_a_case_past_the_deadline_costs_nothing(monkeypatch):
    fake = FakeAttention(monkeypatch)
    rows = attention.measure(attention.Case("bf16", 128, 16384), Budget(deadline=0.0), lambda msg: None)
    assert fake.n is None and fake.calls == []  # no inputs drawn, no call made
    assert len(rows) == len(attention.PASSES) * len(attention.IMPLS)
    assert {r["note"] for r in rows} == {"not measured: time limit of the bench stage"}


def test_run_follows_the_plan_and_tables_keep_their_reading_order(monkeypatch, tmp_path):
    ran = []

    def measure(case, budget, progress):
        ran.append((case.dtype, case.d, case.n, case.causal))
        return [{"section": "attention", "dtype": case.dtype, "D": case.d, "N": case.n, "M": case.n,
                 "causal": case.causal, "pass": p, "impl": "triton", "flops": 1.0, "tflops": 1.0, "peak_mib": 1.0}
                for p in attention.PASSES]

    monkeypatch.setattr(attention, "measure", measure)
    cases = plan.plan(["attention"], scope="bf16")
    meta = {"header": "test", "errors": []}
    rows, parts = bench_cuda.measure_all(cases, Budget(deadline=math.inf), tmp_path, meta, keep_going=False)
    assert ran == [_key(p) for p in cases] and ran[:4] == GOALS
    table = [line for line in (tmp_path / "bench.md").read_text().splitlines() if line.startswith("| bf16")]
    assert len(table) == 24 and len(rows) == 24
    # The table reads D=64 before D=128, small N first, though the D=128 goal rows ran first.
    cells = [tuple(c.strip() for c in line.split("|")[2:6]) for line in table]
    assert cells[0] == ("64", "1,024", "none", "fwd") and cells[-1] == ("128", "16,384", "causal", "fwd+bwd")
    assert cells == sorted(cells, key=lambda c: (int(c[0]), int(c[1].replace(",", "")), c[2] == "causal", c[3]))


def test_warm_up_compiles_each_distinct_triton_case_once_and_flex_per_case():
    goals = plan.plan(scope="goals")
    # N does not change what Triton compiles: two distinct sets (causal or not) for the four goal rows.
    assert [_key(p) for p in warm.distinct_compiles(goals)] == GOALS[:2]
    assert warm.stand_in(goals[2]) == attention.Case("bf16", 128, attention.WARM_N, False) == warm.stand_in(goals[0])
    bf16 = plan.plan(scope="bf16")
    assert {(p.case.d, p.case.causal) for p in warm.distinct_compiles(bf16)} == {(64, False), (64, True),
                                                                                (128, False), (128, True)}
    # Sections without a stand-in are not warmed (their calls would run at full size in every worker).
    assert [p.section for p in warm.distinct_compiles(plan.plan())] == ["attention"] * 8
    assert warm.distinct_compiles(plan.plan(["states", "tree"])) == []
    jobs = warm.plan_jobs(bf16, 16)
    flex = [j for j in jobs if j.kind == "flex"]
    triton = [j for j in jobs if j.kind == "triton"]
    # FlexAttention for the first cases, at most half the workers; the rest share the Triton compiles.
    assert [j.case_ids for j in flex] == [(p.id,) for p in bf16[:8]]
    assert [(j.share, j.shares) for j in triton] == [(i, 8) for i in range(8)]
    assert {j.case_ids for j in triton} == {tuple(p.id for p in warm.distinct_compiles(bf16))}
    # fp16 has no FlexAttention row: every worker shares the Triton compiles.
    fp16 = [p for p in plan.plan() if p.section == "attention" and p.case.dtype == "fp16"]
    assert {j.kind for j in warm.plan_jobs(fp16, 6)} == {"triton"} and len(warm.plan_jobs(fp16, 6)) == 6
    assert [j.kind for j in warm.plan_jobs(goals, 1)] == ["triton"]
    assert warm.plan_jobs(plan.plan(["tree"]), 4) == []
    assert warm.Job("triton", ("attention:20",), 1, 3).argv()[1:] == ["-m", "bench.gpu.warm", "triton", "1", "3",
                                                                       "attention:20"]
    assert warm.Job("flex", ("attention:21",)).argv()[1:] == ["-m", "bench.gpu.warm", "flex", "attention:21"]


def test_warm_up_runs_its_workers_under_one_time_limit(monkeypatch):
    started = []

    class Worker:  # a finished worker, a failed one, and one that runs past the limit
        def __init__(self, argv, env=None, **_):
            started.append((argv[3:], env))
            self.index, self.returncode, self.killed = len(started) - 1, 0, False

        def communicate(self, timeout=None):
            if self.index == 2 and not self.killed:
                raise subprocess.TimeoutExpired("worker", timeout)
            self.returncode = 1 if self.index == 1 else self.returncode
            return ("warm-up of attention:21 (triton_work) failed: boom" if self.index == 1 else "", None)

        def kill(self):
            self.killed, self.returncode = True, -9

    monkeypatch.setattr(warm.subprocess, "Popen", Worker)
    goals = plan.plan(scope="goals")
    summary = warm.warm_in_parallel(goals, jobs=3, time_limit_s=5.0)
    assert [argv for argv, _ in started] == [["triton", "0", "2", "attention:20", "attention:21"],
                                             ["triton", "1", "2", "attention:20", "attention:21"],
                                             ["flex", "attention:20"]]
    assert [env["TRITON_CACHE_AUTOTUNING"] for _, env in started[:2]] == ["0", "0"]
    assert started[2][1]["TORCHINDUCTOR_COMPILE_THREADS"] == "1" and started[2][1]["OMP_NUM_THREADS"] == "1"
    assert summary.startswith("Warm-up: the Triton compiles of 2 distinct case(s) of 4 shared by 2 process(es), "
                              "FlexAttention for 1 case(s) one process each")
    assert "1 worker(s) (flex) stopped at the 5 s limit (what they compiled is kept)" in summary
    assert "warm-up of attention:21 (triton_work) failed: boom" in summary


def test_each_warm_worker_compiles_its_share_of_every_kernels_configs(monkeypatch):
    autotuner = pytest.importorskip("triton.runtime.autotuner")
    monkeypatch.setattr(autotuner.Autotuner, "prune_configs", autotuner.Autotuner.prune_configs)  # restored after

    class Tuner:  # what Autotuner.prune_configs reads of its autotuner
        def __init__(self, n):
            self.configs, self.nargs, self.perf_model = list(range(n)), {}, None
            self.early_config_prune = lambda configs, nargs, **kwargs: configs[:-1]  # the pruning runs first

    original = autotuner.Autotuner.prune_configs
    seen = []
    for share in range(3):
        warm._keep_share_of_configs(share, 3)
        seen.append(autotuner.Autotuner.prune_configs(Tuner(8), {}))
        autotuner.Autotuner.prune_configs = original
    assert seen == [[0, 3, 6], [1, 4], [2, 5]]  # every kept config once, the pruned one (7) by nobody
    warm._keep_share_of_configs(4, 6)
    assert autotuner.Autotuner.prune_configs(Tuner(3), {}) == [0]  # fewer configs than workers: one each


def test_warm_worker_usage(capsys):
    assert warm.main([]) == 64 and "usage" in capsys.readouterr().err


def test_tuning_bench_times_each_config_for_its_budget_at_least_once():
    def bench(ms, **kw):
        calls, flushes = [], []
        result = timing.tuning_bench(lambda: calls.append(1), clock=lambda fn: fn() or ms,
                                     flush=lambda: flushes.append(1), **kw)
        return result, len(calls), len(flushes)

    # A slow config: one untimed call (its compile or load) and one timed; do_bench makes at least 8.
    assert bench(300.0) == (300.0, 2, 1)
    # A fast one: timed calls for 20 ms, each after an L2 flush.
    assert bench(2.0) == (2.0, 11, 10)
    assert bench(0.001, max_samples=5) == (0.001, 6, 5)
    assert bench(30.0, quantiles=(0.5, 0.2, 0.8))[0] == [30.0, 30.0, 30.0]
    assert timing.quantiles_of([1.0, 2.0, 3.0, 10.0], (0.5, 0.0, 1.0)) == [2.5, 1.0, 10.0]
    assert timing.quantiles_of([4.0, 1.0, 2.0]) == 2.0


def test_run_warms_the_first_cases_within_its_share_and_records_the_order(monkeypatch, tmp_path):
    warmed = {}

    def fake_warm(cases, jobs, time_limit_s):
        warmed.update(ids=[p.id for p in cases[:jobs]], limit=time_limit_s)
        return "warmed"

    def fake_measure(case, budget, progress):
        return [{"section": "attention", "dtype": case.dtype, "D": case.d, "N": case.n, "M": case.n,
                 "causal": case.causal, "pass": "fwd", "impl": "triton", "flops": 1.0, "tflops": 1.0, "peak_mib": 1.0}]

    monkeypatch.setattr(bench_cuda, "header", lambda problem: "Header.")
    monkeypatch.setattr(bench_cuda, "quick_autotuning", lambda: None)
    monkeypatch.setattr(bench_cuda.ceilings, "measure", lambda: (_ for _ in ()).throw(RuntimeError("no card")))
    monkeypatch.setattr(bench_cuda.warm, "warm_in_parallel", fake_warm)
    monkeypatch.setattr(attention, "measure", fake_measure)
    cases = plan.plan(scope="goals")
    assert bench_cuda.run(tmp_path, 100.0, cases, jobs=2, keep_going=False, scope="goals") == 0
    assert warmed["ids"] == ["attention:20", "attention:21"]
    assert 0 < warmed["limit"] <= bench_cuda.WARM_SHARE * (100.0 - bench_cuda.RESERVE_S)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["order"] == [p.id for p in cases] and set(data["case_s"]) == set(data["order"])
    assert "Cases: goals (4), the goal rows first" in data["header"] and "Ceilings not measured" in data["header"]
