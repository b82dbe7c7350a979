"""Markdown output of benchmarks: tables, and the README block between markers."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str | None = None) -> str:
    """Render a GitHub-flavoured Markdown table.

    Parameters
    ----------
    headers : sequence of str
    rows : sequence of sequences
        Cells are converted with ``str``; ``None`` becomes ``"n/a"``.
    align : str, optional
        One character per column, ``"l"`` or ``"r"``; default: first column
        left, the rest right (numbers).

    Returns
    -------
    str
        The table, lines joined by newlines, no trailing newline.
    """
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers):
        raise ValueError(f"align has {len(align)} columns, headers {len(headers)}")
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {row!r} has {len(row)} cells, expected {len(headers)}")
        lines.append("| " + " | ".join("n/a" if c is None else str(c) for c in row) + " |")
    return "\n".join(lines)


def markers(name: str) -> tuple[str, str]:
    """Start and end markers of benchmark ``name``'s block in a README."""
    return f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"


def replace_block(text: str, name: str, block: str) -> str:
    """Replace what lies between benchmark ``name``'s markers in ``text``.

    Parameters
    ----------
    text : str
        Document holding exactly one start marker followed by one end marker.
    name : str
        Benchmark name, e.g. ``"cross_attention"``.
    block : str
        New content; the markers themselves are kept.

    Returns
    -------
    str

    Raises
    ------
    ValueError
        If a marker is missing, repeated, or the end precedes the start: a
        silent append could duplicate the table on every run.
    """
    start, end = markers(name)
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(
            f"expected exactly one {start!r} and one {end!r}; found "
            f"{text.count(start)} and {text.count(end)}"
        )
    head, rest = text.split(start)
    if end not in rest:
        raise ValueError(f"{end!r} comes before {start!r}")
    _, tail = rest.split(end)
    return f"{head}{start}\n{block.strip()}\n{end}{tail}"


def update_readme(path: str | Path, name: str, block: str) -> None:
    """Rewrite benchmark ``name``'s block in the file at ``path`` in place.

    Raises
    ------
    OSError
        If the file cannot be read or written.
    ValueError
        If the markers are not usable (see :func:`replace_block`).
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    path.write_text(replace_block(text, name, block), encoding="utf-8")
