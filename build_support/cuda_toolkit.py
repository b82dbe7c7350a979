"""Finding the CUDA toolkit to compile with: its root (``CUDA_HOME``), nvcc's version and targets, and
the CUDA library headers that torch's CUDA headers include.

torch.utils.cpp_extension takes ``CUDA_HOME`` from the environment, else the parent of ``which nvcc``'s
folder, once, when it is imported. When ``nvcc`` on PATH is a wrapper script (``/usr/local/bin/nvcc``
running ``/usr/local/cuda-13.0/bin/nvcc``) that guess is ``/usr/local``, which has no CUDA headers; so
the root is resolved here and exported before that import.
"""
from __future__ import annotations

import glob
import os
import re
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

#: Headers of the CUDA math libraries that torch's ATen/cuda headers include (CUDAContextLight.h).
#: A toolkit installed with nvcc and the runtime only lacks them; torch's CUDA wheels ship them.
LIBRARY_HEADERS = ("cublas_v2.h", "cublasLt.h", "cusparse.h", "cusolverDn.h")

#: The root a toolkit installs into when nothing else names one.
DEFAULT_ROOT = "/usr/local/cuda"


def is_toolkit_root(root: str) -> bool:
    """A folder nvcc can compile with: it has bin/nvcc and the runtime headers."""
    return os.path.isfile(os.path.join(root, "bin", "nvcc")) and \
        os.path.isfile(os.path.join(root, "include", "cuda_runtime.h"))


def wrapper_targets(script: str) -> List[str]:
    """The absolute paths of nvcc executables a wrapper script runs (``exec /opt/cuda/bin/nvcc "$@"``)."""
    return re.findall(r"(/[^\s'\"]*/nvcc)(?=[\s'\";]|$)", script)


def _read_script(path: str) -> str:
    """The text of ``path`` if it is a short script (``#!``), else "" (a real nvcc is a binary)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096)
    except OSError:
        return ""
    return head.decode("utf-8", "replace") if head.startswith(b"#!") else ""


def _root_of(nvcc: str) -> str:
    return os.path.dirname(os.path.dirname(nvcc))


def candidate_roots(nvcc_on_path: Optional[str],
                    read_script: Callable[[str], str] = _read_script) -> List[Tuple[str, str]]:
    """(root, how it was found), in order: nvcc's own root (torch's guess), the roots of what a wrapper
    script runs, of nvcc's real path (a symlink), then /usr/local/cuda."""
    roots = []
    if nvcc_on_path:
        roots.append((_root_of(nvcc_on_path), f"the root of nvcc on PATH, {nvcc_on_path}"))
        roots += [(_root_of(target), f"run by the nvcc wrapper script {nvcc_on_path}")
                  for target in wrapper_targets(read_script(nvcc_on_path))]
        roots.append((_root_of(os.path.realpath(nvcc_on_path)), f"the real path of {nvcc_on_path}"))
    roots.append((DEFAULT_ROOT, "the default location"))
    unique = {}
    for root, how in roots:
        unique.setdefault(root, how)
    return list(unique.items())


@dataclass
class RootChoice:
    """The toolkit root to build with (None if none), how it was found, and why not when it was not."""

    root: Optional[str]
    how: str
    problem: Optional[str] = None


