"""What to build, decided from the environment variables, torch and the CUDA toolkit found.

Three outcomes: ``cuda`` (the C++ CPU kernels and the CUDA kernels with their torch bindings), ``cpu``
(the C++ CPU kernels only, with the reason the CUDA kernels were left out) and ``force_cuda`` (a CPU
torch, but the torch-free CUDA kernels compiled and linked as a build check). When torch is a CUDA build
but the CUDA part cannot be built, the plan falls back to ``cpu`` with a loud warning, unless
``ATTN_EXT_REQUIRE_CUDA=1`` asks for an error instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, List, Mapping, Optional, Sequence

from build_support import cuda_arch
from build_support.cuda_toolkit import Toolkit, compare_versions, parse_release


class BuildConfigError(RuntimeError):
    """The requested build cannot be made; the message says why and what to change."""


@dataclass(frozen=True)
class TorchInfo:
    version: str
    cuda: Optional[str]  # torch.version.cuda
    hip: Optional[str] = None  # torch.version.hip
    arch_list: Sequence[str] = ()  # torch.cuda.get_arch_list()
    visible: Sequence[int] = ()  # compute capabilities of the visible GPUs, e.g. (90,)


@dataclass(frozen=True)
class BuildPlan:
    variant: str  # "cpu", "cuda" or "force_cuda"
    cuda_reason: Optional[str] = None  # why the CUDA kernels are not built (None when they are)
    unexpected: bool = False  # the CUDA part was wanted but cannot be built: warn loudly
    require_cuda: bool = False
    cuda_home: Optional[str] = None
    nvcc: Optional[str] = None
    cudart_dir: Optional[str] = None
    archs: tuple = ()
    arch_source: str = ""
    include_after: tuple = ()  # CUDA library header folders searched after the toolkit's own
    notes: List[str] = field(default_factory=list)

    @property
    def with_cuda(self) -> bool:
        return self.variant in ("cuda", "force_cuda")

    def fallback(self, reason: str) -> "BuildPlan":
        """This plan without its CUDA part (a CUDA build that failed to compile)."""
        if self.require_cuda:
            raise BuildConfigError(f"ATTN_EXT_REQUIRE_CUDA=1 and the CUDA part cannot be built: {reason}")
        return replace(self, variant="cpu", cuda_reason=reason, unexpected=True, notes=[])


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _archs(environ: Mapping[str, str], torch: TorchInfo, toolkit: Toolkit, notes: List[str]):
    """(archs, where they come from); explicit requests that cannot be built raise BuildConfigError."""
    text = environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    try:
        if text == "native":
            if not torch.visible:
                raise BuildConfigError("TORCH_CUDA_ARCH_LIST=native but torch sees no GPU; name the architectures, "
                                       "e.g. TORCH_CUDA_ARCH_LIST=\"8.0;9.0+PTX\", or unset it for the default")
            text = ";".join(f"{n // 10}.{n % 10}" for n in sorted(set(torch.visible))) + "+PTX"
        if text:
            archs = cuda_arch.parse_arch_list(text)
            cuda_arch.check_requested(archs, toolkit.gpu_archs, toolkit.version_text)
            return archs, f"TORCH_CUDA_ARCH_LIST={environ['TORCH_CUDA_ARCH_LIST']}"
    except cuda_arch.ArchError as exc:
        raise BuildConfigError(str(exc)) from None
    archs, arch_notes = cuda_arch.default_archs(torch.arch_list, toolkit.gpu_archs, toolkit.version_text)
    notes += arch_notes
    if not cuda_arch.torch_sm_numbers(torch.arch_list):
        return archs, "default when torch names no architecture"
    return archs, "default: torch's architectures that attn_ext and nvcc support, PTX of the newest"


def _toolkit_problem(torch: TorchInfo, toolkit: Toolkit, force: bool, notes: List[str]) -> Optional[str]:
    if toolkit.root.root is None:
        return toolkit.root.problem
    if toolkit.release is None:
        return f"{toolkit.nvcc} --version did not run or did not print a CUDA release"
    if torch.cuda is not None:
        torch_release = parse_release(torch.cuda)
        if torch_release is not None:
            problem, note = compare_versions(toolkit.release, torch_release)
            if problem:
                return problem
            if note:
                notes.append(note)
    if force:  # the torch-free kernels need no library headers, but libcudart to link
        if toolkit.cudart_dir is None:
            return f"no libcudart.so under {toolkit.root.root} (lib64, lib); set CUDA_HOME to a full toolkit"
        return None
    if toolkit.headers.missing:
        return (f"the CUDA library headers {', '.join(toolkit.headers.missing)} (included by torch's CUDA headers) are "
                f"neither in {toolkit.root.root}/include nor in torch's nvidia wheels; install the toolkit's "
                "cuBLAS/cuSPARSE/cuSOLVER development packages, or a CUDA build of torch from pip, which ships them")
    for folder in toolkit.headers.extra_dirs:
        headers = ", ".join(h for h, f in toolkit.headers.found_in.items() if f == folder)
        notes.append(f"{headers} not in {toolkit.root.root}/include: using torch's copies in {folder}")
    return None


def plan_build(environ: Mapping[str, str], torch: TorchInfo, probe: Callable[[], Toolkit]) -> BuildPlan:
    """The build to make. ``probe`` runs the toolkit look-ups, only when torch could use CUDA kernels."""
    skip, require, force = (_flag(environ, f"ATTN_EXT_{n}_CUDA") for n in ("SKIP", "REQUIRE", "FORCE"))
    if skip and (require or force):
        raise BuildConfigError("ATTN_EXT_SKIP_CUDA=1 contradicts ATTN_EXT_REQUIRE_CUDA=1 / ATTN_EXT_FORCE_CUDA=1; set one")
    if skip:
        return BuildPlan("cpu", "the CUDA kernels were left out on request: built with ATTN_EXT_SKIP_CUDA=1")
    reason = None
    if torch.hip is not None:
        reason = f"torch {torch.version} is a ROCm build; attn_ext's GPU kernels are CUDA kernels"
    elif torch.cuda is None and not force:
        reason = (f"torch {torch.version} is a CPU build (torch.version.cuda is None); install a CUDA build of torch "
                  "and reinstall attn_ext to build the CUDA kernels")
    if reason is not None:
        if require:
            raise BuildConfigError(f"ATTN_EXT_REQUIRE_CUDA=1 but {reason}")
        return BuildPlan("cpu", reason)

    variant = "cuda" if torch.cuda is not None else "force_cuda"
    toolkit, notes = probe(), []
    problem = _toolkit_problem(torch, toolkit, variant == "force_cuda", notes)
    archs, source = _archs(environ, torch, toolkit, notes)  # explicit requests fail even when falling back
    if problem is None and not archs:
        problem = "no architecture is left to compile for (see the notes above); set TORCH_CUDA_ARCH_LIST"
    no_bindings = None if variant == "cuda" else (
        f"built with ATTN_EXT_FORCE_CUDA=1 against torch {torch.version}, a CPU build: the CUDA kernels are compiled "
        "and linked as a build check, without their torch bindings, so none is registered")
    plan = BuildPlan(variant, no_bindings, require_cuda=require, cuda_home=toolkit.root.root, nvcc=toolkit.nvcc,
                     cudart_dir=toolkit.cudart_dir, archs=tuple(archs), arch_source=source,
                     include_after=tuple(toolkit.headers.extra_dirs), notes=notes)
    if problem is not None:
        if variant == "force_cuda":
            raise BuildConfigError(f"ATTN_EXT_FORCE_CUDA=1 but the CUDA kernels cannot be compiled: {problem}")
        return plan.fallback(problem)
    notes.insert(0, f"CUDA toolkit {toolkit.root.root} ({toolkit.root.how}), nvcc {toolkit.version_text}, "
                    f"torch built with CUDA {torch.cuda or 'none (a CPU build)'}")
    return plan
