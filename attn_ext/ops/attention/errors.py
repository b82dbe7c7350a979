"""Errors of the front ends built on ``ae.scaled_dot_product_attention`` renamed after the public op a user called."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

__all__ = ["named_after"]

#: The error prefixes of the SDPA front end, the validators it shares, and ``varlen_attention`` (which
#: ``paged_attention`` runs).
_SDPA_PREFIXES = ("attn_ext.scaled_dot_product_attention: ", "attn_ext.varlen_attention: ", "attn_ext: ")


@contextmanager
def named_after(op: str) -> Iterator[None]:
    """Re-raises an error of the SDPA front end as ``attn_ext.<op>: ...``, with its type and the rest of its text."""
    try:
        yield
    except (ValueError, TypeError, RuntimeError) as err:
        message = str(err)
        for prefix in _SDPA_PREFIXES:
            if message.startswith(prefix):
                raise type(err)(f"attn_ext.{op}: {message[len(prefix):]}") from err
        raise
