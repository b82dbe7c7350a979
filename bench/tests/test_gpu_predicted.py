"""The committed predicted-times table (bench/results/gpu_predicted.md) is what bench.gpu.predicted writes, and
its model keeps within its ceilings."""
from pathlib import Path

from bench.gpu import predicted
from bench.gpu.attention import B, H, attention_flops

RESULTS = Path(__file__).resolve().parents[1] / "results" / "gpu_predicted.md"


def test_committed_table_is_the_generators_output():
    assert RESULTS.read_text() == predicted.markdown(), "run `python -m bench.gpu.predicted` after changing the model"


def test_every_attention_row_stays_under_the_matmul_ceiling_and_counts_causal_as_half():
    rows = predicted.attention_rows()
    assert {r.implementation for r in rows} == set(predicted.IMPLEMENTATIONS)
    for r in rows:
        flops = float(r.work.split()[0]) * 1e12
        assert 0 < flops / (r.predicted_ms * 1e9) < predicted.MATMUL_TFLOPS
    full = next(r for r in rows if r.label == "bf16 D=128 L=S=4096 full fwd" and r.implementation == "triton")
    causal = next(r for r in rows if r.label == "bf16 D=128 L=S=4096 causal fwd" and r.implementation == "triton")
    assert float(full.work.split()[0]) == float(f"{attention_flops(B, H, 4096, 4096, 128, 'fwd') / 1e12:.3g}")
    assert abs(float(causal.work.split()[0]) * 2 - float(full.work.split()[0])) < 1e-2
    assert causal.predicted_ms < full.predicted_ms
