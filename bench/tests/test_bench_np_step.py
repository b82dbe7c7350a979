"""The np_step benchmark: the torch twin (same outputs and gradients, its own weights), CMANP's block stack,
the workloads, goal verdicts on the step's attention, and a run on a tiny grid (no timing is asserted). The
attention recorder and replays: test_np_step_attention.py."""
import json

import pytest
import torch

import attn_ext.nn
import bench
import bench.bench_np_step as ns
from bench.bench_np_step_goals import attention_ratio, step_ratio
from attn_ext.models import MODELS, build_model
from bench.harness import BenchOptions, goals
from bench.harness.timing import torch_threads
from bench.torch_twin import CMANPBlockStack, TorchMultiheadCrossAttention, torch_twin

SMALL = {"d_model": 16, "num_layers": 1, "num_heads": 2, "ff_dim": 32, "emb_depth": 2, "num_latents": 8}
TINY = ns.Grid("tiny", 2, SMALL, min_timed_s=0.0, min_replay_s=0.0, profiled_steps=1)


@pytest.fixture(autouse=True)
def _no_waiting_one_thread(monkeypatch):
    monkeypatch.setattr(goals, "QUIET_WAIT_S", 0.0)
    monkeypatch.setattr(goals, "load_average", lambda: 0.1)
    with torch_threads(1):  # the benchmark steps on one thread; the checks need no more
        yield


def test_registered_and_every_model_is_a_workload():
    assert bench.BENCHMARKS["np_step"] == "bench.bench_np_step" and "np_step" in bench.DEFAULT_BENCHMARKS
    assert {model for _, model in ns.WORKLOADS.values()} == set(MODELS)
    # Issue 40: the goal is on the step's attention (ours / SDPA on the same calls), not on the whole step.
    assert set(ns.GOAL_KEYS) == {"tnpd", "lbanp", "cmanp"} and ns.MAX_ATTENTION_RATIO == 1.0
    assert not hasattr(ns, "MAX_RATIO")
    assert ns.FULL.batch == 16 and ns.QUICK.batch < ns.FULL.batch and not ns.FULL.overrides


def test_gp_batch_has_the_fixed_counts():
    batch = ns.gp_batch(3)
    assert batch.xc.shape == (3, ns.NUM_CONTEXT, 1) and batch.yt.shape == (3, ns.NUM_TARGET, 1)


@pytest.mark.parametrize("model", ["tnpd", "lbanp"])
def test_twin_replaces_every_attention_and_agrees(model):
    torch.manual_seed(0)
    ours = build_model(model, **SMALL)
    twin, replaced = torch_twin(ours)
    assert replaced and not any(isinstance(m, attn_ext.nn.MultiheadAttention) for m in twin.modules())
    assert sum(isinstance(m, TorchMultiheadCrossAttention) for m in twin.modules()) == len(replaced)
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in ours.named_parameters()]
    assert ns.check_twin(ours, twin, ns.gp_batch(2))[0] <= ns.CHECK_RTOL
    # Gradients in fp64, as the benchmark checks them: in fp32 a ReLU kink may flip and move one by a percent.
    loss, grads = ns.check_twin(ours.double(), twin.double(), ns.gp_batch(2, dtype=torch.float64))
    assert loss <= ns.CHECK_RTOL and grads <= ns.CHECK_RTOL
    assert all(p.grad is None for p in (*ours.parameters(), *twin.parameters()))


def test_twin_has_its_own_weights_and_the_check_sees_a_difference():
    torch.manual_seed(0)
    ours = build_model("tnpd", **SMALL)
    twin, _ = torch_twin(ours)
    with torch.no_grad():
        twin.encoder.layers[0].attention.attention.in_proj_weight.mul_(1.1)
    assert not torch.equal(ours.encoder.layers[0].attention.attention.in_proj_weight,
                           twin.encoder.layers[0].attention.attention.in_proj_weight)
    loss, grads = ns.check_twin(ours, twin, ns.gp_batch(2))
    assert loss > 1e-4 and grads > 1e-3


