"""Resource table of every CUDA kernel instantiation, from ptxas (``-Xptxas -v``).

Registers per thread, spill stores/loads, stack frame, static shared memory and barriers, per kernel
and architecture, written as Markdown to ``bench/results/cuda_resources.md`` (and printed). No GPU
is needed: this is what the compiler decided. Dynamic shared memory is chosen at launch by each
kernel's launch plan (``csrc/cuda/*_plan.h``), which the host tests check; it is not in
ptxas's report.

Usage::

    python bench/gpu/cuda_resources.py                 # compile csrc/cuda/*.cu for sm_80 and sm_90 (nvcc)
    python bench/gpu/cuda_resources.py --log build.log # parse an existing build log instead
    python bench/gpu/cuda_resources.py --archs 90      # one architecture

``.ci/cuda_compile_check.sh`` passes its CMake build log, so CI prints the same table without
compiling twice. Exits 1 if a kernel spills (the goal for the attention kernels is zero spills).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "results" / "cuda_resources.md"

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+a?)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")


@dataclass
class Kernel:
    name: str
    arch: str
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    static_smem: int = 0
    barriers: int = 0


def parse(log: str) -> list[Kernel]:
    """The kernels of a ptxas ``-v`` log, in order (device functions without an entry are skipped)."""
    kernels: list[Kernel] = []
    current: Kernel | None = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = Kernel(m.group(1), m.group(2))
            kernels.append(current)
        elif current is not None and (m := _FRAME.search(line)):
            current.stack, current.spill_stores, current.spill_loads = map(int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current.registers = int(m.group(1))
            current.barriers = int(b.group(1)) if (b := _BARRIERS.search(line)) else 0
            current.static_smem = int(s.group(1)) if (s := _SMEM.search(line)) else 0
            current = None
    return kernels


def demangle(names: list[str]) -> dict[str, str]:
    """Readable kernel names via c++filt, shortened (namespaces and parameter lists dropped)."""
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    readable = {}
    for mangled, plain in zip(names, out.splitlines()):
        plain = plain.replace("attn_ext::cuda::", "").replace("detail::", "").replace("(anonymous namespace)::", "")
        plain = re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", plain)  # the parameter list
        readable[mangled] = plain.replace("__nv_bfloat16", "bf16").replace("__half", "fp16")
    return readable


def compile_log(archs: list[str]) -> str:
    """Compile each csrc/cuda/*.cu with ptxas -v for ``archs``; returns the combined log."""
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not Path(nvcc).exists():
        sys.exit("nvcc not found (put it on PATH or install the CUDA toolkit in /usr/local/cuda)")
    logs = []
    with tempfile.TemporaryDirectory() as tmp:
        for source in sorted((ROOT / "csrc" / "cuda").glob("*.cu")):
            gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
            cmd = [nvcc, "-std=c++17", "-O3", "-Xptxas", "-v", *gencode, "-I", str(ROOT / "csrc" / "include"),
                   "-I", str(ROOT / "csrc" / "cuda"), "-c", str(source), "-o", str(Path(tmp) / "kernel.o")]
            print(f"nvcc {source.name} ({', '.join('sm_' + a for a in archs)}) ...", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"nvcc failed on {source.name}:\n{done.stderr[-4000:]}")
            logs.append(done.stdout + done.stderr)
    return "\n".join(logs)


def table(kernels: list[Kernel]) -> str:
    names = demangle(sorted({k.name for k in kernels}))
    lines = ["| kernel | arch | registers | spill stores B | spill loads B | stack B | static smem B | barriers |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for k in sorted(kernels, key=lambda k: (names[k.name], k.arch)):
        lines.append(f"| `{names[k.name]}` | {k.arch} | {k.registers} | {k.spill_stores} | {k.spill_loads} | "
                     f"{k.stack} | {k.static_smem} | {k.barriers} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", type=Path, help="parse this build log (with -Xptxas -v output) instead of compiling")
    parser.add_argument("--archs", nargs="+", default=["80", "90"], help="architectures to compile for")
    parser.add_argument("--out", type=Path, default=OUT, help=f"Markdown output (default: {OUT.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    log = args.log.read_text() if args.log else compile_log(args.archs)
    kernels = parse(log)
    if not kernels:
        print("no ptxas output found (was -Xptxas -v on?)", file=sys.stderr)
        return 1
    spilling = [k for k in kernels if k.spill_stores or k.spill_loads]
    archs = sorted({k.arch for k in kernels})
    summary = (f"{len(kernels)} kernel instantiations ({', '.join(archs)}); registers "
               f"{min(k.registers for k in kernels)}..{max(k.registers for k in kernels)}; "
               f"{len(spilling)} with spills.")
    text = "\n".join(["# CUDA kernel resources (ptxas -v)", "", __doc__.split("\n\n")[1].replace("\n", " "), "",
                      summary, "", table(kernels), ""])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(summary)
    print(f"wrote {args.out}")
    return 1 if spilling else 0


if __name__ == "__main__":
    sys.exit(main())
