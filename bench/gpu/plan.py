"""The order in which the GPU benchmark measures its cases, and which of them it measures.

A GPU window is short and the benchmark stops at its time limit, so what matters most goes first. Each
case has a priority (0 first): its section's ``priority(case)`` where the section defines one, else
:data:`LATER`. Attention defines three: 0 for the rows its goals are measured on (bf16, D = 128, L = S in
{4096, 16384}, causal and not), 1 for the rest of bf16, 2 for fp16; the other sections come after all
attention rows. Cases of equal priority keep their section's order (smallest problems first) and the
sections' order. ``order="sections"`` runs the sections whole in the order given instead (each still by
priority inside), for a window meant for one of the later sections. A scope keeps the cases up to a
priority: ``goals`` (0), ``bf16`` (up to 1), ``all``. The report's tables keep their reading order
whatever the order of the run (each section's ``markdown`` sorts its rows).
"""
from __future__ import annotations

from dataclasses import dataclass

from bench.gpu import attention, features, other_ops, states, tree

#: The benchmark sections, in the order their tables are printed (module names under bench.gpu).
SECTIONS = {"attention": attention, "states": states, "tree": tree, "other_ops": other_ops, "features": features}
#: The priority of a section without a ``priority`` function: after every attention row.
LATER = 3
#: Scope -> the largest priority it keeps.
SCOPES = {"goals": 0, "bf16": 1, "all": LATER}
ORDERS = ("priority", "sections")


@dataclass(frozen=True)
class Planned:
    """One case of the run: its section, its index in the section's ``cases()``, and its priority."""

    section: str
    index: int
    case: object
    priority: int

    @property
    def id(self) -> str:
        """``SECTION:INDEX``, how :mod:`bench.gpu.warm` names a case to its worker processes."""
        return f"{self.section}:{self.index}"

    @property
    def module(self):
        return SECTIONS[self.section]


def priority(section: str, case) -> int:
    rank = getattr(SECTIONS[section], "priority", None)
    return LATER if rank is None else rank(case)


def plan(sections=tuple(SECTIONS), scope: str = "all", order: str = "priority") -> list[Planned]:
    """The cases of ``sections`` within ``scope``, in the order they are measured (see the module docstring)."""
    if scope not in SCOPES or order not in ORDERS:
        raise ValueError(f"scope {scope!r} (one of {tuple(SCOPES)}), order {order!r} (one of {ORDERS})")
    position = {name: i for i, name in enumerate(sections)}
    cases = [Planned(name, i, case, priority(name, case))
             for name in sections for i, case in enumerate(SECTIONS[name].cases())]
    kept = [p for p in cases if p.priority <= SCOPES[scope]]
    if order == "priority":
        return sorted(kept, key=lambda p: (p.priority, position[p.section], p.index))
    return sorted(kept, key=lambda p: (position[p.section], p.priority, p.index))


def planned(case_id: str) -> Planned:
    """The case named ``SECTION:INDEX`` (see :attr:`Planned.id`)."""
    name, index = case_id.split(":")
    case = SECTIONS[name].cases()[int(index)]
    return Planned(name, int(index), case, priority(name, case))
