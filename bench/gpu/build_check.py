"""After stage "build" of ``make gpu-check``: is the extension just built the one imported, does it hold
every CUDA kernel, and can they run on this card?

- ``attn_ext`` must be imported from this checkout (not another install), with ``attn_ext._C`` loaded;
- every op that ``csrc/cuda/bindings/registration.cpp`` registers (``m.impl("name", ...)``) must have a
  CUDA kernel in the dispatcher: a build that silently left the CUDA part out (torch or nvcc not found)
  would otherwise pass the tests by skipping them;
- the extension must carry machine code the card can run: a cubin of the same major version and a minor
  version no higher, or PTX of a capability no higher (``cuobjdump --list-elf / --list-ptx``; skipped with a
  note when cuobjdump is missing). Without one every CUDA kernel launch fails with "no kernel image".

Exit status 0 when all hold, 1 otherwise, with the reason.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import attn_ext
from attn_ext.ops.utils.extension import extension_error

ROOT = Path(__file__).resolve().parents[2]
REGISTRATION = ROOT / "csrc" / "cuda" / "bindings" / "registration.cpp"


def registered_cuda_ops(source: Path = REGISTRATION) -> list[str]:
    """Names the CUDA registration file binds, in its order."""
    return re.findall(r'm\.impl\("(\w+)"', source.read_text())


def images(listing: str) -> list[tuple[str, int]]:
    """``[("elf" | "ptx", capability as major*10+minor)]`` from ``cuobjdump --list-elf``/``--list-ptx`` output
    (names such as ``_C.1.sm_90.cubin``, ``_C.2.sm_80.ptx``). Arch-specific targets (``sm_90a``) run on
    exactly that chip and are listed with their number like the others."""
    found = []
    for kind, number in re.findall(r"(ELF|PTX) file\s+\d+:\s*\S*?sm_(\d+)", listing):
        found.append((kind.lower(), int(number)))
    return found


def runnable_on(found: list[tuple[str, int]], major: int, minor: int) -> str | None:
    """The first image that runs on capability ``major.minor`` (as ``"sm_90 cubin"``), or None.

    A cubin runs on the same major version with an equal or higher minor; PTX is compiled by the driver
    for any capability at or above its own."""
    cap = 10 * major + minor
    for kind, number in found:
        if kind == "elf" and number // 10 == major and number % 10 <= minor:
            return f"sm_{number} cubin"
    for kind, number in found:
        if kind == "ptx" and number <= cap:
            return f"compute_{number} PTX"
    return None


def _cuobjdump(extension: Path, cuda_home: str | None) -> str | None:
    tool = shutil.which("cuobjdump") or (f"{cuda_home}/bin/cuobjdump" if cuda_home else None)
    if tool is None or not Path(tool).exists():
        return None
    out = []
    for flag in ("--list-elf", "--list-ptx"):
        done = subprocess.run([tool, flag, str(extension)], capture_output=True, text=True, timeout=120)
        out.append(done.stdout)
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cuda-home", default=None)
    args = parser.parse_args(argv)

    problems = []
    location = Path(attn_ext.__file__).resolve().parent
    print(f"attn_ext imported from {location}")
    if location != ROOT / "attn_ext":
        problems.append(f"attn_ext was imported from {location}, not from this checkout ({ROOT / 'attn_ext'}): "
                        "uninstall the other copy or run from the checkout's root")
    error = extension_error()
    if error is not None:
        problems.append(error)
    else:
        missing = [op for op in registered_cuda_ops()
                   if not torch._C._dispatch_has_kernel_for_dispatch_key(f"attn_ext::{op}", "CUDA")]
        print(f"CUDA kernels registered: {len(registered_cuda_ops()) - len(missing)} of {len(registered_cuda_ops())}")
        if missing:
            problems.append(f"no CUDA kernel registered for {', '.join(missing)}: the extension was built without its "
                            "CUDA part (is torch a CUDA build, nvcc on PATH, CUDA_HOME right? see build.log)")
        extension = Path(attn_ext._C.__file__)
        listing = _cuobjdump(extension, args.cuda_home)
        if listing is None:
            print("cuobjdump not found: the card's machine code in the extension was not checked")
        else:
            found = images(listing)
            print("images in the extension: " + (", ".join(f"{k} sm_{n}" for k, n in sorted(set(found))) or "none"))
            major, minor = torch.cuda.get_device_capability()
            usable = runnable_on(found, major, minor)
            if usable is None:
                problems.append(f"the extension has no cubin or PTX that runs on compute capability {major}.{minor} "
                                f"({torch.cuda.get_device_name()}): every CUDA kernel would fail with 'no kernel "
                                "image is available'; the build ignored TORCH_CUDA_ARCH_LIST")
            else:
                print(f"this card ({major}.{minor}) runs the {usable}")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
