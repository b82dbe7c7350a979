"""What a pytest run had done when it ended or was stopped, from its progress record.

``make gpu-check`` runs its tests and sanitize stages with ``ATTN_EXT_TEST_PROGRESS=<file>``, under which
the plugin ``python_tests/gpu/_progress_plugin.py`` appends one line per test event to that file as it
happens (its docstring gives the format). A pytest stopped at the stage's limit prints no summary; this
module reads the record (standard library only: the report must be written where torch cannot be
imported) and says how many tests passed, failed or were skipped, which had started but not finished,
which were never started, and the slowest ones.

    python -m bench.gpu.pytest_progress RECORD [RECORD ...]
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

#: How many of the slowest finished tests the summary lists, and how many ids of each other list (the
#: tests stage runs up to 16 at once, so every unfinished one of a stopped run is named).
SLOWEST = 15
LISTED = 16


@dataclass
class Progress:
    """One run's record, read back. Times are seconds since the epoch."""

    plugins: str = ""
    collected: list[str] = field(default_factory=list)
    collect_errors: list[str] = field(default_factory=list)
    started: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)  # nodeid -> when, in the order they finished
    outcome: dict[str, str] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    exit_status: str | None = None  # None: pytest did not end (stopped, killed, or still running)
    first: float | None = None
    last: float | None = None

    def unfinished(self) -> list[str]:
        return [nodeid for nodeid in self.started if nodeid not in self.finished]

    def never_started(self) -> list[str]:
        return [nodeid for nodeid in self.collected if nodeid not in self.started]


def _merge(old: str | None, new: str) -> str:
    # A test failed when any phase failed (a teardown error included), else skipped when a phase skipped.
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    return new if old is None or rank.get(new, 2) > rank.get(old, 2) else old


def read(path: Path) -> Progress:
    progress = Progress()
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) < 3:
            continue  # a line cut by the kill
        try:
            when = float(fields[0])
        except ValueError:
            continue
        progress.first = when if progress.first is None else progress.first
        progress.last = when
        event, subject = fields[1], fields[2]
        if event == "plugins":
            progress.plugins = subject
        elif event == "collected":
            progress.collected.append(subject)
        elif event == "collect-error":
            progress.collect_errors.append(subject)
        elif event == "start":
            progress.started.setdefault(subject, when)
        elif event == "report" and len(fields) >= 6:
            progress.outcome[subject] = _merge(progress.outcome.get(subject), fields[4])
            try:
                progress.seconds[subject] = progress.seconds.get(subject, 0.0) + float(fields[5])
            except ValueError:
                pass
            if fields[3] == "teardown":
                progress.finished.setdefault(subject, when)
        elif event == "finish":
            progress.finished.setdefault(subject, when)
        elif event == "end":
            progress.exit_status = subject
    return progress


def _listed(ids: list[str], describe=lambda nodeid: nodeid) -> list[str]:
    more = [f"  ... and {len(ids) - LISTED} more"] if len(ids) > LISTED else []
    return [f"  {describe(nodeid)}" for nodeid in ids[:LISTED]] + more


def summary_lines(progress: Progress, name: str) -> list[str]:
    """The run in a few lines: counts, then unfinished, never started, failed and slowest tests."""
    counts = {key: sum(1 for nodeid in progress.finished if progress.outcome.get(nodeid) == key)
              for key in ("passed", "failed", "skipped")}
    unfinished, never = progress.unfinished(), progress.never_started()
    ended = (f"pytest ended (exit status {progress.exit_status})" if progress.exit_status is not None
             else "pytest did not end: stopped at its time limit or killed")
    lines = [f"{name}: {len(progress.collected)} collected, {len(progress.finished)} finished "
             f"({counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped), "
             f"{len(unfinished)} unfinished, {len(never)} never started; {ended}"]
    if progress.plugins:
        lines.append(f"pytest plugins: {progress.plugins}")
    if progress.collect_errors:
        lines += ["collection errors:", *_listed(progress.collect_errors)]
    if unfinished:
        # The stop itself is not recorded: the last event is the latest time the record can vouch for.
        def since(when: float) -> str:
            return f"+{when - progress.first:.1f} s"
        lines.append(f"unfinished (started, not finished; the last event was at {since(progress.last)}):")
        lines += _listed(unfinished, lambda nodeid: f"{nodeid} (started at {since(progress.started[nodeid])})")
    if never and progress.exit_status is None:
        lines += [f"never started ({len(never)}):", *_listed(never)]
    elif never:  # pytest ended early on its own (-x, --maxfail): its log says why
        lines.append(f"never started: {len(never)} (pytest stopped before them)")
    failed = [nodeid for nodeid in progress.finished if progress.outcome.get(nodeid) == "failed"]
    if failed:
        lines += [f"failed ({len(failed)}):", *_listed(failed)]
    slowest = sorted(progress.finished, key=lambda nodeid: -progress.seconds.get(nodeid, 0.0))[:SLOWEST]
    if slowest:
        lines.append(f"slowest {len(slowest)} finished tests (setup + call + teardown):")
        lines += [f"  {progress.seconds.get(nodeid, 0.0):7.2f} s  {nodeid}" for nodeid in slowest]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("records", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for path in args.records:
        print("\n".join(summary_lines(read(path), path.name) if path.exists() else [f"{path.name}: no record"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
