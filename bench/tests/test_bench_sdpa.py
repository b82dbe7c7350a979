"""The sdpa benchmark's pure parts: grids, timing plans, the mask, goal verdicts, the check, the report
(no timing is asserted)."""
import pytest
import torch

import attn_ext
import bench
import bench.bench_sdpa as sd
import bench.bench_sdpa_report as rep
import bench.bench_sdpa_transformer as tr
from bench.harness import goals


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(goals, "QUIET_WAIT_S", 0.0)
    monkeypatch.setattr(goals, "load_average", lambda: 0.1)


def test_registered_and_run_by_default():
    assert bench.BENCHMARKS["sdpa"] == "bench.bench_sdpa" and "sdpa" in bench.DEFAULT_BENCHMARKS


def test_grids():
    full, quick = sd.grid(False, {}), sd.grid(True, {})
    assert full.causal_ls == (1024, 4096, 16384) and full.mask_ls == (1024, 4096) and full.name == "full"
    assert quick.name == "quick" and max(quick.causal_ls) < sd.LARGE_L and quick.mask_ls == (1024,)
    assert quick.transformer_batch < full.transformer_batch == tr.BATCH
    assert sd.CAUSAL_GOAL_L in full.causal_ls and sd.CAUSAL_GOAL_L not in quick.causal_ls
    tiny = sd.grid(False, {sd.TINY_ENV: "1"})
    assert tiny.name == "tiny" and max(tiny.causal_ls) <= 128 and tiny.transformer_batch == tr.TINY_BATCH
    assert sd.grid(True, {sd.TINY_ENV: "0"}).name == "quick"


def test_timing_plan_and_implementations_per_length():
    small, large = sd.timing_plan(1024, False, 5), sd.timing_plan(16384, False, 5)
    assert small["repeats"] == 5 and small["warmup"] == 1 and small["min_timed_s"] > 0
    assert large == {"repeats": sd.LARGE_REPEATS, "warmup": 0, "min_warmup_s": 0.0, "min_timed_s": 0.0}
    assert sd.timing_plan(16384, False, 1)["repeats"] == 1
    assert "sdpa_full" in sd.causal_impls(4096) and "sdpa_full" not in sd.causal_impls(16384)
    assert set(sd.causal_impls(16384)) >= {"ours_causal", "sdpa_causal", "ours_full"}


def test_padding_causal_mask():
    pad = sd.padding(16, batch=4)
    assert pad.shape == (4, 16) and pad.sum(1).tolist() == [1, 2, 3, 4]  # the last entry pads 25 %
    assert not pad[:, 0].any() and pad[:, -1].all()
    mask = sd.padding_causal_mask(16, batch=4)
    assert mask.shape == (4, 1, 16, 16) and mask.dtype == torch.bool
    assert mask.any(-1).all()  # no query row without keys (SDPA would give NaN there)
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    assert torch.equal(mask, causal & ~pad[:, None, None, :])


def _row(section, length, pass_, **ms):
    return {"section": section, "L": length, "pass": pass_,
            "impls": {i: {"median_ms": t, "samples_ms": [t]} for i, t in ms.items()}}


def _full_rows(ours_causal_16k=40.0):
    rows = []
    for n in (1024, 4096, 16384):
        for p in ("fwd", "fwd+bwd"):
            rows.append(_row("causal", n, p, ours_causal=ours_causal_16k if n == 16384 else 5.0, sdpa_causal=50.0,
                             ours_full=100.0))
    for n in (1024, 4096):
        for p in ("fwd", "fwd+bwd"):
            rows.append(_row("mask", n, p, ours_mask=5.0, sdpa_mask=10.0, ours_causal_kpm=3.0))
    return rows


def test_goals_met_on_the_full_grid():
    rows = _full_rows()
    judged = sd.judge_goals(rows, sd.grid(False, {}))
    assert {g: v["verdict"] for g, v in judged.items()} == dict.fromkeys(sd.GOALS, "met")
    assert judged["causal_vs_noncausal"]["rows"] == 2 and judged["causal_vs_sdpa"]["rows"] == 6
    assert judged["mask_vs_sdpa"]["grid_note"] == ""


def test_a_failing_row_is_remeasured_once_for_both_of_its_goals():
    rows = _full_rows(ours_causal_16k=70.0)  # 1.4x SDPA and 0.7x non-causal at 16k
    calls = []

    def remeasure(row):
        calls.append((row["L"], row["pass"]))
        return _row("causal", row["L"], row["pass"], ours_causal=65.0, sdpa_causal=50.0, ours_full=100.0)

    judged = sd.judge_goals(rows, sd.grid(False, {}), remeasure)
    assert sorted(calls) == [(16384, "fwd"), (16384, "fwd+bwd")]
    assert judged["causal_vs_sdpa"]["verdict"] == "NOT met" and judged["causal_vs_sdpa"]["rows_met"] == 4
    assert judged["causal_vs_noncausal"]["verdict"] == "NOT met"
    assert judged["mask_vs_sdpa"]["verdict"] == "met"
    assert rows[4]["judged"]["causal_vs_sdpa"]["values"] == [pytest.approx(1.4), pytest.approx(1.3)]


