"""Each op's schema is written once, in csrc/op_list.h; setup.py copies the schemas to
attn_ext/_op_schemas.json (build_support/schemas.py) for the Python side, and csrc/schemas.cpp registers
them. The copy must match both its source and what the dispatcher holds, and no second copy of a
schema may appear in csrc/."""
import json
import pathlib
import re
import sys

import pytest
import torch

from attn_ext.ops.utils.extension import extension_error

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # build_support/ is part of the source tree, not of the installed package

from build_support import schemas  # noqa: E402

SCHEMAS_JSON = ROOT / schemas.SCHEMAS_JSON
STRING_LITERAL = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def _written_schemas() -> dict:
    assert SCHEMAS_JSON.is_file(), f"{SCHEMAS_JSON} is missing: run `python setup.py --version` (any setup.py run)"
    return json.loads(SCHEMAS_JSON.read_text())


def test_the_json_is_the_op_list_of_the_sources():
    assert _written_schemas() == schemas.parse_op_list((ROOT / schemas.OP_LIST).read_text())


@pytest.mark.skipif(extension_error() is not None, reason=f"attn_ext._C is not loaded: {extension_error()}")
def test_every_schema_is_the_registered_one():
    written = _written_schemas()
    assert len(written) >= 16
    for name, schema in written.items():
        registered = getattr(torch.ops.attn_ext, name).default._schema
        assert str(torch._C.parse_schema(f"attn_ext::{schema}")) == str(registered), name


def test_every_schema_is_written_once_in_csrc():
    literals = {}
    for path in sorted(ROOT.joinpath("csrc").rglob("*")):
        if path.suffix in {".h", ".cpp", ".cu", ".cuh"}:
            code = schemas.without_comments(path.read_text(encoding="utf-8"))
            literals[path.relative_to(ROOT).as_posix()] = STRING_LITERAL.findall(code)
    for name in _written_schemas():
        starts = re.compile(rf"(?<!\w){name}\(\s*Tensor")
        found = [path for path, strings in literals.items() for s in strings for _ in starts.finditer(s)]
        assert found == [schemas.OP_LIST], f"the schema of {name} is written in {found}, not once in csrc/op_list.h"


def test_python_backends_take_the_compiled_ops_schemas(monkeypatch):
    # From the dispatcher when the extension is loaded, else from the installed list: the same string.
    from attn_ext.ops.utils import schemas as op_schemas

    for name in _written_schemas():
        for backend in ("reference", "triton"):
            if hasattr(torch.ops.attn_ext, f"{name}_{backend}"):
                python_op = getattr(torch.ops.attn_ext, f"{name}_{backend}").default._schema
                compiled = torch._C.parse_schema(f"attn_ext::{name}_{backend}{op_schemas.arguments_and_returns(name)}")
                assert str(python_op) == str(compiled), (name, backend)
    written = _written_schemas()
    loaded = {name: op_schemas.op_schema(name) for name in written}
    monkeypatch.setattr(op_schemas, "extension_error", lambda: "not built (ATTN_EXT_SKIP_BUILD=1)")
    assert {name: op_schemas.op_schema(name) for name in written} == written
    for name, schema in written.items():
        assert str(torch._C.parse_schema(f"attn_ext::{loaded[name]}")) == str(torch._C.parse_schema(f"attn_ext::{schema}"))
    with pytest.raises(RuntimeError, match="no schema for op 'no_such_op'"):
        op_schemas.op_schema("no_such_op")
