"""Which kernel runs a call: one table of every op's backends, each declaring what it supports.

Every public op declares, per backend, an :class:`Implementation`: the ``torch.ops.attn_ext`` kernel
it calls (None for the pure-PyTorch code of the op's own module) and the op-specific requirements
that can rule it out for a call (head dims beyond a Triton tile, a callable reducer, ...). On top,
each backend has requirements of its own (device, dtype, a compiled extension, Triton installed).
:func:`rejection_reasons` asks all of them, so a backend that cannot run a call always comes with the
reason, and :func:`select_backend` is the only place a backend is chosen:

1. the ``backend=`` argument; a backend that cannot run the call raises ``RuntimeError`` listing
   every backend's reason;
2. else the ``ATTN_EXT_BACKEND`` environment variable, with the same rule, except that it is
   ignored by ops that have no implementation on the backend it names (it is process-wide);
3. else the automatic order of the device (CPU: ``cpp``; CUDA: ``triton``, then ``cuda``), with
   ``reference`` as last resort.

``cpp`` and ``cuda`` are the same compiled ``torch.ops.attn_ext`` kernels, which dispatch on the
device: the C++ kernels for CPU tensors, the hand-written CUDA kernels (present only when the
extension was built against a CUDA build of torch) for CUDA tensors. The CUDA kernels have been
compiled, emulated on the host and tested on a GPU only in part so far, so on CUDA the automatic
order prefers Triton.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from attn_ext.ops.utils import extension
from attn_ext.ops.utils.autograd import fast_entry, functorch_entry
from attn_ext.ops.utils.triton import triton_unavailable_reason

BACKENDS = ("cpp", "cuda", "triton", "reference")
#: Backends whose kernels are the compiled ``torch.ops.attn_ext`` ops (dispatched on the device).
COMPILED_BACKENDS = ("cpp", "cuda")
AUTOMATIC_ORDER = {"cpu": ("cpp", "reference"), "cuda": ("triton", "cuda", "reference")}
ENVIRONMENT_VARIABLE = "ATTN_EXT_BACKEND"

#: ``requirement(x, context)`` returns None when it is met, else the reason; ``x`` is the call's first
#: tensor argument, ``context`` the other facts of the call the op passes to :func:`select_backend`.
Requirement = Callable[[Tensor, Mapping[str, Any]], Optional[str]]


@dataclass(frozen=True)
class Implementation:
    """How one backend runs one op.

    Attributes
    ----------
    kernel : str, callable or None
        Name of the forward op in ``torch.ops.attn_ext`` (its backward is registered as its autograd), or
        the Python function that op was defined with (its name is then taken from it), or None when the
        op's own module runs PyTorch code.
    requires : tuple of Requirement
        Op-specific conditions, checked after the backend's own (device, dtype, build).
    """

    kernel: Union[str, Callable, None] = None
    requires: Tuple[Requirement, ...] = ()
    #: The Python function that implements the op (a Python backend's, defined with
    #: :func:`~attn_ext.ops.utils.registration.define_op`); None for the compiled kernels (C++).
    function: Optional[Callable] = field(default=None, compare=False)

    def __post_init__(self) -> None:
        # A Python backend is declared by its function (an editor follows it to the kernel); the table
        # keeps the op name it was defined under.
        if callable(self.kernel):
            object.__setattr__(self, "function", self.kernel)
            object.__setattr__(self, "kernel", self.kernel.op_name)


#: public op name -> backend -> implementation; filled by each op family's ``registration`` module.
OPS: Dict[str, Dict[str, Implementation]] = {}


def declare(op: str, **implementations: Implementation) -> str:
    """Declares the backends of ``op`` (keyword per backend name); a backend left out cannot run it. Returns
    ``op``, for the front end to dispatch with a name whose definition shows its backends."""
    unknown = set(implementations) - set(BACKENDS)
    if unknown:
        raise ValueError(f"attn_ext: {op} declares unknown backends {sorted(unknown)}")
    OPS[op] = dict(implementations)
    return op


def kernel(op: str, backend: str):
    """The ``torch.ops.attn_ext`` forward op that ``backend`` runs ``op`` with (under ``torch.func``
    transforms, the entry point that lets them differentiate it: see :func:`functorch_entry`)."""
    return functorch_entry(getattr(torch.ops.attn_ext, _kernel_name(op, backend)))


def entry(op: str, backend: str):
    """What the public functions call: :func:`kernel`'s op with its autograd, the cheapest way each call
    allows (:func:`~attn_ext.ops.utils.autograd.fast_entry`). Same results as calling the op."""
    return fast_entry(_kernel_name(op, backend))


def _kernel_name(op: str, backend: str) -> str:
    name = OPS[op][backend].kernel
    if name is None:
        raise RuntimeError(f"attn_ext: {op} on backend {backend!r} is PyTorch code, not a kernel")
    return name


def backward_kernel(op: str, backend: str):
    """The backward op of :func:`kernel`'s: ``<op>_fwd[_<backend>]`` has ``<op>_bwd[_<backend>]``."""
    name = OPS[op][backend].kernel
    if name is None or "_fwd" not in name:
        raise RuntimeError(f"attn_ext: {op} on backend {backend!r} has no backward op of its own")
    return getattr(torch.ops.attn_ext, name.replace("_fwd", "_bwd", 1))


