"""bench.gpu.measured_vs_predicted on small bench.json files made here in the format bench.gpu.bench_cuda writes:
rows find their predictions (whatever the labels' spelling), ratios and the 2x marks are right, a row without
a prediction is listed, several runs are merged with the later one shown."""
import json
import math

import pytest

from bench.gpu import measured_rows, measured_vs_predicted, predicted
from bench.gpu.attention import B, H, attention_flops

HEADER = ("GPU benchmarks on **Test Card** (compute capability 9.0, 132 SMs, 140 GiB), torch 2.11.0+cu130 "
          "(CUDA 13.0), Triton 3.6.0, 2026-11-28. Times are medians of CUDA-event timings after warm-up.")


def predicted_ms(label: str, impl: str) -> float:
    return next(r.predicted_ms for r in predicted.attention_rows() if (r.label, r.implementation) == (label, impl))


def attention_row(impl, ms, dtype="fp16", d=64, n=1024, m=None, causal=False, pass_="fwd", note=None):
    flops = attention_flops(B, H, m or n, n, d, pass_, causal)
    row = {"section": "attention", "dtype": dtype, "D": d, "N": n, "M": m or n, "causal": causal, "pass": pass_,
           "impl": impl, "flops": flops}
    if note:
        return {**row, "note": note}
    return {**row, "rel_err": 1e-4, "ms": ms, "samples_ms": [ms] * 3, "peak_mib": 16.0,
            "tflops": flops / (ms * 1e-3) / 1e12, "vs_sdpa": 1.0}


def other_section_rows(scale: float) -> list[dict]:
    """One measured row of every kind the states, tree and other sections write (times: ``scale`` ms)."""
    t = scale
    return ([{"section": "states", "kind": "update", "backend": b, "N": n, "dtype": "fp32", "update_ms": t,
              "update_samples_ms": [t], "update_peak_mib": 1.0, "recompute_ms": 10 * t, "recompute_samples_ms": [t],
              "rel_err_update": 0.0, "rel_err_recompute": 0.0} for b in ("cuda", "triton") for n in (1000, 1_000_000)]
            + [{"section": "states", "kind": "merge", "backend": b, "N": 0, "dtype": dt, "ms": t, "samples_ms": [t],
                "torch_ms": 3 * t, "peak_mib": 1.0, "rel_err": 0.0}
               for b in ("cuda", "triton") for dt in ("fp32", "bf16")]
            + [{"section": "tree", "what": "full", "impl": i, "N": 1_000_000, "rel_err": 0.0, "ms": t,
                "samples_ms": [t], "peak_mib": 1.0} for i in ("sdpa", "cuda")]
            + [{"section": "tree", "what": "build", "N": 1_000_000, "b": 2, "ms": t, "num_selected": 40},
               {"section": "tree", "what": "tree", "impl": "triton", "N": 1_000_000, "b": 2, "rel_err": 0.0,
                "queries_elsewhere": 0, "ms": t, "samples_ms": [t], "peak_mib": 1.0}]
            + [{"section": "other", "what": w, "impl": i, "rel_err": 0.0, "fwd_ms": t, "fwd_bwd_ms": 3 * t,
                "peak_mib": 1.0} for w, i in (("intention", "triton"), ("sigma_intention", "cuda"), ("sdpa", "torch"))]
            + [{"section": "other", "what": "cholesky", "impl": i, "rel_err": 0.0, "ms": t, "peak_mib": 1.0}
               for i in ("cuda", "torch")])


def write_run(path, rows):
    meta = {"header": HEADER, "errors": [], "warm_up": None,
            "ceilings": {"matmul_bf16_tflops": 780.0, "copy_tbps": 4.2}, "elapsed_s": 1.0}
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return path


FULL_FWD = predicted.attention_label("fp16", 64, 1024, False, "fwd")


