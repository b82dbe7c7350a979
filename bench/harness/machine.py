"""Description of the machine a benchmark ran on, for the reports."""

from __future__ import annotations

import os
import platform

import torch


def cpu_model() -> str:
    """CPU model name from ``/proc/cpuinfo``, else :func:`platform.processor`.

    Returns
    -------
    str
        ``"unknown"`` when neither source names the CPU.
    """
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """Machine, library versions and threading used for a run.

    Returns
    -------
    dict
        JSON-serialisable; keys ``cpu``, ``logical_cpus``, ``torch``,
        ``torch_threads``, ``python``, ``platform``, ``load_average`` (1-minute,
        None where unsupported).
    """
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": load_average(),
    }


def available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo``, None where unreadable (to skip sizes that would not fit)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_skip_reason(what: str, need: int, max_bytes: int, transient_factor: float = 1.0) -> str | None:
    """Why a size needing ``need`` bytes (``need * transient_factor`` at its peak) is skipped, or None."""
    if need > max_bytes:
        return f"{what} skipped: its tensors need {need / 2**30:.1f} GB (> {max_bytes / 2**30:.0f} GB)"
    avail = available_bytes()
    if avail is not None and need * transient_factor > avail:
        return (f"{what} skipped: needs ~{need * transient_factor / 2**30:.1f} GB with transients, "
                f"{avail / 2**30:.1f} GB available")
    return None


def load_average() -> float | None:
    """1-minute load average; above the CPU count, other work competed for the cores."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine_markdown(info: dict) -> str:
    """One Markdown line summarising :func:`machine_info`."""
    line = (
        f"Machine: {info['cpu']} ({info['logical_cpus']} logical CPUs), "
        f"torch {info['torch']} with {info['torch_threads']} threads, "
        f"Python {info['python']}"
    )
    if info.get("load_average") is not None:
        line += f"; 1-min load average {info['load_average']} at start"
    if info.get("load_average_end") is not None:
        line += f", {info['load_average_end']} at end"
    return line + "."


#: What a timing report says before its machine line: why its ratios deserve more trust than its times.
SHARED_MACHINE_NOTE = ("The machine is shared with other jobs: absolute times are noisy (see the load averages); the "
                       "interleaving keeps the ratios fairer than the times.")


def timing_footer(info: dict) -> list[str]:
    """The last lines of a timing report: :data:`SHARED_MACHINE_NOTE`, a blank line, :func:`machine_markdown`."""
    return [SHARED_MACHINE_NOTE, "", machine_markdown(info)]
