"""What a kernel's machine code is made of: counts of the instructions that tell a FlashAttention-class
kernel from a slower one, read from ``cuobjdump -sass`` output (no GPU needed).

=============  ==================================================================================
count          instruction (and why it matters)
=============  ==================================================================================
HGMMA          Hopper warpgroup MMA (``wgmma``): sm_90a tensor cores at full rate
HMMA           warp MMA (``mma.sync``), any shape; ``HMMA.16816`` the m16n8k16 of FlashAttention-2
LDSM           ``ldmatrix``: shared memory to MMA fragments without bank conflicts
LDGSTS         ``cp.async``: global to shared memory without registers, pipelined; ``LDGSTS.128``
               those of 16 bytes (FlashAttention-2's loads; ``LDG.128`` misses them)
UTMALDG        TMA tensor loads (Hopper's bulk copies by descriptor)
LDG            global loads of any width; ``LDG.128`` those of 16 bytes (a 2-byte ``LDG.U16`` is 8x
               the instructions for the same bytes)
LDL, STL       local memory: register spills (or stack arrays); 0 in a good kernel
SETMAXREG      ``setmaxnreg``: producer/consumer register reallocation of warp specialisation
=============  ==================================================================================
"""
from __future__ import annotations

import re
from typing import Dict

#: The counts every report has, in this order.
COUNTS = ("HGMMA", "HMMA", "HMMA.16816", "LDSM", "LDGSTS", "LDGSTS.128", "UTMALDG", "LDG", "LDG.128", "LDL", "STL",
          "SETMAXREG")

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)\s*$", re.M)
# An instruction line: /*0c40*/ [@!P0] MNEMONIC.MODIFIERS operands ;
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def split_functions(dump: str) -> Dict[str, str]:
    """``{kernel name: its SASS}`` of a ``cuobjdump -sass`` dump (one cubin, any number of kernels)."""
    starts = list(_FUNCTION.finditer(dump))
    return {m.group(1): dump[m.end(): starts[i + 1].start() if i + 1 < len(starts) else len(dump)]
            for i, m in enumerate(starts)}


def opcode_counts(sass: str) -> Dict[str, int]:
    """The :data:`COUNTS` of one kernel's SASS (static counts: each instruction once, loops not unrolled)."""
    counts = dict.fromkeys(COUNTS, 0)
    for mnemonic in _INSTRUCTION.findall(sass):
        parts = mnemonic.split(".")
        root = parts[0]
        if root == "HGMMA":
            counts["HGMMA"] += 1
        elif root == "HMMA":
            counts["HMMA"] += 1
            counts["HMMA.16816"] += "16816" in parts
        elif root in ("LDSM", "LDGSTS", "UTMALDG", "LDL", "STL"):
            counts[root] += 1
            counts["LDGSTS.128"] += root == "LDGSTS" and "128" in parts  # not LTC128B, a cache hint
        elif root == "LDG":
            counts["LDG"] += 1
            counts["LDG.128"] += "128" in parts
        elif root.endswith("SETMAXREG"):  # USETMAXREG on sm_90a
            counts["SETMAXREG"] += 1
    return counts
