"""`python -m bench run` runs its benchmarks in one process: none may leave torch's thread count changed."""
import pytest
import torch

import bench.np.evaluate
import bench.np.train
from bench.harness import report
from bench.np import gp_report as gp_quick
from bench.harness.timing import torch_threads


@pytest.fixture
def two_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def test_torch_threads_sets_and_restores(two_threads):
    with torch_threads(1) as inside:
        assert inside == torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with torch_threads(None) as inside:
        assert inside == 2
    with pytest.raises(RuntimeError, match="boom"), torch_threads(1):
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


def test_gp_protocol_trains_on_one_thread_and_restores_the_count(two_threads, monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(bench.np.train, "train", lambda *a, **k: seen.append(("train", torch.get_num_threads())))
    monkeypatch.setattr(bench.np.evaluate, "evaluate", lambda *a, **k: seen.append(("eval", torch.get_num_threads())))
    monkeypatch.setattr(gp_quick, "report", lambda *a, **k: ("", {}, {}))
    monkeypatch.setattr(report, "publish", lambda *a, **k: True)
    assert gp_quick.run_protocol(tmp_path, tmp_path, steps=1, eval_batches=1, overrides={}) == 0
    assert seen and {threads for _, threads in seen} == {1}
    assert torch.get_num_threads() == 2
