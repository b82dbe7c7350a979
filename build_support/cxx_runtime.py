"""The C++ compiler must link the extension against the shared C++ runtime (libstdc++.so / libc++.so).

torch's libraries use the process's shared ``libstdc++.so.6``. A compiler that links libstdc++
*statically* into shared objects (some images wrap ``g++`` so that programs run anywhere; seen on a GPU
machine whose ``CXX`` was such a wrapper) gives ``attn_ext._C`` a second, private copy of the runtime.
The two copies disagree about the streams' locale facets, so the first message the extension formats
with an ``std::ostringstream`` (every ``TORCH_CHECK`` message, ``c10::str``) crashes the process with a
segmentation fault. The extension imports and registers its ops without complaint: the crash comes
later, inside the first call. So the build checks the compiler before compiling, picks another one
when it can, and checks the linked extension afterwards.

The check compiles a tiny shared object that uses a string stream and reads its ``DT_NEEDED``
entries (the shared libraries it asks the loader for) straight from the ELF file: no binutils needed.
"""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from typing import Callable, Iterable, List, Mapping, Optional, Tuple

#: Shared C++ runtimes: an extension linked against one of these shares torch's.
SHARED_RUNTIMES = ("libstdc++.so", "libc++.so")

_PROBE_SOURCE = """
#include <sstream>
#include <string>
extern "C" int attn_ext_probe(long x) { std::ostringstream s; s << x; return static_cast<int>(s.str().size()); }
"""

_SHT_DYNAMIC = 6
_DT_NEEDED = 1


def needed_libraries(path: str) -> Optional[List[str]]:
    """The ``DT_NEEDED`` entries of the 64-bit little-endian ELF file ``path``; None if it is not one."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # ELFCLASS64, ELFDATA2LSB
        return None
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _, sh_type, _, _, offset, size, link, _, _, _ in sections:
        if sh_type != _SHT_DYNAMIC:
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:  # DT_NULL ends the table
                break
            if tag == _DT_NEEDED:
                end = data.index(b"\0", strtab_offset + value)
                names.append(data[strtab_offset + value:end].decode())
    return names


def links_shared_runtime(needed: Iterable[str]) -> bool:
    return any(name.startswith(SHARED_RUNTIMES) for name in needed)


def probe_compiler(cxx: str, timeout: float = 120) -> Tuple[Optional[bool], str]:
    """(True, "") when ``cxx`` links C++ shared objects against a shared runtime, (False, why) when it
    embeds the runtime, (None, why) when the probe could not say (no such compiler, a compile error)."""
    with tempfile.TemporaryDirectory(prefix="attn_ext_cxx_probe_") as tmp:
        source, library = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(source, "w") as f:
            f.write(_PROBE_SOURCE)
        try:
            done = subprocess.run([cxx, "-shared", "-fPIC", "-O0", source, "-o", library],
                                  capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"could not run {cxx!r}: {exc}"
        if done.returncode != 0 or not os.path.exists(library):
            return None, f"{cxx!r} could not compile a probe: {(done.stderr or done.stdout).strip()[-300:]}"
        needed = needed_libraries(library)
        if needed is None:
            return None, f"{cxx!r} made a shared object that is not a 64-bit little-endian ELF file"
        if links_shared_runtime(needed):
            return True, ""
        return False, (f"{cxx!r} links the C++ runtime statically into shared objects (a probe library needs "
                       f"only {needed or 'nothing'}); the extension would carry a second copy of libstdc++ "
                       "beside torch's and crash at its first formatted error message")


def _c_compiler_for(cxx: str) -> Optional[str]:
    """The C compiler of the same installation as ``cxx`` (g++-13 -> gcc-13, clang++ -> clang), if any."""
    folder, name = os.path.split(cxx)
    for cxx_part, c_part in (("g++", "gcc"), ("clang++", "clang"), ("c++", "cc")):
        if cxx_part in name:
            candidate = os.path.join(folder, name.replace(cxx_part, c_part, 1))
            found = shutil.which(candidate)
            if found:
                return found
    return None


def default_candidates(which: Callable[[str], Optional[str]] = shutil.which) -> List[str]:
    """Other C++ compilers to try, in order: those on PATH, then the system's."""
    names = ["g++", "c++", "clang++", "/usr/bin/g++", "/usr/bin/c++", "/usr/bin/clang++"]
    found = []
    for name in names:
        path = which(name)
        if path and os.path.realpath(path) not in {os.path.realpath(p) for p in found}:
            found.append(path)
    return found


def choose_compiler(environ: Mapping[str, str], probe: Callable[[str], Tuple[Optional[bool], str]] = probe_compiler,
                    candidates: Callable[[], List[str]] = default_candidates):
    """(``{"CXX": ..., "CC": ...}`` to set, or {}; the log notes; an error message or None).

    ``CXX`` (torch's choice: ``$CXX``, else ``c++``) is kept when it links a shared C++ runtime or when
    the probe cannot tell; otherwise the first other compiler that does is chosen, with a note, and
    when there is none the build stops with the reason and what to do."""
    current = environ.get("CXX") or "c++"
    ok, why = probe(current)
    if ok or ok is None:
        return {}, ([f"C++ compiler check skipped: {why}"] if ok is None else []), None
    current_real = os.path.realpath(shutil.which(current) or current)
    for candidate in candidates():
        if os.path.realpath(candidate) == current_real:
            continue
        if probe(candidate)[0]:
            chosen = {"CXX": candidate}
            c_compiler = _c_compiler_for(candidate)
            if c_compiler:
                chosen["CC"] = c_compiler
            note = (f"{why}. Using {candidate} instead"
                    f"{' (and ' + c_compiler + ' for C and as nvcc host compiler)' if c_compiler else ''}; "
                    "set CXX to choose another")
            return chosen, [note], None
    return {}, [], (f"{why}, and no other C++ compiler found links the shared runtime; set CXX to one that does "
                    "(e.g. the system's g++)")


def check_built_extension(path: str) -> Optional[str]:
    """Why the linked extension at ``path`` cannot be loaded safely beside torch, or None when it can."""
    needed = needed_libraries(path)
    if needed is None or links_shared_runtime(needed):
        return None
    return (f"{os.path.basename(path)} does not link a shared C++ runtime (it needs only {needed}): it carries its "
            "own copy of libstdc++, which crashes beside torch's at the first formatted error message. Rebuild "
            "with CXX set to a compiler that links libstdc++ dynamically (e.g. the system's g++)")
