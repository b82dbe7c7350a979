"""Output of benchmarks: Markdown tables, result files, the README block between markers."""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Callable, Sequence


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


def progress(msg: str, end: str = "\n") -> None:
    """Write a progress line to stderr, so stdout carries only the Markdown tables."""
    print(msg, file=sys.stderr, end=end, flush=True)


def format_ms(x: float | None) -> str | None:
    """Milliseconds for a table cell: 3 significant digits below 10 ms, 1 decimal above."""
    if x is None:
        return None
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def provenance(options, name: str, note: str = "") -> str:
    """The sentence every report ends with: the command and the grid that produced it, and when."""
    grid = ("the **quick grid** (goals defined on the full grid say so)" if options.quick
            else "the full grid")
    return (f"Produced by `{options.command}` on {grid}, {datetime.date.today().isoformat()}"
            + (f"; {note}" if note else "") + ".")


def readme_summary(table: str, text: str, options, name: str, warnings=()) -> str:
    """A README block: the short table, then one paragraph (what it measured, the goals, the provenance),
    then any warnings (a README never shows a table without them)."""
    return (f"{table}\n\n{text} {provenance(options, name)}"
            + "".join(f"\n\nWarning: {w}" for w in warnings))


def publish_run(name: str, result: dict, tables: Callable[[dict], str], summary: Callable[[dict], tuple], options,
                plot: Callable[[dict, Path], None] | None = None, failed=(), notes=()) -> int:
    """Publish one benchmark run the way every op benchmark does: ``tables(result)`` followed by the notes,
    the warnings (the failed measurements added to them) and the provenance; the README block gets
    ``summary(result)`` (a ``(table, text)`` pair) with the same notes and warnings. Returns the exit status:
    1 when a measurement failed or the README could not be updated."""
    result["warnings"] += list(failed)
    remarks = [*notes, *result["warnings"]]
    tail = ("".join(f"\n\nNote: {s}" for s in notes) + "".join(f"\n\nWarning: {w}" for w in result["warnings"])
            + "\n\n" + provenance(options, name))
    ok = publish(name, tables(result) + tail, result, options.out_dir, plot, options.update_readme,
                 summary=readme_summary(*summary(result), options, name, remarks))
    return 1 if failed or not ok else 0


def publish(
    name: str,
    block: str,
    result: dict,
    out_dir: str | Path,
    plot: Callable[[dict, Path], None] | None = None,
    readme: str | Path | None = None,
    summary: str | None = None,
) -> bool:
    """Print ``block``, write ``<name>.md/.json/.png`` and optionally rewrite a README block.

    Parameters
    ----------
    name : str
        Benchmark name: file stem and README marker name.
    block : str
        Markdown for stdout and ``<name>.md``.
    result : dict
        JSON-serialisable raw results, written to ``<name>.json``.
    out_dir : str or Path
        Created if needed.
    plot : callable, optional
        ``plot(result, path)`` writing the PNG; skipped with a warning when
        matplotlib is missing, since the numbers matter more than the figure.
    readme : str or Path, optional
        README whose ``<!-- bench:<name>:start/end -->`` block is replaced.
    summary : str, optional
        What the README block gets instead of ``block``: a short table, to which a link to ``<name>.md``
        is added when ``out_dir`` is relative (to the repository root, where the README is).

    Returns
    -------
    bool
        False when the README could not be updated (the files are written anyway).
    """
    print(block)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.md").write_text(f"# {name} benchmark\n\n{block}\n", encoding="utf-8")
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    written = ".md, .json"
    if plot is not None:
        try:
            plot(result, out_dir / f"{name}.png")
            written += ", .png"
        except ImportError as exc:
            progress(f"warning: no {name}.png ({exc})")
    progress(f"wrote {out_dir / name}{written}")
    if readme is None:
        return True
    if summary is not None and not out_dir.is_absolute():  # a link that resolves from the README at the root
        report = (out_dir / f"{name}.md").as_posix()
        summary += f" Full report: [{report}]({report})."
    try:
        update_readme(readme, name, block if summary is None else summary)
    except (OSError, ValueError) as exc:
        progress(f"error: could not update {readme}: {exc}")
        return False
    progress(f"updated the {name} block of {readme}")
    return True


def timing_dict(t) -> dict:
    """A timing (or the exception that stopped it) as JSON-ready ``{"median_ms", "samples_ms"[, "error"]}``."""
    if isinstance(t, Exception):
        return {"median_ms": None, "samples_ms": [], "error": f"{type(t).__name__}: {t}"}
    return {"median_ms": t.median_ms, "samples_ms": list(t.samples_ms)}