def test_quick_grid_does_not_judge_the_16k_goal_and_says_so():
    rows = [r for r in _full_rows() if r["L"] == 1024]
    judged = sd.judge_goals(rows, sd.grid(True, {}))
    assert judged["causal_vs_noncausal"]["verdict"] == "not measured"
    assert "not judged on the quick grid" in judged["causal_vs_noncausal"]["grid_note"]
    assert "judged on the quick grid's L = S = 1,024" in judged["causal_vs_sdpa"]["grid_note"]


def test_check_passes_with_the_reference_backend_and_flags_a_wrong_or_broken_op(monkeypatch):
    error, warnings, diffs = sd.check_sdpa("reference", length=32)
    assert error is None and not warnings and set(diffs) == {"causal", "non-causal", "mask",
                                                              "is_causal + key_padding_mask"}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(attn_ext, "scaled_dot_product_attention", lambda q, k, v, backend=None, **kw: sdpa(q, k, v))
    error, warnings, _ = sd.check_sdpa("reference", length=32)  # ignores the causal rule and the masks
    assert error is None and any("causal case" in w for w in warnings) and any("mask case" in w for w in warnings)

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(attn_ext, "scaled_dot_product_attention", broken)
    error, _, _ = sd.check_sdpa("cpp", length=32)
    assert "cannot run" in error and "no kernel" in error


def _result(train):
    rows = _full_rows(ours_causal_16k=70.0)
    rows[0]["impls"]["sdpa_full"] = {"median_ms": 80.0, "samples_ms": [80.0]}
    return {"config": {"B": 4, "H": 8, "D": 64, "backend": "cpp", "repeats": 5, "large_L": sd.LARGE_L,
                       "large_repeats": sd.LARGE_REPEATS, "sdpa_noncausal_max_L": 4096, "pad_fraction": 0.25,
                       "min_timed_s": 3.0},
            "sdpa_kernels": {"causal": "flash (CPU)", "mask": "flash (CPU)"}, "rows": rows,
            "goals": sd.judge_goals(rows, sd.grid(False, {})), "transformer": train,
            "check_max_abs_diff": {"causal": 1e-6},
            "machine": {"cpu": "test cpu", "logical_cpus": 2, "torch": "x", "torch_threads": 2, "python": "3"}}


def test_report_tables_and_summary():
    train = {"config": {"d_model": 256, "nhead": 8, "layers": 4, "dim_feedforward": 1024,
                                           "dropout": 0.0, "batch": 8, "optimizer": "AdamW(lr=0.0001)"},
             "swap_report": "replaced 4 torch.nn.MultiheadAttention module(s): layers.0.self_attn",
             "rows": [{"L": 256, "check_max_rel_diff": 1e-7,
                       "impls": {"torch": {"median_ms": 100.0}, "swapped": {"median_ms": 90.0}}}]}
    result = _result(train)
    text = rep.tables(result)
    assert "| 16,384 | fwd | 70.0 | 50.0 | 1.40x | NOT met | 100.0 | 0.70x | NOT met | — | — |" in text
    assert "| 1,024 | fwd | 5 | 50.0 | 0.10x | met | 100.0 | 0.05x | — | 80.0 | 0.62x |" in text
    assert "| 1,024 | fwd+bwd | 5 | 10.0 | 0.50x | met | 3 | 0.30x |" in text
    assert "| 256 | 100.0 | 90.0 | 0.90x | 1e-07 |" in text and "replaced 4" in text and "test cpu" in text
    table, sentence = rep.summary(result)
    assert "| 16,384 | 1.40x | 1.40x | 0.70x | 0.70x | — | — |" in table
    assert "**NOT met**" in sentence and "0.90x at L=256" in sentence and "SDPA `is_causal=True`" in sentence


def test_transformer_check_compares_outputs_and_gradients():
    import copy

    reference = tr.make_model()
    same = copy.deepcopy(reference)
    x, target = tr.make_batch(8, batch=1)
    assert tr.check_swapped(reference, same, x, target) == 0.0
    with torch.no_grad():
        same.layers[0].linear1.weight.mul_(1.1)
    assert tr.check_swapped(reference, same, x, target) >= 1e-2
    assert all(p.grad is None for p in reference.parameters())


def test_transformer_part_runs_on_a_tiny_batch():
    out = tr.measure(bench.harness.BenchOptions(quick=True, repeats=1, backend="reference"), (8,), 1)
    assert out["swap_report"].startswith(f"replaced {tr.LAYERS} torch.nn.MultiheadAttention")
    (row,) = out["rows"]
    assert row["check_max_rel_diff"] <= tr.CHECK_ATOL and not out["warnings"]
    assert tr.step_ratio(row) is not None and "| 8 |" in tr.table(out)
