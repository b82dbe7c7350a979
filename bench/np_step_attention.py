"""The attention of an NP training step, for ``python -m bench run np_step``: how much of the step it takes,
and attn_ext's attention against PyTorch's SDPA on the very calls the step makes.

A training step of the reference models is mostly linear layers, layer norms and the optimizer; attention is
a fifth to a third of it (:func:`attention_share`). The step's time ratio against the torch twin therefore
says little about attention: even a kernel twice as fast as SDPA moves it by a tenth at most. What attention
decides is measured here directly:

* :func:`record_calls` runs one step with attn_ext's dispatch (:func:`attn_ext.ops.utils.dispatch.entry`, through
  which every public op reaches its kernel) wrapped, and keeps each softmax-attention call
  (:data:`ATTENTION_OPS`: ``cross_attention``, which :class:`attn_ext.nn.MultiheadAttention`'s state path and
  the attention states run, and ``scaled_dot_product_attention``, its masked path) with its tensors (detached
  copies with their strides, ``requires_grad`` as they came) and the other arguments, as the public function
  had checked and converted them. Calls of the other ops (tree attention, Intention, state merges) are counted,
  not replayed.
* :func:`replay` runs the recorded calls again, forward and backward (the gradients of every input that required
  one, for a fixed random gradient of the output): through attn_ext's public op (:func:`ours_call`, so its
  argument checks and dispatch count too), or through ``torch.nn.functional.scaled_dot_product_attention`` on
  the same tensors (:func:`sdpa_call`: the key padding mask and the causal flag folded into ``attn_mask`` where
  SDPA needs that). The caller times the two interleaved; :func:`check_replay` first checks that they agree.
* :func:`attention_share` profiles whole steps (``torch.profiler``, CPU) and sums the time inside attn_ext's
  ops (every ``attn_ext::`` op event not inside another): forward and backward kernels, not the Python front
  end around them (microseconds per call).
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

import attn_ext
from attn_ext.ops.utils import dispatch

#: Profiler events of attn_ext's ops start with this (``torch.ops.attn_ext.<name>``).
OP_PREFIX = "attn_ext::"
#: The dispatched ops that are softmax attention, and so have an SDPA call to compare with.
ATTENTION_OPS = ("cross_attention", "scaled_dot_product_attention")


@dataclass
class Call:
    """One recorded dispatch of a softmax-attention op: ``op``, ``backend`` and the kernel's arguments
    (tensors copied, strides kept); ``grad_out`` is the fixed output gradient of the replays."""

    op: str
    backend: str
    args: tuple
    grad_out: Optional[Tensor] = None

    @property
    def qkv(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.args[0], self.args[1], self.args[2]

    def leaves(self) -> list[Tensor]:
        """The inputs a replay differentiates: the tensors that required grad when recorded."""
        return [t for t in self.args if isinstance(t, Tensor) and t.requires_grad]


def _copy(t):
    """A detached copy of a tensor with its strides, requiring grad as it did (other values as they are)."""
    if not isinstance(t, Tensor):
        return t
    return t.detach().clone().requires_grad_(t.requires_grad and t.is_floating_point())


@contextmanager
def _recording(calls: list[Call], counts: dict[str, int]) -> Iterator[None]:
    """attn_ext's dispatch wrapped for the block: the softmax-attention calls appended to ``calls``, every op
    dispatched counted in ``counts``."""
    original = dispatch.entry

    def entry(op: str, backend: str):
        kernel = original(op, backend)

        def recorded(*args):
            counts[op] = counts.get(op, 0) + 1
            if op in ATTENTION_OPS:
                calls.append(Call(op, backend, tuple(_copy(a) for a in args)))
            return kernel(*args)

        return recorded

    dispatch.entry = entry
    try:
        yield
    finally:
        dispatch.entry = original


def record_calls(step: Callable[[], object], seed: int = 0) -> tuple[list[Call], dict[str, int]]:
    """The softmax-attention calls of one ``step()`` (which it takes: an optimizer step included), each with a
    random output gradient drawn from ``seed``, and how many times the step dispatched each op."""
    calls: list[Call] = []
    counts: dict[str, int] = {}
    with _recording(calls, counts):
        step()
    g = torch.Generator().manual_seed(seed)
    for call in calls:
        with torch.no_grad():
            out = ours_call(call)
        call.grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return calls, counts


#: The attention op's arguments after its first ten, at their defaults (no window, alignment offset, softcap,
#: ALiBi or packed batch): what the NP models' calls pass, and all the replays below understand.
_DEFAULT_EXTRA_ARGS = (-1, -1, 0, 0.0, None, None, None, False)


def _sdpa_args(call: Call) -> tuple:
    """The first ten arguments of a recorded ``attention_fwd`` call; raises if it used any of the others."""
    extra = tuple(call.args[10:])
    if extra != _DEFAULT_EXTRA_ARGS[:len(extra)]:
        raise ValueError(f"np_step_attention: a recorded attention call used a window, softcap, ALiBi or a packed "
                         f"batch ({extra}), which the replay does not reproduce")
    return tuple(call.args[:10])


def ours_call(call: Call) -> Tensor:
    """attn_ext's public op on the call's arguments: the output (the lse the kernels return alongside is not
    used by the modules' calls, so its gradient is zero, as in the step)."""
    if call.op == "cross_attention":
        q, k, v, padding, scale, chunk_size = call.args
        return attn_ext.cross_attention(q, k, v, key_padding_mask=padding, scale=scale, chunk_size=chunk_size,
                                        backend=call.backend)
    q, k, v, mask, padding, scale, is_causal, dropout_p, _seed, chunk_size = _sdpa_args(call)
    return attn_ext.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                                 scale=scale, enable_gqa=q.shape[1] != k.shape[1],
                                                 key_padding_mask=padding, chunk_size=chunk_size, backend=call.backend)


