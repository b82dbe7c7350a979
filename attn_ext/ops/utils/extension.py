"""Loading of the compiled kernels (attn_ext._C), remembering why it failed if it did."""
from __future__ import annotations

import functools
import json
import os
from typing import Optional

_load_error: Optional[str] = None

try:
    from attn_ext import _C  # noqa: F401  (importing runs the TORCH_LIBRARY registrations)
except ImportError as exc:  # built with ATTN_EXT_SKIP_BUILD=1, or a broken build
    _load_error = f"attn_ext._C could not be imported ({exc}); reinstall with `pip install --no-build-isolation -e .`"


def extension_error() -> Optional[str]:
    """Why the compiled kernels are unavailable, or None when they are loaded."""
    return _load_error


@functools.lru_cache(maxsize=None)  # the file changes only with a rebuild, which restarts Python
def cuda_build_reason() -> Optional[str]:
    """Why the installed build of attn_ext._C has no CUDA kernels, as setup.py recorded it (ATTN_EXT_SKIP_CUDA=1,
    a CPU torch, a CUDA fall-back and its cause); None when they were built or nothing was recorded."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "_build_info.json")
    try:
        with open(path) as handle:
            return json.load(handle).get("cuda_reason")
    except (OSError, ValueError):
        return None
