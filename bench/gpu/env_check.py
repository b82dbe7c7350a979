"""Stage "env" of ``make gpu-check``: can this Python validate attn_ext on this machine's GPU?

Run by ``bench/gpu/check.sh`` after its shell-level checks (``nvidia-smi`` answers, ``nvcc`` found).
Needs torch only; reports what the later stages need and stops at the first thing missing, with the
reason, because every later stage would fail on it after minutes of building:

- torch >= 2.4, a CUDA build (``torch.version.cuda`` set), and a CUDA device it can use;
- Triton importable (the ``triton`` backend is half of what the check validates);
- pytest and hypothesis (the tests stage);
- nvcc's CUDA major version equal to torch's (torch's extension builder refuses a mismatch).

It also records the sha256 prefix of Triton's ``libtriton.so`` (which build of Triton compiled the kernels).

Prints one ``key: value`` line per fact (card, capability, versions) and writes them to ``--out`` for
the build stage (``arch`` feeds ``TORCH_CUDA_ARCH_LIST``) and the report. Exit status 0 when
everything needed is there, 2 otherwise (the message says what is missing).
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

MIN_TORCH = (2, 4)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:2])


def nvcc_cuda_version(nvcc: str) -> str | None:
    """``"13.0"`` from ``nvcc --version`` ("Cuda compilation tools, release 13.0, V13.0.48"), or None."""
    try:
        text = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None


def _module_version(name: str) -> tuple[str | None, str | None]:
    """(version, None) if ``name`` imports, else (None, why not)."""
    try:
        module = importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a broken install raises more than ImportError
        return None, f"{type(exc).__name__}: {exc}"
    return getattr(module, "__version__", "unknown"), None


def libtriton_digest() -> str:
    """``path (sha256 prefix)`` of Triton's compiled core: two images with the same version string can ship
    different builds, and a kernel's behaviour is that build's."""
    try:
        import triton  # optional: what this check looks for, so imported here, its absence reported
    except Exception:  # noqa: BLE001 - reported as missing below
        return "not found (triton does not import)"
    for path in sorted(Path(triton.__file__).parent.glob("_C/libtriton*.so")):
        digest = hashlib.sha256()
        with path.open("rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
        return f"{path} (sha256 {digest.hexdigest()[:16]})"
    return "not found (no triton/_C/libtriton*.so)"


def collect(nvcc: str) -> tuple[dict[str, str], list[str], list[str]]:
    """``(facts, problems, warnings)``: what this machine has, what stops the check, what is only odd."""
    facts: dict[str, str] = {"python": f"{sys.executable} ({platform.python_version()})"}
    problems: list[str] = []
    warnings: list[str] = []

    facts["torch"] = torch.__version__
    facts["torch_cuda"] = str(torch.version.cuda)
    if _version_tuple(torch.__version__) < MIN_TORCH:
        problems.append(f"torch {torch.__version__} is older than the {'.'.join(map(str, MIN_TORCH))} attn_ext needs")
    if torch.version.cuda is None:
        problems.append(f"torch {torch.__version__} is a CPU build (torch.version.cuda is None): "
                        "the CUDA kernels cannot be built or run; use a CUDA build of torch")
    elif not torch.cuda.is_available():
        problems.append(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no usable CUDA device "
                        "(torch.cuda.is_available() is False: no GPU, or a driver older than torch's CUDA)")
    else:
        index = torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        props = torch.cuda.get_device_properties(index)
        facts.update(card=torch.cuda.get_device_name(index), capability=f"{major}.{minor}", arch=f"{major}.{minor}",
                     sm_count=str(props.multi_processor_count), memory_gib=f"{props.total_memory / 2**30:.1f}",
                     device_count=str(torch.cuda.device_count()))
        if major < 7:
            problems.append(f"compute capability {major}.{minor} is below 7.0, the oldest the kernels target")
    nvcc_version = nvcc_cuda_version(nvcc)
    facts["nvcc"] = f"{nvcc} (CUDA {nvcc_version})"
    if nvcc_version is None:
        problems.append(f"{nvcc} --version did not print a CUDA release")
    elif torch.version.cuda is not None:
        if nvcc_version.split(".")[0] != torch.version.cuda.split(".")[0]:
            problems.append(f"nvcc is CUDA {nvcc_version} but torch was built with CUDA {torch.version.cuda}: "
                            "torch's extension builder refuses a different major version; set CUDA_HOME to a "
                            f"CUDA {torch.version.cuda.split('.')[0]}.x toolkit")
        elif nvcc_version != torch.version.cuda:
            warnings.append(f"nvcc is CUDA {nvcc_version}, torch's CUDA is {torch.version.cuda} (same major: builds)")
    for name, needed_for in (("triton", "the triton backend"), ("pytest", "the tests stage"),
                             ("hypothesis", "the tests stage (python_tests/conftest.py)")):
        version, error = _module_version(name)
        facts[name] = version or f"missing ({error})"
        if error:
            problems.append(f"{name} cannot be imported ({error}); it is needed for {needed_for}")
    facts["libtriton"] = libtriton_digest()
    for name in ("xdist", "matplotlib"):  # optional: parallel tests; nothing else
        version, error = _module_version(name)
        facts[name] = version or "not installed (optional)"
    return facts, problems, warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nvcc", required=True, help="the nvcc the build will use")
    parser.add_argument("--out", type=Path, help="write the facts here as key: value lines")
    args = parser.parse_args(argv)
    facts, problems, warnings = collect(args.nvcc)
    lines = [f"{key}: {value}" for key, value in facts.items()]
    print("\n".join(lines))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    for warning in warnings:
        print(f"warning: {warning}")
    if problems:
        print("gpu-check cannot run on this machine:", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
