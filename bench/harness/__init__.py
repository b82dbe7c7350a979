"""The one harness every benchmark shares: timing (:mod:`.timing`), peak memory in a fresh process
(:mod:`.memory`), goal verdicts with re-measurement (:mod:`.goals`), Markdown/JSON reports and README
blocks (:mod:`.report`), figures (:mod:`.plot`), the machine description (:mod:`.machine`) and the calls
common to the op benchmarks (:mod:`.calls`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Where ``python -m bench run`` writes by default: git-ignored, so a run leaves the checkout clean.
OUT_DIR = Path("bench/out")
#: The committed results, rewritten only by ``python -m bench run --update-results`` (``make bench-update``).
RESULTS_DIR = Path("bench/results")


@dataclass(frozen=True)
class BenchOptions:
    """Options shared by every benchmark.

    Attributes
    ----------
    quick : bool
        The quick grid (``make bench``: each benchmark in seconds to about two minutes); False: the full grid,
        on which the goals are defined and the committed results are measured.
    out_dir : Path
        Directory receiving ``<name>.md``, ``<name>.json`` and ``<name>.png``.
    backend : str
        attn_ext backend to measure (``backend=`` of the op).
    repeats : int
        Timed repeats per measurement; the median is reported.
    update_readme : Path or None
        README whose ``<!-- bench:<name>:start/end -->`` block is rewritten with the summary.
    command : str
        The command line that produced the results, written into every report.
    """

    quick: bool = False
    out_dir: Path = OUT_DIR
    backend: str = "cpp"
    repeats: int = 5
    update_readme: Path | None = None
    command: str = "python -m bench run"

    @property
    def grid(self) -> str:
        """``"quick"`` or ``"full"``, as the reports name the grid."""
        return "quick" if self.quick else "full"