def test_twin_attention_defaults_to_no_weights():
    torch.manual_seed(0)
    ours = attn_ext.nn.MultiheadCrossAttention(16, 2)
    twin = torch_twin(torch.nn.Sequential(ours))[0][0]
    q, kv = torch.randn(2, 5, 16), torch.randn(2, 9, 16)
    out, weights = twin(q, kv, kv)
    assert weights is None and torch.allclose(out, ours(q, kv, kv)[0], atol=1e-6)
    plain = torch_twin(torch.nn.Sequential(attn_ext.nn.MultiheadAttention(16, 2)))[0][0]
    assert type(plain) is torch.nn.MultiheadAttention  # torch's default need_weights=True, as attn_ext's own


def test_cmanp_block_stack_gives_cmanps_loss():
    torch.manual_seed(0)
    model = build_model("cmanp", **SMALL)
    batch = ns.gp_batch(2)
    assert torch.allclose(CMANPBlockStack(model)(batch), model(batch), rtol=1e-5)
    with pytest.raises(AttributeError):  # why CMANP itself has no twin: torch's module has no state path
        torch_twin(model)[0](batch)


def test_build_says_why_a_workload_has_no_twin():
    for key in ("cmanp", "intention_np"):
        ours, twin, info = ns.build(key, SMALL, "cpp")
        assert twin is None and info["no_twin"] in (ns.NO_TWIN.get(key), ns.NOTHING_TO_REPLACE)
    ours, twin, info = ns.build("cmanp_stack", SMALL, "reference")
    assert isinstance(ours, CMANPBlockStack) and info["replaced"] == 4 + 1 and twin is not None
    assert {m.backend for m in ours.modules() if isinstance(m, attn_ext.nn.MultiheadAttention)} == {"reference"}


def _row(key, ours, sdpa, step=(10.0, 10.0)):
    """A measured row: the step's attention ``ours`` vs ``sdpa`` ms, the steps ``step`` (ours, twin) ms."""
    return {"key": key, "label": key, "impls": {"ours": {"median_ms": step[0]}, "twin": {"median_ms": step[1]}},
            "attention": {"impls": {"ours": {"median_ms": ours}, "sdpa": {"median_ms": sdpa}}}}


def test_goal_is_on_the_attention_and_re_measures_a_failing_model():
    # TNP-D's step is 0.5x its twin's but its attention 1.3x SDPA's: the goal reads the attention.
    rows = [_row("tnpd", 13.0, 10.0, step=(5.0, 10.0)), _row("lbanp", 5.0, 10.0, step=(11.0, 10.0)),
            _row("cmanp", 9.5, 10.0), _row("retreever", 20, 10)]
    seen = []

    def remeasure(row):
        seen.append(row["key"])
        return {"ours": {"median_ms": 9.0}, "sdpa": {"median_ms": 10.0}}

    judged = ns.judge_goals(rows, ns.QUICK, remeasure)
    assert seen == ["tnpd", "cmanp"] and "judged" not in rows[3]  # failing, borderline; lbanp passes clearly
    assert rows[0]["judged"]["values"] == [1.3, 0.9] and rows[1]["judged"]["values"] == [0.5]
    assert judged["verdict"] == "met" and judged["rows_met"] == 3 and "batch 4" in judged["grid_note"]
    assert ns.judge_goals([_row("tnpd", 13.0, 10.0, step=(5.0, 10.0))], ns.FULL, None)["verdict"] == "NOT met"
    assert ns.judge_goals([_row("lbanp", 5.0, 10.0, step=(11.0, 10.0))], ns.FULL, None)["verdict"] == "met"
    assert step_ratio(rows[0]) == 0.5 and attention_ratio(rows[0]) == 1.3