def _sdpa_mask(L: int, S: int, mask: Optional[Tensor], padding: Optional[Tensor], is_causal: bool,
               device) -> tuple[Optional[Tensor], bool]:
    """``(attn_mask, is_causal)`` for SDPA: ``padding`` [B, S] (True = padding) and, with it, the causal flag
    folded into a mask (SDPA takes no mask beside ``is_causal``)."""
    if padding is None:
        return mask, is_causal
    keep = ~padding[:, None, None, :]
    if is_causal:
        mask = torch.ones(L, S, dtype=torch.bool, device=device).tril()
    if mask is None:
        return keep, False
    if mask.dtype == torch.bool:
        return mask & keep, False
    return mask.masked_fill(~keep, -math.inf), False


def sdpa_call(call: Call) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` computing what the call computes."""
    if call.op == "cross_attention":
        q, k, v, padding, scale, _ = call.args
        mask, _ = _sdpa_mask(q.shape[-2], k.shape[-2], None, padding, False, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    q, k, v, mask, padding, scale, is_causal, dropout_p, _, _ = _sdpa_args(call)
    mask, is_causal = _sdpa_mask(q.shape[-2], k.shape[-2], mask, padding, is_causal, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def replay(calls: list[Call], attention: Callable[[Call], Tensor]) -> None:
    """Every call forward and backward (to the inputs that required grad) with ``attention``."""
    for call in calls:
        out = attention(call)
        leaves = call.leaves()
        if leaves:
            torch.autograd.grad(out, leaves, call.grad_out)


def _double(call: Call) -> Call:
    """The call on fp64 copies of its floating-point tensors."""
    args = tuple(a.detach().double().requires_grad_(a.requires_grad) if isinstance(a, Tensor) and a.is_floating_point()
                 else a for a in call.args)
    return Call(call.op, call.backend, args, call.grad_out.double())


def check_replay(calls: list[Call]) -> float:
    """The largest difference between attn_ext's and SDPA's outputs and input gradients over the calls, on fp64
    copies (in fp32 both are ~1e-4 from the exact ``dq`` of these small, peaked problems), each relative to the
    largest entry of SDPA's tensor: the two replays compute the same attention when the masks are folded right.
    Calls with dropout draw different masks and are skipped."""
    worst = 0.0
    for call in calls:
        if call.op == "scaled_dot_product_attention" and call.args[7] > 0:
            continue
        call, got = _double(call), []
        for attention in (ours_call, sdpa_call):
            out = attention(call)
            leaves = call.leaves()
            grads = torch.autograd.grad(out, leaves, call.grad_out) if leaves else ()
            got.append([out.detach(), *grads])
        for a, b in zip(*got):
            if b.numel():
                worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item())
    return worst


def _outermost_op_time_us(events) -> float:
    """CPU time inside attn_ext's op events, counting an event inside another attn_ext event once."""
    total = 0.0
    for event in events:
        if not event.name.startswith(OP_PREFIX):
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith(OP_PREFIX):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            total += event.cpu_time_total
    return total


@contextmanager
def _stderr_silenced() -> Iterator[None]:
    """File descriptor 2 pointed at /dev/null for the block (what C++ writes there included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
    finally:
        os.close(saved)


def attention_share(step: Callable[[], object], steps: int) -> dict:
    """``steps`` calls of ``step()`` under ``torch.profiler`` (CPU): ``{"share", "op_ms", "step_ms", "steps"}``,
    ``share`` the fraction of the steps' wall time spent inside attn_ext's ops, the times per step (both
    include the profiler's own overhead, which is small at these sizes)."""
    with _stderr_silenced():  # this torch build's profiler prints a line to stderr when it starts and stops
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            wall_us = (time.perf_counter() - start) * 1e6
    op_us = _outermost_op_time_us(prof.events())
    return {"share": op_us / wall_us, "op_ms": op_us / 1e3 / steps, "step_ms": wall_us / 1e3 / steps,
            "steps": steps}
