"""From ``cuobjdump`` output of one CUDA object and architecture to the machine-code report's rows.

Pure text processing (no nvcc, no cuobjdump): :mod:`cuda_sass` runs the tools and hands their output
here. Each kernel instantiation becomes one :class:`sass_criteria.SassRow`: ``kernel`` a short family
name (``attention_fwd_wmma``), ``config`` its template arguments spelled out (``bf16 D=64 w4 masks``),
``counts`` its :func:`sass_opcodes.opcode_counts`, ``resources`` registers, stack, static shared and
local memory (``cuobjdump --dump-resource-usage``) and, where a ptxas ``-v`` log is at hand, the spilled
bytes.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from typing import Iterable, Mapping

from sass_criteria import SassRow
from sass_opcodes import opcode_counts, split_functions

# Function _Z...: \n REG:110 STACK:0 SHARED:1024 LOCAL:0 ...
_USAGE = re.compile(r"Function (\S+?):?\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
# "void attn_ext::cuda::detail::cross_attention_fwd_wmma_kernel<__nv_bfloat16, 64, 4, true>(...)": the
# qualified name, its template arguments, the parameter list.
_DEMANGLED = re.compile(r"^(?:void\s+)?([^<(]+)(?:<(.*)>)?\s*\(.*\)$")
_DTYPES = {"__nv_bfloat16": "bf16", "__half": "fp16", "float": "fp32", "double": "fp64"}

# How each kernel's template arguments read in a row's config, in order: "dtype" (the element type),
# "X{}" (the value into a pattern), "yes|no" (a bool: the word for true, for false; "" leaves it out).
# The requirements of cuda_sass_criteria match these configs, so a kernel whose arguments change must
# change here. A kernel missing here is still reported, its arguments as they are.
_TEMPLATE_ARGS: Mapping[str, tuple[str, ...]] = {
    "attention_fwd_wmma": ("dtype", "D={}", "w{}", "masks|"),
    "attention_fwd_mma": ("dtype", "D={}", "masks|"),
    "attention_bwd_mma": ("dtype", "D={}", "dkdv|dq", "masks|"),  # kKeyTile: the dK/dV or the dQ kernel
    "attention_fwd": ("dtype", "D={}", "Dv={}", "rows{}", "w{}", "masks|"),
    "attention_bwd_wmma": ("dtype", "D={}", "w{}", "dkdv|dq", "masks|"),  # kKeyTile: the dK/dV or the dQ kernel
    "attention_bwd_dkdv": ("dtype", "tile{}", "masks|"),
    "attention_bwd_dq": ("dtype", "tile{}", "masks|"),
    "attention_bwd_delta": ("dtype",),
    "merge_states_fwd": ("dtype",),
}


def _split_args(text: str) -> list[str]:
    """Top-level template arguments (commas inside nested <...> or (...) stay)."""
    args, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif ch == "," and depth == 0:
            args.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    return args + [tail] if tail else args


def _spell(spec: str, arg: str) -> str:
    if spec == "dtype":
        return _DTYPES.get(arg, arg)
    if "|" in spec:
        yes, no = spec.split("|")
        return {"true": yes, "false": no}.get(arg, arg)
    return spec.format(arg)


def kernel_and_config(demangled: str) -> tuple[str, str]:
    """``("attention_fwd_wmma", "bf16 D=64 w4 masks")`` from a demangled kernel name: namespaces, ``cross_``,
    ``_kernel`` and the parameter list dropped, the template arguments named by :data:`_TEMPLATE_ARGS`."""
    match = _DEMANGLED.match(demangled.replace("(anonymous namespace)::", "").strip())
    if not match:
        return demangled.strip(), ""
    name = match.group(1).strip().rsplit("::", 1)[-1].removeprefix("cross_").removesuffix("_kernel")
    args = _split_args(match.group(2) or "")
    if name in _TEMPLATE_ARGS:
        specs = _TEMPLATE_ARGS[name]
    else:  # a kernel not described yet: its arguments as they are (the first, by convention, the dtype)
        specs = ("dtype",) + ("{}",) * (len(args) - 1) if args else ()
    if len(specs) != len(args):  # the kernel's template changed: show what it is, judged as a new kernel
        return name + f"<{len(args)} args>", " ".join(_DTYPES.get(a, a) for a in args)
    return name, " ".join(word for word in (_spell(s, a) for s, a in zip(specs, args)) if word)


def demangle(names: Iterable[str]) -> dict[str, str]:
    """``{mangled: demangled}`` through ``c++filt`` (binutils, beside every host compiler nvcc uses)."""
    names = list(names)
    tool = shutil.which("c++filt")
    if tool is None:
        raise RuntimeError("c++filt not found (binutils): the kernel names cannot be read")
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``{mangled: {"regs", "stack", "shared", "local"}}`` of a ``cuobjdump --dump-resource-usage`` output
    (one architecture). ``shared`` is static shared memory; on sm_90 the ELF counts the 1 KiB that the
    hardware reserves per block in it, so it reads 1024 where ptxas says 0."""
    return {m.group(1): dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups()[1:])))
            for m in _USAGE.finditer(text)}


def rows(sass: str, usage: str, target: str, names: Mapping[str, str],
         spills: Mapping[str, tuple[int, int]] | None = None) -> list[SassRow]:
    """One row per kernel of a ``cuobjdump -sass`` dump and its ``--dump-resource-usage`` (the same object,
    one architecture, ``target``). ``names``: mangled to demangled; ``spills``: mangled to (spill store,
    spill load) bytes from ptxas, where known (``resources`` then has ``spill_stores``/``spill_loads``)."""
    usage_of = resource_usage(usage)
    out = []
    for mangled, code in split_functions(sass).items():
        kernel, config = kernel_and_config(names.get(mangled, mangled))
        resources = dict(usage_of.get(mangled, {}))
        if spills is not None and mangled in spills:
            resources["spill_stores"], resources["spill_loads"] = spills[mangled]
        out.append(SassRow(kernel, target, config, opcode_counts(code), resources))
    return out