def test_attention_rows_find_their_predictions_and_far_ones_are_marked(tmp_path):
    flash, triton, cuda = (predicted_ms(FULL_FWD, i) for i in ("sdpa-flash", "triton", "cuda"))
    run = measured_rows.read_run(write_run(tmp_path / "bench.json", [
        attention_row("sdpa-flash", 1.5 * flash), attention_row("triton", 3.0 * triton),
        attention_row("cuda", 0.25 * cuda)]))
    lines = {ln.measurement.impl: ln for ln in measured_rows.compare([run])}
    assert {impl: round(ln.ratio, 6) for impl, ln in lines.items()} == {"sdpa-flash": 1.5, "triton": 3.0, "cuda": 0.25}
    assert [impl for impl, ln in lines.items() if ln.marked] == ["triton", "cuda"]
    flops = attention_flops(B, H, 1024, 1024, 64, "fwd")
    assert lines["triton"].tflops == pytest.approx(flops / (3.0 * triton * 1e9))
    text = measured_vs_predicted.markdown([run])
    assert f"| {FULL_FWD} | triton | {triton:.3g} | {3 * triton:.3g} | 3.00 |" in text
    assert f"| {FULL_FWD} | cuda | {cuda:.3g} | {0.25 * cuda:.3g} | 0.25 |" in text
    table = {impl: next(line for line in text.splitlines() if line.startswith(f"| {FULL_FWD} | {impl} |"))
             for impl in lines}
    assert {impl: ("**slower**" in line, "**faster**" in line) for impl, line in table.items()} == \
        {"sdpa-flash": (False, False), "triton": (True, False), "cuda": (False, True)}
    # The pivot: flash's time over ours, measured, and the predicted ratio in brackets.
    assert f"| {FULL_FWD} | {1.5 * flash:.3g} | {1.5 * flash / (3 * triton):.2f} ({flash / triton:.2f}) | " \
           f"{1.5 * flash / (0.25 * cuda):.2f} ({flash / cuda:.2f}) |" in text
    # Furthest first: 0.25 (4x faster) before 3.0.
    furthest = text.split("furthest from their predictions")[1]
    assert furthest.index("| cuda |") < furthest.index("| triton |") and "| sdpa-flash |" in furthest


def test_other_spellings_of_the_labels_match_the_same_prediction(tmp_path):
    label = predicted.attention_label("bf16", 128, 4096, False, "fwd+bwd")
    row = attention_row("sdpa-cudnn", 2.0, dtype="bf16", d=128, n=4096, pass_="fwd+bwd")
    row.update(dtype="torch.bfloat16", D="128", N=4096.0, **{"pass": "fwd_bwd"})
    del row["causal"], row["M"]
    (line,) = measured_rows.compare([measured_rows.read_run(write_run(tmp_path / "b.json", [row]))])
    assert line.measurement.case == label
    assert line.prediction.predicted_ms == predicted_ms(label, "sdpa-cudnn")


def test_a_measured_row_without_a_prediction_is_listed(tmp_path):
    rows = [attention_row("triton", 1.0, m=512), attention_row("sdpa-math", 1.0), *other_section_rows(0.01)]
    run = measured_rows.read_run(write_run(tmp_path / "bench.json", rows))
    lines = measured_rows.compare([run])
    unmatched = {(ln.measurement.case, ln.measurement.impl) for ln in lines if ln.prediction is None}
    assert ("fp16 D=64 M=512 N=1024 full fwd", "triton") in unmatched
    assert (FULL_FWD, "sdpa-math") in unmatched
    assert ("merge bf16", "cuda") in unmatched and ("update 16 keys, N=1,000", "triton update") in unmatched
    assert ("sigma_intention fwd", "cuda") in unmatched and ("build, N=1,000,000, b=2", "cuda") in unmatched
    text = measured_vs_predicted.markdown([run])
    assert "| fp16 D=64 M=512 N=1024 full fwd | triton | no prediction | 1 |" in text
    assert f"| {FULL_FWD} | sdpa-math | no prediction | 1 |" in text
    assert "| merge bf16 | cuda | no prediction | no prediction |" in text


