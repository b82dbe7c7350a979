"""``make sass-report``: the machine code of the attention kernels, without a GPU (issue 43 item 1).

Runs, each in its own process (each sets up its own compiler environment):

1. ``bench/gpu/triton_aot.py --scope sass``: the Triton attention kernels (forward, dK/dV, dQ, the
   backward's preprocess, the merge kernels) for sm_80 and sm_90 (sm_90a) at fp16/bf16, D = 64 and 128,
   every config the autotune pruning keeps; table in ``bench/out/triton_sass.md``;
2. ``bench/gpu/cuda_sass.py``: the CUDA attention kernels (``nvcc -cubin``); table in
   ``bench/out/cuda_sass.md`` (skipped, and said, where that script is absent);

and writes ``bench/out/sass_report.md``: each part's verdict (criteria met, known gaps as "gap (issue
43)", failures) and per-kernel table. Prints it; exits 1 when a part failed (a compile error, a criterion
broken outside the known gaps, or a known gap that now holds), else 0.

Cold, the Triton part compiles 794 kernels: 30 minutes on 2 cores (AMD EPYC, shared with other work);
cached in ``~/.cache/attn_ext/triton_aot``, a rerun takes seconds. The CUDA part: about 90 s.
"""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"
OUT = ROOT / "bench" / "out"
REPORT = OUT / "sass_report.md"
TRITON_TABLE = OUT / "triton_sass.md"
CUDA_TABLE = OUT / "cuda_sass.md"


def _run(args: list[str]) -> tuple[int, str, float]:
    """Run a part, echoing its output as it comes (a cold Triton run takes long); its exit code, output, seconds."""
    start = time.perf_counter()
    lines = []
    with subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, bufsize=1) as process:
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    return process.returncode, "".join(lines), time.perf_counter() - start


def _machine_code_section(table: Path) -> str:
    """The verdict and per-kernel table of ``triton_aot.py``'s Markdown (its every-compile table stays there)."""
    text = table.read_text() if table.exists() else ""
    start, end = text.find("## Machine code"), text.find("## Every compile")
    return text[start:end if end > 0 else None].strip() if start >= 0 else ""


def _part(title: str, code: int, output: str, seconds: float, section: str, table: Path) -> list[str]:
    verdict = "ok" if code == 0 else f"**FAILED** (exit {code})"
    lines = [f"## {title}: {verdict}", "", f"{seconds:.0f} s; every compile in `{table.relative_to(ROOT)}`.", ""]
    if section:
        return lines + [section.replace("## Machine code (issue 43)", "### Verdict"), ""]
    # No table written (the part stopped early or was skipped): its last words instead.
    return lines + ["```text", *output.strip().splitlines()[-40:], "```", ""]


def _machine() -> str:
    """The CPU model and core count: the report's timings are this machine's."""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cores"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    lines = ["# Machine-code report of the attention kernels (issue 43)", "",
             f"Written by `make sass-report` (`bench/gpu/sass_report.py`, no GPU needed) on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {_machine()}. Static instruction counts "
             "from `cuobjdump -sass`; a known gap is shown as \"gap (issue 43)\", never as a pass.", ""]
    codes = []
    code, output, seconds = _run([str(GPU / "triton_aot.py"), "--scope", "sass", "--out", str(TRITON_TABLE)])
    codes.append(code)
    lines += _part("Triton (sm_80, sm_90a)", code, output, seconds, _machine_code_section(TRITON_TABLE), TRITON_TABLE)
    cuda = GPU / "cuda_sass.py"
    if cuda.exists():
        code, output, seconds = _run([str(cuda)])
        codes.append(code)
        # Exit 0 or 1 (criteria met or not): its table is written; its headings go two levels down, under this one.
        section = CUDA_TABLE.read_text().strip() if code in (0, 1) and CUDA_TABLE.exists() else ""
        lines += _part("CUDA", code, output, seconds, re.sub(r"^(#+) ", r"\1## ", section, flags=re.M), CUDA_TABLE)
    else:
        lines += ["## CUDA: not run", "", "`bench/gpu/cuda_sass.py` is not in this checkout.", ""]
    REPORT.write_text("\n".join(lines))
    print("\n" + REPORT.read_text())
    print(f"sass_report: {REPORT.relative_to(ROOT)}; {'FAILED' if any(codes) else 'ok'}")
    return 1 if any(codes) else 0


if __name__ == "__main__":
    sys.exit(main())
