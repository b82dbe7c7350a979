"""Record the kernel launches of the Triton launchers for a GPU target, without a GPU: the compile jobs.

While recording, a kernel launch (``JITFunction.run``) stores its arguments instead of compiling and
launching, and an autotuned launch (``Autotuner.run``) goes through Triton's own
``Autotuner.warmup``, which applies the package's pruning (``early_config_prune``, with the target's
shared memory from :mod:`triton_aot_target`) and passes each kept config on to ``JITFunction.run``.
So a job is exactly what a launch on that card would compile: the launcher's arguments, its
constexprs, and one kept config's tiles, warps and stages.

The launchers refuse CPU tensors outside the interpreter (``check_device``); that check is
switched off while recording, since nothing is launched.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import math
import pkgutil
import textwrap
from dataclasses import dataclass

import torch

# attn_ext decorates its Triton kernels (reading TRITON_INTERPRET) when its modules load: triton_aot.main
# imports this module only after clearing it.
import attn_ext.ops as ops
from triton_aot_cases import KERNEL_TARGETS, Case
from triton_aot_target import Target, targeting

__all__ = ["Job", "capture", "dot_kernels", "kernel_hashes", "package_kernels", "uncovered_kernels"]


#: Compile options of a launch (not kernel parameters).
_LAUNCH_OPTIONS = {"num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override"}


@dataclass(frozen=True)
class Job:
    """One compile: ``module.kernel(*args, **options)`` for ``target`` (tensors as ``("tensor", dtype)``)."""
    module: str
    kernel: str
    args: tuple
    options: tuple  # sorted (name, value) pairs: constexprs, num_warps, num_stages, ...
    target: str
    tuned: tuple = ()  # the names in options that an autotune config set (empty: a fixed launch)

    def config(self) -> str:
        """The autotune config (or the fixed launch's tiles) and warps/stages, e.g. ``BLOCK_M=64 BLOCK_N=32 w4 s2``;
        ``w-``/``s-``: Triton's defaults (4 warps, 3 stages)."""
        opts = dict(self.options)
        names = self._tile_names()
        # A config's other choices where set (the TMA forward's persistent grid: PROGRAMS_PER_SM=1), so that two
        # configs of the same tiles read apart.
        others = [k for k in self.tuned if not k.startswith("BLOCK_") and k not in _LAUNCH_OPTIONS and opts.get(k)]
        warps = f"w{opts['num_warps']}" if "num_warps" in opts else "w-"
        stages = f"s{opts['num_stages']}" if "num_stages" in opts else "s-"
        return " ".join([f"{k}={opts[k]}" for k in names + others] + [warps, stages])

    def tile_area(self) -> int:
        """The product of the config's tiles (the autotuned ``BLOCK_*``, or a fixed launch's): what makes a
        config large."""
        opts = dict(self.options)
        return math.prod(opts[k] for k in self._tile_names())

    def _tile_names(self) -> list[str]:
        """The config's tile constexprs: the autotuned ``BLOCK_*``, or a fixed launch's."""
        if self.tuned:
            return [k for k in self.tuned if k.startswith("BLOCK_")]
        return [k for k, _ in self.options if k.startswith("BLOCK_")]

    def variant(self) -> str:
        """The launcher's other constexprs: its code path, e.g. ``HAS_MASK`` or ``BRANCH=4`` (False flags omitted)."""
        flags = [k if v is True else f"{k}={v}" for k, v in self.options
                 if not k.startswith("BLOCK_") and k not in _LAUNCH_OPTIONS and v is not False]
        return " ".join(flags) or "-"

    def fixed_options(self) -> tuple:
        """The options that no autotune config chose: what the launcher derived from the problem."""
        return tuple((k, v) for k, v in self.options if k not in self.tuned)


def _arg_spec(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype).removeprefix("torch."))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a Triton launcher passed an argument of type {type(value).__name__}, which the AOT "
                    "check cannot record; teach triton_aot_capture._arg_spec about it")


def _kernel_modules() -> list:
    """Every ``attn_ext.ops`` module named ``triton*`` (kernels and their shared device functions)."""
    names = [m.name for m in pkgutil.walk_packages(ops.__path__, "attn_ext.ops.")
             if m.name.rsplit(".", 1)[-1].startswith("triton")]
    return [importlib.import_module(name) for name in sorted(names)]


