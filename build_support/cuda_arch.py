"""Which GPU architectures the CUDA kernels are compiled for.

``TORCH_CUDA_ARCH_LIST`` is read with torch's syntax ("8.0;8.6+PTX", spaces or semicolons, family names
such as "Ampere"), but resolved here rather than by torch: we pass the ``-gencode`` flags ourselves (torch
ignores the variable as soon as an extension passes any arch flag), the same flags reach the
``ATTN_EXT_FORCE_CUDA`` compile, and an architecture our kernels cannot be compiled for is refused by
name instead of failing deep inside nvcc.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterable, List, Optional, Sequence, Set, Tuple

#: The oldest compute capability the kernels compile for: the tensor-core kernels use fp16 WMMA, which
#: CUDA has from sm_70 (Volta). Their bfloat16 WMMA exists only from sm_80, so on sm_70/sm_75 the bf16
#: instantiations compile to a trap and the launch plans refuse bf16 there (fp16 and fp32 run).
#: nvcc 13 no longer targets sm_70, so with it the oldest is effectively sm_75 (check_requested says so).
MIN_COMPUTE_CAPABILITY = 70
MIN_REASON = ("the tensor-core kernels use fp16 WMMA, which CUDA provides only for compute capability 7.0 "
              "(Volta) and newer")

#: The default when torch names no architecture (a CPU build of torch, used by ATTN_EXT_FORCE_CUDA=1).
FALLBACK_LIST = "8.0;9.0+PTX"

#: torch's family names, longest first so that "Ampere+Tegra" is replaced before "Ampere".
NAMED_ARCHES = (
    ("Kepler+Tesla", "3.7"), ("Kepler", "3.5+PTX"), ("Maxwell+Tegra", "5.3"), ("Maxwell", "5.0;5.2+PTX"),
    ("Pascal", "6.0;6.1+PTX"), ("Volta+Tegra", "7.2"), ("Volta", "7.0+PTX"), ("Turing", "7.5+PTX"),
    ("Ampere+Tegra", "8.7"), ("Ampere", "8.0;8.6+PTX"), ("Ada", "8.9+PTX"), ("Hopper", "9.0+PTX"),
    ("Blackwell+Tegra", "11.0"), ("Blackwell", "10.0;10.3;12.0;12.1+PTX"), ("Rubin", "10.7+PTX"),
)

_ARCH = re.compile(r"^(\d+)\.(\d)([af]?)(\+PTX)?$")


class ArchError(ValueError):
    """An explicitly requested architecture list that cannot be built; the message says what to change."""


@dataclass(frozen=True, order=True)
class Arch:
    """One compute capability: ``number`` 86 for 8.6, ``suffix`` "a"/"f" for arch-specific variants,
    ``ptx`` to also embed PTX (which the driver JIT-compiles for newer GPUs)."""

    number: int
    suffix: str = ""
    ptx: bool = False

    def __str__(self) -> str:
        return f"{self.number // 10}.{self.number % 10}{self.suffix}{'+PTX' if self.ptx else ''}"

    @property
    def code(self) -> str:
        return f"{self.number}{self.suffix}"


def parse_arch_list(text: str) -> List[Arch]:
    """``TORCH_CUDA_ARCH_LIST`` syntax to sorted, de-duplicated architectures (PTX kept if any entry asks)."""
    for name, expansion in NAMED_ARCHES:
        text = text.replace(name, expansion)
    archs = {}
    for entry in filter(None, re.split(r"[;\s,]+", text.strip())):
        match = _ARCH.match(entry)
        if match is None:
            raise ArchError(f"TORCH_CUDA_ARCH_LIST: cannot read {entry!r}; write compute capabilities such as "
                            "\"8.0;8.6;9.0+PTX\" (optionally with an a/f suffix, e.g. 9.0a)")
        arch = Arch(int(match.group(1)) * 10 + int(match.group(2)), match.group(3), bool(match.group(4)))
        key = (arch.number, arch.suffix)
        archs[key] = replace(arch, ptx=arch.ptx or (key in archs and archs[key].ptx))
    if not archs:
        raise ArchError("TORCH_CUDA_ARCH_LIST is set but names no architecture; unset it for the default")
    return sorted(archs.values())


def format_arch_list(archs: Iterable[Arch]) -> str:
    return ";".join(map(str, archs))


def parse_nvcc_gpu_archs(text: str) -> Set[int]:
    """The compute capabilities in the output of ``nvcc --list-gpu-arch`` ("compute_75" lines)."""
    return {int(number) for number in re.findall(r"compute_(\d+)", text)}


def check_requested(archs: Sequence[Arch], nvcc_archs: Optional[Set[int]], nvcc_version: str) -> None:
    """Raises ArchError naming every explicitly requested architecture that cannot be built."""
    problems = []
    too_old = [a for a in archs if a.number < MIN_COMPUTE_CAPABILITY]
    if too_old:
        problems.append(f"{format_arch_list(too_old)}: {MIN_REASON}")
    if nvcc_archs is not None:
        untargetable = [a for a in archs if a.number >= MIN_COMPUTE_CAPABILITY and a.number not in nvcc_archs]
        if untargetable:
            listing = ", ".join(f"{n // 10}.{n % 10}" for n in sorted(nvcc_archs))
            problems.append(f"{format_arch_list(untargetable)}: nvcc {nvcc_version} cannot target it "
                            f"(it targets {listing})")
    if problems:
        raise ArchError("TORCH_CUDA_ARCH_LIST asks for architectures attn_ext cannot be built for: "
                        + "; ".join(problems) + ". Remove them from TORCH_CUDA_ARCH_LIST, or unset it for the default.")


def torch_sm_numbers(torch_arch_list: Iterable[str]) -> List[int]:
    """The compute capabilities of the ``sm_XX`` entries of ``torch.cuda.get_arch_list()``
    (``compute_XX`` entries are torch's own PTX, not a binary target)."""
    numbers = set()
    for entry in torch_arch_list:
        match = re.fullmatch(r"sm_(\d+)[af]?", entry)
        if match:
            numbers.add(int(match.group(1)))
    return sorted(numbers)


def default_archs(torch_arch_list: Sequence[str], nvcc_archs: Optional[Set[int]],
                  nvcc_version: str) -> Tuple[List[Arch], List[str]]:
    """The default list and the notes explaining it: the architectures torch was built for that our
    kernels support and nvcc can target, plus PTX of the newest (for GPUs newer than all of them)."""
    notes = []
    numbers = torch_sm_numbers(torch_arch_list)
    if not numbers:
        notes.append(f"torch names no sm_ architecture (a CPU build of torch): using {FALLBACK_LIST}")
        return parse_arch_list(FALLBACK_LIST), notes
    kept = []
    for number in numbers:
        name = f"sm_{number}"
        if number < MIN_COMPUTE_CAPABILITY:
            notes.append(f"left out {name}, which torch supports: {MIN_REASON}")
        elif nvcc_archs is not None and number not in nvcc_archs:
            notes.append(f"left out {name}, which torch supports: nvcc {nvcc_version} cannot target it")
        else:
            kept.append(Arch(number))
    if kept:
        kept[-1] = replace(kept[-1], ptx=True)
    return kept, notes


def gencode_flags(archs: Sequence[Arch]) -> List[str]:
    """nvcc flags embedding a binary (SASS) per architecture, and PTX where asked."""
    flags = []
    for arch in archs:
        flags.append(f"-gencode=arch=compute_{arch.code},code=sm_{arch.code}")
        if arch.ptx:
            flags.append(f"-gencode=arch=compute_{arch.code},code=compute_{arch.code}")
    return flags
