"""Compile one AOT job for its GPU target and read what the compiler decided; a persistent result cache.

The compile is the one a launch on that card performs: ``JITFunction.run(..., warmup=True)`` with
the target's stand-in driver active, so Triton itself derives the signature (pointer dtypes, integer
widths), the constexprs and the 16-byte alignment specialisations from the recorded arguments and
calls ``triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", cc, 32))``.
Tensors are rebuilt as one-element CPU tensors of the recorded dtype: only their dtype and the
alignment of their address (16 bytes, as every allocation of torch's CUDA allocator) enter the compile.

Registers and spills are read from the cubin with the ``cuobjdump`` that Triton bundles (on a GPU,
Triton asks the driver for them when it loads the kernel); shared memory is Triton's own
``metadata.shared``, the dynamic shared memory the launch requests. The same ``cuobjdump -sass``
gives the kernel's machine code, kept as its opcode counts (:mod:`sass_opcodes`), which the machine-code
criteria (:mod:`sass_criteria`) judge.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

import torch

from sass_opcodes import COUNTS, opcode_counts, split_functions
from triton_aot_target import TARGETS, targeting

__all__ = ["ResultCache", "compile_job", "job_key", "resource_usage"]

#: Part of every cache key, with sass_opcodes.COUNTS (a new count recompiles by itself): raise it when a result
#: gains a field or a count is read differently, so that cached results recompile (2: "sass", the opcode counts).
RESULT_VERSION = 2

_FUNCTION = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(dump: str, name: str) -> dict:
    """``{"regs", "stack", "local"}`` of kernel ``name`` in ``cuobjdump --dump-resource-usage`` output."""
    for function, regs, stack, _static_shared, local in _FUNCTION.findall(dump):
        if function == name:
            return {"regs": int(regs), "stack": int(stack), "local": int(local)}
    raise ValueError(f"cuobjdump reports no function {name!r}:\n{dump}")


def _cuobjdump() -> str:
    # Triton is optional: the triton_aot_* modules import without it (their tests then skip).
    import triton

    try:
        from triton import knobs

        return knobs.nvidia.cuobjdump.path
    except (ImportError, AttributeError):  # Triton before its knobs: the bundled binary
        return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


def _cuobjdump_runs(cubin: bytes, *flags: str) -> list[str]:
    """The output of ``cuobjdump <flag> cubin`` for each flag."""
    outputs = []
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        for flag in flags:
            done = subprocess.run([_cuobjdump(), flag, f.name], capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"cuobjdump {flag} failed ({done.returncode}): {done.stderr.strip()}")
            outputs.append(done.stdout)
    return outputs


def _cubin_findings(cubin: bytes, name: str) -> dict:
    """Registers, stack and local memory of kernel ``name``, and its opcode counts as ``"sass"``."""
    usage, sass = _cuobjdump_runs(cubin, "--dump-resource-usage", "-sass")
    functions = split_functions(sass)
    if name not in functions:
        raise ValueError(f"cuobjdump -sass shows no function {name!r} (it shows {', '.join(functions) or 'none'})")
    return {**resource_usage(usage, name), "sass": opcode_counts(functions[name])}


def _materialise(spec):
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and spec[0] == "tensor":
        return torch.empty(1, dtype=getattr(torch, spec[1]))
    return spec


def compile_job(job: dict) -> dict:
    """Compile ``job`` (a :class:`triton_aot_capture.Job` as a dict) for its target.

    Returns ``{"regs", "stack", "local", "shared", "num_warps", "num_stages", "sass", "seconds"}`` (``"sass"``:
    the kernel's :func:`sass_opcodes.opcode_counts`), or
    ``{"error", "seconds"}`` when the compile fails (any exception: the message is the finding).
    """
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            # Triton 3.9 warns on every compile that its fp-fusion default will change; the launches
            # of the package get that same default, so the compile here keeps it too.
            warnings.filterwarnings("ignore", message=".*TRITON_DEFAULT_FP_FUSION.*")
            kernel = getattr(importlib.import_module(job["module"]), job["kernel"])
            args = [_materialise(a) for a in job["args"]]
            with targeting(TARGETS[job["target"]]):
                compiled = kernel.run(*args, grid=(1,), warmup=True, **dict(job["options"]))
        meta = compiled.metadata
        result = _cubin_findings(compiled.asm["cubin"], meta.name)
        result.update(shared=int(meta.shared), num_warps=int(meta.num_warps), num_stages=int(meta.num_stages))
    except Exception as exc:  # noqa: BLE001 - every failure to compile is reported, none is fatal here
        text = f"{type(exc).__name__}: {exc}".strip()
        result = {"error": text if len(text) < 4000 else text[:4000] + " ..."}
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def job_key(job: dict, kernel_hash: str) -> str:
    """Cache key: the job, the kernel's source hash (Triton's, which covers the device functions it
    calls), the Triton version, a ptxas override if any, :data:`RESULT_VERSION` and the names of the
    opcode counts; a change to any of them recompiles."""
    import triton  # optional, see _cuobjdump

    text = json.dumps([job, kernel_hash, triton.__version__, os.environ.get("TRITON_PTXAS_PATH", ""),
                       RESULT_VERSION, COUNTS],
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class ResultCache:
    """Results of successful compiles, one JSON file per key (failures are always compiled again)."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def get(self, key: str) -> dict | None:
        if self.directory is None:
            return None
        path = self.directory / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, result: dict) -> None:
        if self.directory is None or "error" in result:
            return
        path = self.directory / f"{key}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)  # atomic: a concurrent run never reads half a file
