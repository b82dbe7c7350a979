"""The schema of every ``attn_ext`` op, as the C++ library defines it (``csrc/op_list.h``, one entry per op).

The Python backends (``<op>_reference``, ``<op>_triton``) take their compiled counterpart's schema from
here instead of repeating it: from the dispatcher when the extension is loaded, else from the list
``setup.py`` wrote from the same header at install time (``attn_ext/_op_schemas.json``, also written by a
pure-Python install with ``ATTN_EXT_SKIP_BUILD=1``).
"""
from __future__ import annotations

import functools
import json
import os
from typing import Dict

import torch

from attn_ext.ops.utils.extension import extension_error

_SCHEMA_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "_op_schemas.json")


@functools.lru_cache(maxsize=None)
def _installed_schemas() -> Dict[str, str]:
    try:
        with open(_SCHEMA_FILE) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def op_schema(name: str) -> str:
    """The full schema of op ``name`` (``"name(Tensor q, ...) -> (...)"``, without the namespace)."""
    if extension_error() is None and hasattr(torch.ops.attn_ext, name):
        return str(getattr(torch.ops.attn_ext, name).default._schema).split("::", 1)[1]
    schemas = _installed_schemas()
    if name not in schemas:
        raise RuntimeError(f"attn_ext: no schema for op {name!r}: the extension is not loaded "
                           f"({extension_error()}) and {_SCHEMA_FILE} does not list it; reinstall attn_ext "
                           "(`pip install --no-build-isolation -e .`)")
    return schemas[name]


def arguments_and_returns(name: str) -> str:
    """Op ``name``'s schema without its name: ``"(Tensor q, ...) -> (...)"``."""
    schema = op_schema(name)
    return schema[schema.index("("):]
