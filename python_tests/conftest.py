"""pytest configuration of the attn_ext suite.

TRITON_INTERPRET must be set before any Triton kernel is decorated, i.e. before the ``triton_*``
kernel modules of attn_ext.ops are imported, so it is set here, first thing. ``setdefault`` keeps an explicit
TRITON_INTERPRET=0 (e.g. on a GPU machine) intact.
"""
import hashlib
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests live in one folder per op family and share _helpers.py at this folder's top.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def _inductor_cache_dir() -> str:
    # Inductor's on-disk cache does not key on our fake kernels, so a graph compiled before a change
    # to attn_ext would be replayed after it. Key the cache on the package's sources instead.
    root = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted([*root.joinpath("attn_ext").rglob("*.py"), *root.joinpath("csrc").rglob("*.*")]):
        digest.update(path.read_bytes())
    return os.path.join(tempfile.gettempdir(), f"attn_ext_inductor_{digest.hexdigest()[:16]}")


os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", _inductor_cache_dir())

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import attn_ext  # noqa: E402,F401  (registers the ops with TRITON_INTERPRET already set)

settings.register_profile(
    "attn_ext",
    deadline=None,
    max_examples=25,
    derandomize=True,
    suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large),
)
settings.register_profile("attn_ext_thorough", parent=settings.get_profile("attn_ext"), max_examples=300,
                          derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "attn_ext"))


def pytest_configure(config):
    # Emitted from inside torch.library.opcheck in torch 2.13, not by attn_ext.
    config.addinivalue_line(
        "filterwarnings", r"ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
    )


@pytest.fixture(autouse=True)
def _seed_and_clean_env(monkeypatch):
    """Each test starts from seed 0 and without a backend override from the caller's shell."""
    torch.manual_seed(0)
    monkeypatch.delenv("ATTN_EXT_BACKEND", raising=False)
    yield
