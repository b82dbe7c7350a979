"""Loading of the compiled kernels (attn_ext._C), remembering why it failed if it did."""
from __future__ import annotations

from typing import Optional

_load_error: Optional[str] = None

try:
    from attn_ext import _C  # noqa: F401  (importing runs the TORCH_LIBRARY registrations)
except ImportError as exc:  # built with ATTN_EXT_SKIP_BUILD=1, or a broken build
    _load_error = f"attn_ext._C could not be imported ({exc}); reinstall with `pip install --no-build-isolation -e .`"


def extension_error() -> Optional[str]:
    """Why the compiled kernels are unavailable, or None when they are loaded."""
    return _load_error