def _compiled_reason(backend: str, x: Tensor, kernel_name: Optional[str]) -> Optional[str]:
    error = extension.extension_error()
    if error is not None:
        return error
    device_type, key = ("cpu", "CPU") if backend == "cpp" else ("cuda", "CUDA")
    if x.device.type != device_type:
        other = "'cuda' is the compiled kernels for CUDA" if backend == "cpp" else "'cpp' is the compiled kernels for CPU"
        return f"the {'C++' if backend == 'cpp' else 'CUDA'} kernels run on {device_type.upper()} tensors, got {x.device} ({other})"
    # Per op: a build may carry CUDA kernels for some op families and not others. (Every CPU kernel is
    # registered with the extension, and asking torch here would break torch.compile's graph on CPU.)
    if backend == "cuda" and kernel_name is not None and \
            not torch._C._dispatch_has_kernel_for_dispatch_key(f"attn_ext::{kernel_name}", key):
        why = extension.cuda_build_reason() or ("it was compiled against a torch without CUDA, or before that kernel "
                                                "existed; reinstall with a CUDA build of torch and nvcc on PATH")
        return f"this build of attn_ext has no {key} kernel for attn_ext::{kernel_name} ({why})"
    if backend == "cuda" and x.dtype == torch.float64:
        return "the CUDA kernels take float16, bfloat16 or float32, not float64"
    return None


def _triton_reason(x: Tensor) -> Optional[str]:
    reason = triton_unavailable_reason(x.device)
    if reason is None and x.dtype == torch.float64:
        reason = "Triton kernels take float16, bfloat16 or float32, not float64"
    return reason


def _backend_reason(backend: str, x: Tensor, implementation: Implementation) -> Optional[str]:
    if backend in COMPILED_BACKENDS:
        return _compiled_reason(backend, x, implementation.kernel)
    if backend == "triton":
        return _triton_reason(x)
    return None


def _resolve_op(op: str) -> str:
    """A public op name, or (for callers of the old interface) the schema name of one of its kernels."""
    if op in OPS:
        return op
    schema = op.split("::")[-1]
    for name, implementations in OPS.items():
        if any(impl.kernel == schema for impl in implementations.values()):
            return name
    raise ValueError(f"attn_ext: unknown op {op!r}; ops with backends: {', '.join(sorted(OPS))}")


def _reason(op: str, backend: str, x: Tensor, context: Mapping[str, Any]) -> Optional[str]:
    """None if ``backend`` can run ``op`` (a resolved public name) on inputs like ``x``, else why not."""
    implementation = OPS[op].get(backend)
    if implementation is None:
        return f"attn_ext has no {backend} implementation of {op}"
    reason = _backend_reason(backend, x, implementation)
    for requirement in implementation.requires:
        if reason is not None:
            break
        reason = requirement(x, context)
    return reason


def rejection_reasons(op: str, x: Tensor, **context: Any) -> Dict[str, Optional[str]]:
    """For each backend, None if it can run ``op`` on inputs like ``x`` (and ``context``), else why not."""
    op = _resolve_op(op)
    return {backend: _reason(op, backend, x, context) for backend in BACKENDS}


def available_backends(q: Tensor, op: str = "cross_attention", **context: Any) -> Dict[str, Optional[str]]:
    """``{backend: None or the reason it cannot run}`` for ``op`` on inputs like ``q``.

    ``op`` is a public op name (``"cross_attention"``, ``"merge_states"``, ``"tree_cross_attention"``,
    ``"tree_aggregate"``, ``"intention"``, ``"sigma_intention"``, ``"batched_cholesky"``, ...).
    """
    return rejection_reasons(op, q, **context)


# os.environ.get costs close to a microsecond (it encodes the key and decodes the value), a tenth of a
# small call's whole budget; the mapping under it is read directly where it has the POSIX layout.
_ENVIRON_DATA = getattr(os.environ, "_data", None)
_ENVIRON_KEY = os.environ.encodekey(ENVIRONMENT_VARIABLE) if hasattr(os.environ, "encodekey") else None


def _environment_backend() -> Optional[str]:
    """The value of ``ATTN_EXT_BACKEND`` now (it may change while Python runs), or None."""
    if isinstance(_ENVIRON_DATA, dict) and _ENVIRON_KEY is not None:
        value = _ENVIRON_DATA.get(_ENVIRON_KEY)
        return None if value is None else os.environ.decodevalue(value)
    return os.environ.get(ENVIRONMENT_VARIABLE)


def select_backend(op: str, requested: Optional[str], x: Tensor, **context: Any) -> str:
    """The backend that runs this call of ``op``; raises RuntimeError if a requested one cannot."""
    op = _resolve_op(op)
    from_environment = requested is None or requested == "auto"
    if from_environment:
        requested = _environment_backend() or "auto"
    if requested != "auto" and requested not in BACKENDS:
        raise ValueError(f"attn_ext.{op}: unknown backend {requested!r}; choose one of {', '.join(BACKENDS)} or 'auto'")
    if from_environment and requested != "auto" and requested not in OPS[op]:
        requested = "auto"  # the process-wide preference names a backend this op does not have
    # Only the backends the choice needs are asked; every reason is formatted only for an error.
    if requested != "auto":
        if _reason(op, requested, x, context) is None:
            return requested
        reasons = rejection_reasons(op, x, **context)
        listing = "; ".join(f"{name}: {reason or 'available'}" for name, reason in reasons.items())
        raise RuntimeError(f"attn_ext.{op}: backend {requested!r} cannot run on {x.device} {x.dtype} inputs ({listing})")
    for name in AUTOMATIC_ORDER.get(x.device.type, ()) + ("reference",):
        if _reason(op, name, x, context) is None:
            return name
    reasons = rejection_reasons(op, x, **context)
    listing = "; ".join(f"{name}: {reason}" for name, reason in reasons.items())
    raise RuntimeError(f"attn_ext.{op}: no backend can run on {x.device} {x.dtype} inputs ({listing})")
