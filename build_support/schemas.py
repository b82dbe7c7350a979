"""The op schemas for the Python side: read from ``csrc/op_list.h``, where every op's schema is written
once (one ``ATTN_EXT_OP(name, (return type), (parameters), "schema")`` entry per op), and written to
``attn_ext/_op_schemas.json`` as ``{"<op name>": "<schema string as csrc/schemas.cpp passes to m.def>"}``.

setup.py writes the file on every run, before anything is compiled and also under ATTN_EXT_SKIP_BUILD=1,
so that an install without the compiled kernels knows the schemas too. Pure Python (no torch).
"""
from __future__ import annotations

import json
import os
import re

#: Where the schemas are written, under the project root.
SCHEMAS_JSON = os.path.join("attn_ext", "_op_schemas.json")
#: Where they are read from, under the project root.
OP_LIST = os.path.join("csrc", "op_list.h")

# Comments and string literals in one pass, so that neither is mistaken for the other.
_COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:[^"\\\n]|\\.)*"', re.S)
_STRING = re.compile(r'"([^"\\\n]*)"')
_ENTRY = re.compile(r"^\s*ATTN_EXT_OP\(\s*(\w+)\s*,", re.M)


class SchemaListError(ValueError):
    """csrc/op_list.h does not read as a list of ops."""


def without_comments(source: str) -> str:
    """C++ source text with its comments blanked out (string literals kept whole)."""
    return _COMMENT_OR_STRING.sub(lambda m: m.group(0) if m.group(0).startswith('"') else " ", source)


def _entry_text(code: str, start: int) -> str:
    """The text of the entry whose opening parenthesis is at ``start``, up to its closing one (string
    literals, which hold the schema's own parentheses, are skipped)."""
    depth, i = 0, start
    while i < len(code):
        if code[i] == '"':
            literal = _STRING.match(code, i)
            if literal is None:
                raise SchemaListError(f"a string literal at offset {i} of {OP_LIST} is unterminated or has an escape")
            i = literal.end()
            continue
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        if depth == 0:
            return code[start:i + 1]
        i += 1
    raise SchemaListError(f"unterminated ATTN_EXT_OP entry at offset {start} of {OP_LIST}")


def parse_op_list(source: str) -> dict:
    """``{op name: schema}`` of the entries of op_list.h's text ``source``, in their order. The schema is
    the concatenation of the entry's adjacent string literals; it must name the entry's op."""
    code = without_comments(source)
    schemas = {}
    for entry in _ENTRY.finditer(code):
        name = entry.group(1)
        schema = "".join(_STRING.findall(_entry_text(code, code.index("(", entry.start()))))
        if not schema.startswith(f"{name}("):
            raise SchemaListError(f"the schema of op {name} in {OP_LIST} names another op: {schema!r}")
        if name in schemas:
            raise SchemaListError(f"op {name} appears twice in {OP_LIST}")
        schemas[name] = schema
    if not schemas:
        raise SchemaListError(f"no ATTN_EXT_OP entries in {OP_LIST}")
    return schemas


def write_schemas(root: str) -> str:
    """Writes ``attn_ext/_op_schemas.json`` under ``root`` from its ``csrc/op_list.h`` (untouched when
    already up to date, so that its time stamp moves only with the schemas); returns its path."""
    with open(os.path.join(root, OP_LIST), encoding="utf-8") as handle:
        schemas = parse_op_list(handle.read())
    path = os.path.join(root, SCHEMAS_JSON)
    text = json.dumps(schemas, indent=1) + "\n"
    try:
        with open(path, encoding="utf-8") as handle:
            if handle.read() == text:
                return path
    except OSError:
        pass
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text)
    return path
