"""Where the build puts things, and what it tells: the persistent build folder, the build record that
ships with the package, and the build log lines.

pip's editable (PEP 660) builds compile in a fresh temporary folder each time, so torch's ninja build,
incremental by itself, would recompile every unit. Pinning the object folder under the project's
``build/`` keeps ninja's state between builds, so a rebuild compiles only the units whose sources or
headers changed. The folder's name carries everything objects depend on beyond the sources (platform,
Python, torch, CPU-only or CUDA), so that switching between them never mixes objects.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Optional

#: The build record, installed next to attn_ext._C: what was built and why the CUDA kernels were not.
BUILD_INFO_NAME = "_build_info.json"

PREFIX = "attn_ext build: "


def build_temp_dir(project_root: str, platform: str, cache_tag: str, torch_version: str, variant: str) -> str:
    """``build/temp.<platform>-<python>-torch<version>-<variant>`` under ``project_root``."""
    safe_version = "".join(c if c.isalnum() or c in ".+-_" else "_" for c in torch_version)
    return os.path.join(project_root, "build", f"temp.{platform}-{cache_tag}-torch{safe_version}-{variant}")


def build_info(plan, torch_version: str) -> dict:
    """The build record of ``plan`` (a :class:`build_support.plan.BuildPlan`)."""
    return {
        "torch": torch_version,
        "cuda_kernels": plan.variant == "cuda",
        "cuda_reason": plan.cuda_reason,
        "cuda_archs": [str(a) for a in plan.archs] if plan.with_cuda else [],
        "cuda_home": plan.cuda_home if plan.with_cuda else None,
    }


def write_build_info(path: str, info: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(info, handle, indent=1, sort_keys=True)
        handle.write("\n")


def ccache_note(ccache: Optional[str], torch_wraps_compilers: bool, disabled: bool) -> str:
    """Whether compiles go through ccache (recent torch versions run the compilers through it when installed)."""
    if ccache is None:
        return "ccache: not installed (optional; it would also serve rebuilds after deleting build/)"
    if disabled:
        return f"ccache: {ccache} found, but TORCH_NO_COMPILER_WRAPPER is set"
    if torch_wraps_compilers:
        return f"ccache: {ccache} (torch runs the compilers through it)"
    return f"ccache: {ccache} found, but this torch does not use it; the build folder alone keeps rebuilds incremental"


def log(message: str) -> None:
    # stderr, unbuffered: pip shows a build's output with -v, and always when the build fails.
    print(PREFIX + message, file=sys.stderr, flush=True)


def warn_loudly(headline: str, reason: str, advice: str) -> None:
    bar = "!" * 100
    print(f"\n{bar}\n{PREFIX}WARNING: {headline}\n  reason: {reason}\n  {advice}\n{bar}\n", file=sys.stderr, flush=True)


def describe(plan) -> None:
    """Logs the plan: what is built, for which architectures, and the notes explaining the choices."""
    for note in plan.notes:
        log(note)
    if plan.variant == "cuda":
        log(f"building the C++ CPU kernels and the CUDA kernels for {';'.join(map(str, plan.archs))} "
            f"({plan.arch_source})")
    elif plan.variant == "force_cuda":
        log(f"ATTN_EXT_FORCE_CUDA=1: compiling the CUDA kernels for {';'.join(map(str, plan.archs))} "
            f"({plan.arch_source}) and linking them, without their torch bindings")
    elif plan.unexpected:
        warn_loudly("building attn_ext WITHOUT its CUDA kernels (CPU kernels only)", plan.cuda_reason,
                    "The cuda backend will be unavailable. Fix the reason and reinstall, or set "
                    "ATTN_EXT_REQUIRE_CUDA=1 to make this an error.")
    else:
        log(f"building the C++ CPU kernels only: {plan.cuda_reason}")
