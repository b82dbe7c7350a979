"""A GPU target for Triton on a machine without a GPU: the compute capability and the shared-memory
limit of sm_80 / sm_90, presented to Triton as its active driver.

Triton asks its active driver for the target to compile for (``get_current_target``) and the
package's autotune pruning asks it for the device's shared memory (``utils.get_device_properties``).
A stand-in driver answering both for a chosen card lets the launchers run their real argument
construction and pruning, and lets ``JITFunction.run(..., warmup=True)`` compile for that card,
without a CUDA driver. Nothing is ever launched through it (no stream, no device memory).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

__all__ = ["TARGETS", "Target", "targeting"]


@dataclass(frozen=True)
class Target:
    name: str
    capability: int
    #: ``cudaDevAttrMaxSharedMemoryPerBlockOptin`` of the card class (bytes): what Triton's driver
    #: reports as ``max_shared_mem`` and the most one block may use.
    max_shared: int
    multiprocessors: int


#: A100 (sm_80: 163 KiB opt-in) and H100 (sm_90: 227 KiB opt-in).
TARGETS = {
    "sm_80": Target("sm_80", 80, 166912, 108),
    "sm_90": Target("sm_90", 90, 232448, 132),
}


class _Utils:
    def __init__(self, target: Target):
        self._target = target

    def get_device_properties(self, device):
        # The keys of Triton's CUDA driver; the package reads max_shared_mem.
        return {"max_shared_mem": self._target.max_shared, "max_num_regs": 65536,
                "multiprocessor_count": self._target.multiprocessors, "warpSize": 32,
                "sm_clock_rate": 0, "mem_clock_rate": 0, "mem_bus_width": 0}


class _TargetDriver:
    """The subset of Triton's ``DriverBase`` that compiling (not launching) touches."""

    def __init__(self, target: Target):
        # Triton is optional: the triton_aot_* modules import without it (their tests then skip).
        from triton.backends.compiler import GPUTarget

        self._target = target
        self._gpu_target = GPUTarget("cuda", target.capability, 32)
        self.utils = _Utils(target)

    @staticmethod
    def is_active() -> bool:
        return True

    def get_current_device(self) -> int:
        # JITFunction caches its binder (which holds the target) per device: one "device" per
        # capability, so that switching targets in one process never reuses the other's binder.
        return self._target.capability

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self._gpu_target


@contextlib.contextmanager
def targeting(target: Target):
    """Triton's active driver is ``target``'s stand-in inside the block; the previous one after."""
    from triton.runtime import driver  # optional, see _TargetDriver

    # None unless something chose a driver: then the real one is again created lazily on first use
    # (restoring through reset_active would create it now, which fails without a GPU).
    previous = getattr(driver, "_active", None)
    driver.set_active(_TargetDriver(target))
    try:
        yield
    finally:
        driver._active = previous
