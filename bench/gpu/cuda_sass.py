"""Machine-code report of the CUDA attention kernels, without a GPU (issue 43 item 1, the CUDA half).

Compiles csrc/cuda/attention_*.cu and merge_states.cu with the build's own nvcc command lines (CMake's
``compile_commands.json``) as ``nvcc -cubin`` for each target (default sm_80 and sm_90a), reads each
cubin with ``cuobjdump -sass`` and ``--dump-resource-usage``, and reports per kernel instantiation and
target: registers, spilled bytes (ptxas ``-v``), stack, static shared memory, and the opcode counts of
:mod:`sass_opcodes` (HMMA.16816, LDSM, LDGSTS, 16-byte loads, local loads/stores, ...). The criteria of
:mod:`cuda_sass_criteria` judge every row; the known gaps are printed as "gap (issue 43)", never as passes.

Usage::

    python bench/gpu/cuda_sass.py                        # configure a scratch build, compile sm_80 + sm_90a
    python bench/gpu/cuda_sass.py --build-dir DIR        # reuse a CMake build (.ci/cuda_compile_check.sh's)
    python bench/gpu/cuda_sass.py --targets sm_80,sm_90,sm_90a --jobs 2

With ``--build-dir`` the objects the build already compiled are read as they are, for every architecture
the build targets (``CMAKE_CUDA_ARCHITECTURES``; the CI check builds 80 and 90), spills from its
``build.log``; only the targets the build lacks (sm_90a) are compiled here. Writes the table to
``bench/out/cuda_sass.md``. Exits 1 when a criterion fails outside the known gaps or a known gap now holds
(remove it then), 0 otherwise, also when nvcc or cuobjdump is missing (then it says SKIP).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import glob
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cuda_resources import parse as parse_ptxas_log
from cuda_sass_criteria import KNOWN_GAPS, REQUIREMENTS
from cuda_sass_parse import demangle, rows as dump_rows
from cuda_sass_report import markdown, summary
from sass_criteria import FAILURES, SassRow, findings

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "bench" / "out" / "cuda_sass.md"
# The attention kernels (forward, backward: WMMA and scalar) and the state merge they combine with.
SOURCES = ("attention_*.cu", "merge_states.cu")
DEFAULT_TARGETS = ("sm_80", "sm_90a")
# The scratch build's configuration: the one .ci/cuda_compile_check.sh uses, so the flags are the same.
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DATTN_EXT_CUDA=ON", "-DATTN_EXT_TORCH=OFF",
               "-DATTN_EXT_CUDA_PTXAS_VERBOSE=ON")


def find_nvcc() -> str | None:
    found = os.environ.get("CUDACXX") or shutil.which("nvcc")
    return found or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


def find_cuobjdump(nvcc: str | None) -> str | None:
    """$CUOBJDUMP, PATH, the toolkit's beside nvcc, else the one Triton's wheel ships (in this clone's .venv
    or wherever triton is installed; found without importing triton)."""
    candidates = [os.environ.get("CUOBJDUMP"), shutil.which("cuobjdump")]
    if nvcc:
        candidates.append(str(Path(os.path.realpath(nvcc)).parent / "cuobjdump"))
        candidates += [str(Path(p).parent / "cuobjdump") for p in _nvcc_wrapped(nvcc)]
    triton = importlib.util.find_spec("triton")  # where it is installed, not imported (seconds, and optional)
    wheels = [Path(p) for p in (triton.submodule_search_locations or [])] if triton else []
    wheels += [Path(p) for p in glob.glob(str(ROOT / ".venv" / "lib" / "python3*" / "site-packages" / "triton"))]
    candidates += [str(w / "backends" / "nvidia" / "bin" / "cuobjdump") for w in wheels]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def _nvcc_wrapped(nvcc: str) -> list[str]:
    """The nvcc a small wrapper script execs (``exec /usr/local/cuda-13.0/bin/nvcc "$@"``), if it is one."""
    try:
        if os.path.getsize(nvcc) > 4096:
            return []
        return [w for w in Path(nvcc).read_text(errors="replace").split() if w.endswith("/nvcc")]
    except OSError:
        return []


def configure(build_dir: Path, nvcc: str) -> None:
    done = subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir), *CMAKE_FLAGS,
                           f"-DCMAKE_CUDA_COMPILER={nvcc}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cmake configure failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


@dataclass(frozen=True)
class Job:
    """One source for one target: read from ``binary`` (an object of the build, or a cubin compiled by
    ``command`` first, in ``directory``)."""
    source: Path
    target: str
    binary: Path
    directory: Path
    command: tuple[str, ...] = ()


def compile_commands(build_dir: Path) -> dict[Path, tuple[Path, list[str]]]:
    """``{source: (directory, nvcc command tokens)}`` of the sources this report covers."""
    wanted = {p.resolve() for pattern in SOURCES for p in (ROOT / "csrc" / "cuda").glob(pattern)}
    out = {}
    for entry in json.loads((build_dir / "compile_commands.json").read_text()):
        source = Path(entry["file"]).resolve()
        if source in wanted:
            out[source] = (Path(entry["directory"]), shlex.split(entry["command"]))
    missing = wanted - set(out)
    if missing:
        raise RuntimeError(f"{build_dir}/compile_commands.json lacks {', '.join(sorted(p.name for p in missing))}")
    return out


def cubin_command(tokens: list[str], target: str, out: Path) -> list[str]:
    """The build's command for one source, made to write a cubin for ``target`` alone: its architecture
    flags, ``-c``, ``-o`` and dependency-file flags dropped; ``-Xptxas=-v`` added for the spill bytes."""
    kept, skip = [], False
    for token in tokens:
        if skip:
            skip = False
            continue
        if token in ("-o", "-MT", "-MF", "-gencode", "-arch", "--gpu-architecture", "-code", "--gpu-code"):
            skip = True
        elif token in ("-c", "-MD", "-MMD") or token.startswith(("--generate-code", "-gencode=", "-arch=",
                                                                 "--gpu-architecture=", "-code=", "--gpu-code=")):
            continue
        else:
            kept.append(token)
    if not any("ptxas" in t and "-v" in t for t in kept):
        kept.append("-Xptxas=-v")
    return [*kept, "-cubin", f"-arch={target}", "-o", str(out)]


def object_of(tokens: list[str], directory: Path) -> Path:
    return directory / tokens[tokens.index("-o") + 1]


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd[:3])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout + done.stderr


def build_targets(cuobjdump: str, binary: Path) -> list[str]:
    """The architectures whose SASS an object carries (``cuobjdump -lelf``: "ELF file 1: x.sm_80.cubin")."""
    return sorted({line.rsplit(".", 2)[-2] for line in _run([cuobjdump, "-lelf", str(binary)]).splitlines()
                   if line.strip().endswith(".cubin")})


def spills_of(log: str) -> dict[tuple[str, str], tuple[int, int]]:
    """``{(mangled name, target): (spill store bytes, spill load bytes)}`` of a ptxas ``-v`` log."""
    return {(k.name, k.arch): (k.spill_stores, k.spill_loads) for k in parse_ptxas_log(log)}


def run_job(job: Job, cuobjdump: str, spills: dict) -> list[SassRow]:
    """Compile (if the job says how), dump, and parse one source for one target."""
    if job.command:
        spills = {**spills, **spills_of(_run(list(job.command), cwd=job.directory))}
    arch = ["-arch", job.target] if not job.command else []  # a build object holds several architectures
    sass = _run([cuobjdump, "-sass", *arch, str(job.binary)])
    usage = _run([cuobjdump, "--dump-resource-usage", *arch, str(job.binary)])
    from_ptxas = {name: value for (name, target), value in spills.items() if target == job.target}
    names = demangle(sorted({line.split(":", 1)[1].strip() for line in sass.splitlines()
                             if line.strip().startswith("Function :")}))
    return dump_rows(sass, usage, job.target, names, from_ptxas if from_ptxas else None)


def plan(build_dir: Path, scratch: Path, targets: list[str], cuobjdump: str,
         reuse: bool) -> tuple[list[Job], list[str]]:
    """The jobs, and the targets the build's objects carry (those are read, not recompiled, when ``reuse``)."""
    jobs, built = [], set()
    for source, (directory, tokens) in sorted(compile_commands(build_dir).items()):
        have = build_targets(cuobjdump, object_of(tokens, directory)) if reuse else []
        built.update(have)
        for target in sorted(set(targets) | set(have)):
            if target in have:
                jobs.append(Job(source, target, object_of(tokens, directory), directory))
            else:
                cubin = scratch / f"{source.stem}.{target}.cubin"
                jobs.append(Job(source, target, cubin, directory, tuple(cubin_command(tokens, target, cubin))))
    return jobs, sorted(built)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", type=Path, help="a configured (and built) CMake build to reuse")
    parser.add_argument("--build-log", type=Path, help="its ptxas -v log for spill bytes (default BUILD_DIR/build.log)")
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help="comma-separated sm_XX[a]")
    parser.add_argument("--jobs", type=int, default=2, help="compiles / dumps at a time (default 2)")
    parser.add_argument("--out", type=Path, default=OUT, help=f"Markdown table (default {OUT.relative_to(ROOT)})")
    parser.add_argument("--full", action="store_true", help="print every instantiation, not the summary")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    nvcc = find_nvcc()
    cuobjdump = find_cuobjdump(nvcc)
    if nvcc is None or cuobjdump is None:
        print(f"SKIP: {'nvcc' if nvcc is None else 'cuobjdump'} not found (cuobjdump: the CUDA toolkit's, or "
              "Triton's in .venv after `make setup`); the CUDA machine-code report did not run.")
        return 0
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    with tempfile.TemporaryDirectory(prefix="attn_ext_cuda_sass_") as tmp:
        build_dir = args.build_dir
        if build_dir is None:
            build_dir = Path(tmp) / "build"
            configure(build_dir, nvcc)
        jobs, built = plan(build_dir, Path(tmp), targets, cuobjdump, reuse=args.build_dir is not None)
        log = args.build_log or build_dir / "build.log"
        spills = spills_of(log.read_text()) if built and log.exists() else {}
        with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
            found = [row for rows in pool.map(lambda j: run_job(j, cuobjdump, spills), jobs) for row in rows]
    results = findings(found, REQUIREMENTS, KNOWN_GAPS)
    seconds = time.perf_counter() - start
    origin = (f"targets read from the build's objects: {', '.join(built) or 'none'}; compiled here with "
              f"nvcc -cubin: {', '.join(sorted({j.target for j in jobs if j.command})) or 'none'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(found, results, origin, seconds))
    print(summary(found, results, origin, seconds, full=args.full))
    print(f"wrote {args.out}")
    return 1 if any(f.status in FAILURES for f in results) else 0


if __name__ == "__main__":
    sys.exit(main())