def resolve_root(environ: Mapping[str, str], nvcc_on_path: Optional[str],
                 is_root: Callable[[str], bool] = is_toolkit_root,
                 read_script: Callable[[str], str] = _read_script) -> RootChoice:
    """``CUDA_HOME`` (or ``CUDA_PATH``) when set, which must then be a toolkit; else the first toolkit
    among :func:`candidate_roots`."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        given = environ.get(variable)
        if given:
            if is_root(given):
                return RootChoice(given, f"from {variable}")
            return RootChoice(None, f"from {variable}",
                              f"{variable}={given} is not a CUDA toolkit (it needs bin/nvcc and include/cuda_runtime.h); "
                              f"point {variable} at the toolkit's root, e.g. /usr/local/cuda-12.8")
    candidates = candidate_roots(nvcc_on_path, read_script)
    for root, how in candidates:
        if is_root(root):
            return RootChoice(root, how)
    where = f"nvcc on PATH is {nvcc_on_path}" if nvcc_on_path else "no nvcc on PATH"
    return RootChoice(None, "searched", f"no CUDA toolkit found ({where}; none of {', '.join(r for r, _ in candidates)} "
                      "has bin/nvcc and include/cuda_runtime.h); install the CUDA toolkit matching torch.version.cuda "
                      "and set CUDA_HOME to its root")


def parse_release(text: str) -> Optional[Tuple[int, int]]:
    """(major, minor) from ``nvcc --version`` ("Cuda compilation tools, release 13.0, V13.0.88") or from
    ``torch.version.cuda`` ("13.0"); None if neither form is there."""
    match = re.search(r"release (\d+)\.(\d+)", text) or re.fullmatch(r"\s*(\d+)\.(\d+)(?:\.\d+)?\s*", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def compare_versions(nvcc: Tuple[int, int], torch_cuda: Tuple[int, int]) -> Tuple[Optional[str], Optional[str]]:
    """(problem, note): a different major version cannot be built (torch refuses it, and code built
    against one major runtime does not run against the other's libraries); a different minor builds,
    with a note."""
    nvcc_text, torch_text = "%d.%d" % nvcc, "%d.%d" % torch_cuda
    if nvcc[0] != torch_cuda[0]:
        return (f"nvcc is CUDA {nvcc_text} but torch was built with CUDA {torch_text}: the major versions must "
                f"match. Install a CUDA {torch_cuda[0]}.x toolkit and point CUDA_HOME at it, or install the torch "
                f"build for CUDA {nvcc[0]}.x (https://pytorch.org/get-started/locally/)"), None
    if nvcc[1] != torch_cuda[1]:
        return None, (f"nvcc is CUDA {nvcc_text} and torch was built with CUDA {torch_text}: same major version, "
                      "so this builds and runs; a toolkit of the same minor version is the tested combination")
    return None, None


def run_nvcc(nvcc: str, *args: str) -> Optional[str]:
    """nvcc's output for ``args``, or None when it cannot run."""
    try:
        return subprocess.run([nvcc, *args], check=True, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def wheel_include_dirs(nvidia_dirs: Sequence[str]) -> List[str]:
    """The include folders of the CUDA libraries that torch's wheels install under ``site-packages/nvidia``:
    one folder for all (CUDA 13 wheels: nvidia/cu13/include) or one per library (CUDA 12: nvidia/cusparse/include)."""
    found = []
    for base in nvidia_dirs:
        found += sorted(glob.glob(os.path.join(base, "cu[0-9]*", "include")))
        found += sorted(d for d in glob.glob(os.path.join(base, "*", "include"))
                        if not re.fullmatch(r"cu\d+", os.path.basename(os.path.dirname(d))))
    return list(dict.fromkeys(found))


@dataclass
class HeaderSearch:
    """The extra include folders the build needs and the headers found nowhere."""

    extra_dirs: List[str] = field(default_factory=list)
    missing: List[str] = field(default_factory=list)
    found_in: Dict[str, str] = field(default_factory=dict)


def find_library_headers(toolkit_include: str, candidate_dirs: Sequence[str],
                         headers: Sequence[str] = LIBRARY_HEADERS) -> HeaderSearch:
    """For each header absent from the toolkit, the first candidate folder that has it. Folders are
    added only for headers the toolkit lacks, so a full toolkit is used as it is."""
    search = HeaderSearch()
    for header in headers:
        if os.path.isfile(os.path.join(toolkit_include, header)):
            continue
        folder = next((d for d in candidate_dirs if os.path.isfile(os.path.join(d, header))), None)
        if folder is None:
            search.missing.append(header)
            continue
        search.found_in[header] = folder
        if folder not in search.extra_dirs:
            search.extra_dirs.append(folder)
    return search


def nvidia_package_dirs() -> List[str]:
    """The ``nvidia`` namespace folders of the installed CUDA library wheels (none with a CPU torch)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec else []


@dataclass
class Toolkit:
    """What was found of the CUDA toolkit: root, nvcc's release and targets, library headers, libcudart."""

    root: RootChoice
    release: Optional[Tuple[int, int]] = None
    version_text: str = "?"
    gpu_archs: Optional[set] = None
    headers: HeaderSearch = field(default_factory=HeaderSearch)
    cudart_dir: Optional[str] = None

    @property
    def nvcc(self) -> Optional[str]:
        return os.path.join(self.root.root, "bin", "nvcc") if self.root.root else None


def probe_toolkit(environ: Mapping[str, str], nvcc_on_path: Optional[str]) -> Toolkit:
    """Runs the look-ups :mod:`build_support.plan` decides on (nvcc twice, a few file checks)."""
    from build_support.cuda_arch import parse_nvcc_gpu_archs

    toolkit = Toolkit(resolve_root(environ, nvcc_on_path))
    root = toolkit.root.root
    if root is None:
        return toolkit
    version = run_nvcc(toolkit.nvcc, "--version")
    toolkit.release = parse_release(version or "")
    if toolkit.release:
        toolkit.version_text = "%d.%d" % toolkit.release
    archs = run_nvcc(toolkit.nvcc, "--list-gpu-arch")  # CUDA >= 11.0; None (no filtering) before
    toolkit.gpu_archs = parse_nvcc_gpu_archs(archs) if archs else None
    toolkit.headers = find_library_headers(os.path.join(root, "include"), wheel_include_dirs(nvidia_package_dirs()))
    toolkit.cudart_dir = next((os.path.join(root, d) for d in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"))
                               if glob.glob(os.path.join(root, d, "libcudart.so*"))), None)
    return toolkit
