"""pytest configuration of the harness tests (``PYTHONPATH=. python -m pytest bench/tests``)."""
import os

# As in python_tests: set before any Triton kernel is decorated, i.e. before attn_ext is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _seed_and_clean_env(monkeypatch):
    """Each test starts from seed 0 and without a backend override from the caller's shell."""
    torch.manual_seed(0)
    monkeypatch.delenv("ATTN_EXT_BACKEND", raising=False)
    yield