def test_summary_reads_time_ratios_the_same_way():
    """The README table has only time ratios, ours over the other (below 1 = ours faster): no steps/s column
    beside a time ratio."""
    rows = [_row("tnpd", 13.0, 10.0, step=(5.0, 10.0)), {**_row("intention_np", None, None), "impls": {
        "ours": {"median_ms": 4.0}}, "attention": {"share": 0.1, "calls": 0, "ops_per_step": {"intention": 6}}}]
    rows[0]["label"], rows[1]["label"] = "TNP-D", "IntentionNP"
    rows[0]["attention"].update(share=0.2, calls=6, ops_per_step={"cross_attention": 6})
    ns.judge_goals(rows, ns.FULL, None)
    goals = {"limit": 1.0, "models": ["TNP-D"], "verdict": "NOT met", "grid_note": ""}
    from bench import bench_np_step_report as report

    table, text = report.summary({"rows": rows, "goals": goals, "config": {
        "batch": 16, "num_context": 25, "num_target": 14, "threads": 1}})
    assert "steps/s" not in table and "| TNP-D | 20% | 0.50x | 1.30x | NOT met |" in table
    assert "| IntentionNP | 10% | — | — | — |" in table
    assert "below 1 = ours faster" in text and "ours / SDPA on the same calls <= 1 for TNP-D: **NOT met**" in text


def test_run_on_a_tiny_grid_writes_the_report(tmp_path):
    status = ns.run(BenchOptions(quick=True, out_dir=tmp_path, repeats=1), grid=TINY)
    assert status == 0
    assert {p.name for p in tmp_path.iterdir()} == {f"np_step.{ext}" for ext in ("md", "json", "png")}
    result = json.loads((tmp_path / "np_step.json").read_text())
    rows = {r["key"]: r for r in result["rows"]}
    assert list(rows) == list(ns.WORKLOADS) and not result["warnings"]
    # Every model with softmax multi-head attention has a twin; HyperMixer, TE attention, the set convolution,
    # Intention and linear attention have nothing to replace; CMANP(-AND) condition through attention states.
    with_twin = {"tnpd", "lbanp", "cmanp_stack", "retreever", "tnp_nd", "lbanp_nd", "ist", "perceiver_io",
                 "transformer_ca"}
    assert {k for k, r in rows.items() if "twin" in r["impls"]} == with_twin
    # The attention is replayed wherever the step runs softmax attention, CMANP's state path included.
    assert {k for k, r in rows.items() if r["attention"]["calls"]} == with_twin | {"cmanp", "cmanp_and"}
    for key, r in rows.items():
        a = r["attention"]
        assert r["impls"]["ours"]["median_ms"] > 0 and all(v <= ns.CHECK_RTOL for v in r["check"].values())
        assert 0.0 <= a["share"] < 1.0 and (a["share"] > 0) == bool(a["ops_per_step"]), key
        if a["calls"]:
            assert a["impls"]["ours"]["median_ms"] > 0 and a["impls"]["sdpa"]["median_ms"] > 0
            assert a["replay_rel_diff_fp64"] <= ns.CHECK_RTOL
    # One recorded call per attention module of TNP-D, each run once per step.
    assert rows["tnpd"]["attention"]["ops_per_step"] == {"cross_attention": rows["tnpd"]["replaced"]}
    assert rows["intention_np"]["attention"]["ops_per_step"] and not rows["intention_np"]["attention"]["calls"]
    assert result["goals"]["rows"] == 3 and result["config"]["batch"] == 2
    assert {r["key"] for r in result["rows"] if "judged" in r} == {"tnpd", "lbanp", "cmanp"}
    text = (tmp_path / "np_step.md").read_text()
    assert ("| model | attention modules replaced | ours step ms | twin step ms | step: ours / twin | share of ours' "
            "step in attn_ext ops |") in text
    assert "| CMANP | — |" in text and "No twin: CMANP: conditions through the attention state" in text
    assert "not softmax attention (in the share, not replayed): ReTreever: `tree_cross_attention` 1" in text
    assert text.count("- Goal") == 1 and "logical CPUs" in text and "steps/s" not in text
