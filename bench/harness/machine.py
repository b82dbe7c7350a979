"""Description of the machine a benchmark ran on, for the reports."""

from __future__ import annotations

import os
import platform


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
    import torch

    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average": load_average(),
    }


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