def test_every_prediction_of_the_other_sections_is_reachable(tmp_path):
    keys = {(r.label, r.implementation) for r in predicted.other_rows()}
    assert set(measured_rows.OTHER_PREDICTIONS) == keys, \
        "bench.gpu.predicted renamed a row: update bench.gpu.measured_rows"
    run = measured_rows.read_run(write_run(tmp_path / "bench.json", other_section_rows(0.02)))
    lines = measured_rows.compare([run])
    assert {(ln.prediction.label, ln.prediction.implementation) for ln in lines if ln.prediction} == keys
    unused = measured_rows.unmeasured_predictions(lines)
    assert unused["attention"] == len(predicted.attention_rows())
    assert unused["states"] == unused["tree"] == unused["other"] == 0
    merge = next(ln for ln in lines if ln.measurement.key == ("states", "merge fp32", "triton"))
    assert merge.ratio == pytest.approx(0.02 / merge.prediction.predicted_ms)
    recompute = next(ln for ln in lines
                     if ln.measurement.key == ("states", "update 16 keys, N=1,000,000", "cuda recompute"))
    assert recompute.tflops == pytest.approx(measured_rows.work_flops(recompute.prediction) / (0.2 * 1e9))


def test_several_runs_show_the_last_and_name_the_others(tmp_path):
    flash, triton, cuda = (predicted_ms(FULL_FWD, i) for i in ("sdpa-flash", "triton", "cuda"))
    limit = "not measured: time limit of the bench stage"
    first = write_run(tmp_path / "run1.json", [
        attention_row("sdpa-flash", flash), attention_row("triton", triton), attention_row("cuda", cuda),
        attention_row("sdpa-flash", 1.0, pass_="fwd+bwd", note=limit)])
    second = write_run(tmp_path / "run2.json", [
        attention_row("sdpa-flash", 1.05 * flash), attention_row("triton", 1.3 * triton),
        attention_row("cuda", 1.0, note=limit),
        attention_row("sdpa-flash", 1.0, pass_="fwd+bwd", note="not measured: time limit"),
        attention_row("sdpa-cudnn", 1.0, pass_="fwd+bwd", note="not measured: RuntimeError: no cuDNN"),
        *(attention_row("cuda", 1.0, n=16384, causal=causal, note=f"not measured: one call took {took} s, over "
                        "the limit of 0.5 s per call (its result was checked)")
          for causal, took in ((False, 1.25), (True, 0.61)))])
    runs = [measured_rows.read_run(p) for p in (first, second)]
    lines = {ln.measurement.impl: ln for ln in measured_rows.compare(runs)}
    assert (lines["triton"].run, lines["triton"].measurement.ms) == (2, 1.3 * triton)
    assert lines["triton"].others == ((1, triton),)
    assert (lines["cuda"].run, lines["cuda"].others) == (1, ())  # measured only in run 1: kept, not "not measured"
    cells = {impl: measured_vs_predicted.runs_cell(ln) for impl, ln in lines.items()}
    assert cells == {"sdpa-flash": "2 (also 1)", "triton": f"2 (1: {triton:.3g} ms, {100 * (1 / 1.3 - 1):+.0f} %)",
                     "cuda": "1"}
    slow = "one call took # s, over the limit of # s per call (its result was checked)"
    assert measured_rows.not_measured(runs) == {"attention": {"time limit of the bench stage": 1,
                                                              "RuntimeError: no cuDNN": 1, slow: 2}}
    text = measured_vs_predicted.markdown(runs)
    assert f"- run 1: `{first}`: **Test Card**" in text and "bf16 products 780 TFLOP/s" in text
    assert "Not measured in any run: 4 rows (" in text and f"{slow}: 2" in text


def test_the_command_prints_and_writes_the_same_markdown(tmp_path, capsys):
    path = write_run(tmp_path / "bench.json", [attention_row("triton", 1.0)])
    assert measured_vs_predicted.main([str(path), "--out", str(tmp_path / "out.md")]) == 0
    printed = capsys.readouterr().out
    assert printed == (tmp_path / "out.md").read_text() and printed.startswith("### Measured beside predicted")
    ratio = 1.0 / predicted_ms(FULL_FWD, "triton")
    assert f"| {FULL_FWD} | triton | {predicted_ms(FULL_FWD, 'triton'):.3g} | 1 | {ratio:.2f} |" in printed
    assert not math.isclose(ratio, 1.0)