@contextlib.contextmanager
def _recording(records: list):
    # Triton is optional: the triton_aot_* modules import without it (their tests then skip).
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    tuning: list = []  # the names an autotune config sets, while Autotuner.warmup launches its configs

    def record_launch(self, *args, grid, warmup, **kwargs):
        records.append((self, args, kwargs, tuple(tuning)))

    def prune_and_record(self, *args, **kwargs):
        kwargs.pop("warmup", None)  # Autotuner.warmup passes the grid on and sets warmup itself
        tuning[:] = sorted({name for config in self.configs for name in config.all_kwargs()})
        try:
            self.warmup(*args, **kwargs)
        finally:
            tuning.clear()

    saved = [(JITFunction, "run", JITFunction.run), (Autotuner, "run", Autotuner.run)]
    for module in _kernel_modules():
        if hasattr(module, "check_device"):
            saved.append((module, "check_device", module.check_device))
    JITFunction.run, Autotuner.run = record_launch, prune_and_record
    for owner, name, _ in saved[2:]:
        setattr(owner, name, lambda *tensors: None)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def capture(target: Target, cases: list[Case]) -> dict[Job, list[Case]]:
    """The distinct compile jobs of ``cases`` for ``target``, each with the cases that launch it."""
    for module in _kernel_modules():
        # Interpreted kernels launch without JITFunction.run: nothing would be recorded, nothing checked.
        if any(type(value).__name__ == "InterpretedFunction" for value in vars(module).values()):
            raise RuntimeError(f"the Triton kernels of {module.__name__} were built for the interpreter "
                               "(TRITON_INTERPRET=1 when attn_ext was imported); run the AOT check in a fresh "
                               "process without it")
    jobs: dict[Job, list[Case]] = {}
    records: list = []
    with targeting(target), _recording(records):
        for case in cases:
            start = len(records)
            case.call()
            for kernel, args, kwargs, tuned in records[start:]:
                job = Job(kernel.fn.__module__, kernel.fn.__name__, tuple(map(_arg_spec, args)),
                          tuple(sorted(kwargs.items())), target.name, tuned)
                jobs.setdefault(job, []).append(case)
    return jobs


def _call_graph() -> dict[str, tuple[str, set]]:
    """``{name: (module, names it calls)}`` of every ``triton.jit`` function of the ``triton*`` modules."""
    from triton.runtime.jit import JITFunction  # optional, see _recording

    graph = {}
    for module in _kernel_modules():
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and value.fn.__module__ == module.__name__:
                calls = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                         for node in ast.walk(ast.parse(textwrap.dedent(value.src))) if isinstance(node, ast.Call)}
                graph[name] = (module.__name__, calls)
    return graph


def package_kernels() -> dict[str, str]:
    """``{kernel name: module}`` of every Triton kernel of the package: a ``triton.jit`` function of a
    ``triton*`` module that no other ``triton.jit`` function calls (those are device functions)."""
    graph = _call_graph()
    called = set().union(*(calls for _, calls in graph.values()))
    return {name: module for name, (module, _) in graph.items() if name not in called}


def dot_kernels() -> set[str]:
    """The kernels that call ``tl.dot``, directly or through device functions: Triton stages the operands
    of a dot in shared memory, in the input dtype, so their shared memory depends on the element size."""
    graph = _call_graph()

    def reaches_dot(name, seen=()):
        calls = graph.get(name, ("", set()))[1]
        return "dot" in calls or any(reaches_dot(c, (*seen, name)) for c in calls if c in graph and c not in seen)

    return {name for name in package_kernels() if reaches_dot(name)}


def kernel_hashes(jobs) -> dict[tuple[str, str], str]:
    """Triton's source hash of each job's kernel (it covers the device functions the kernel calls)."""
    return {(job.module, job.kernel): getattr(importlib.import_module(job.module), job.kernel).cache_key
            for job in jobs}


def uncovered_kernels(jobs, targets=None) -> list[str]:
    """Kernels of the package that no case launches, as ``module.kernel``; with ``targets`` (names), not those
    that :data:`triton_aot_cases.KERNEL_TARGETS` compiles for other targets only."""
    launched = {(job.module, job.kernel) for job in jobs}
    return sorted(f"{module}.{name}" for name, module in package_kernels().items() if (module, name) not in launched
                  and (targets is None or set(KERNEL_TARGETS.get(name, targets)) & set(targets)))

