"""The torch side of the build: the extension for a plan, and the ``build_ext`` command that compiles it
in the persistent build folder, falls back to the CPU kernels when the CUDA compile fails, and records
the outcome next to attn_ext._C.

Imports torch.utils.cpp_extension, which reads ``CUDA_HOME`` when imported: :func:`configure` exports
the resolved toolkit root first.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig

from build_support import cuda_arch, cxx_runtime, layout
from build_support.cuda_toolkit import probe_toolkit
from build_support.plan import BuildConfigError, BuildPlan, TorchInfo, plan_build

# -g0: debug info triples the compile time of the ATen headers and is not shipped. No -std flag:
# BuildExtension adds the standard this torch needs (C++17 for older torch, C++20 for recent ones, whose
# headers warn under C++17); the sources are valid in both.
CXX_FLAGS = ["-O3", "-fopenmp", "-g0", "-Wall", "-Wno-unknown-pragmas"]
NVCC_FLAGS = ["-O3", "-lineinfo"]


def _torch_info():
    import torch

    visible = []
    if torch.version.cuda is not None and torch.cuda.is_available():
        visible = [major * 10 + minor for major, minor in
                   (torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))]
    arch_list = torch.cuda.get_arch_list() if torch.version.cuda is not None else []
    return TorchInfo(torch.__version__, torch.version.cuda, getattr(torch.version, "hip", None), arch_list, visible)


def configure(environ=os.environ) -> tuple:
    """(plan, torch version): decides the build, logs it and exports ``CUDA_HOME`` for torch."""
    info = _torch_info()
    plan = plan_build(environ, info, lambda: probe_toolkit(environ, shutil.which("nvcc")))
    chosen, notes, error = cxx_runtime.choose_compiler(environ)
    if error:
        raise BuildConfigError(error)
    environ.update(chosen)  # torch's builder reads CXX (and CC, nvcc's host compiler) when it compiles
    for note in notes:
        layout.log(note)
    if plan.cuda_home:
        environ["CUDA_HOME"] = plan.cuda_home
        if "torch.utils.cpp_extension" in sys.modules:  # imported before us: it has its own guess already
            sys.modules["torch.utils.cpp_extension"].CUDA_HOME = plan.cuda_home
    layout.describe(plan)
    return plan, info.version


def _sources(root, *patterns):
    return [os.path.relpath(p, root) for pattern in patterns for p in sorted(glob.glob(os.path.join(root, pattern)))]


def make_extension(plan: BuildPlan, root: str):
    """The ``attn_ext._C`` extension of ``plan`` (CUDA sources and bindings only in the ``cuda`` variant)."""
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    include_dirs = [os.path.join(root, "csrc", "include"), os.path.join(root, "csrc")]
    sources = _sources(root, "csrc/*.cpp", "csrc/checks/*.cpp", "csrc/cpu/*.cpp")
    if plan.variant == "cuda":
        # After the toolkit's own folders (-idirafter), so that only headers the toolkit lacks come from torch's wheels.
        cxx = CXX_FLAGS + [flag for folder in plan.include_after for flag in ("-idirafter", folder)]
        return CUDAExtension("attn_ext._C", sources + _sources(root, "csrc/cuda/*.cu", "csrc/cuda/bindings/*.cpp"),
                             include_dirs=include_dirs, define_macros=[("ATTN_EXT_WITH_CUDA", "1")],
                             extra_compile_args={"cxx": cxx, "nvcc": NVCC_FLAGS + cuda_arch.gencode_flags(plan.archs)},
                             extra_link_args=["-fopenmp"])
    if plan.variant == "force_cuda":
        # A CPU torch cannot compile the bindings (no c10/cuda headers) and CUDAExtension refuses to run; the
        # torch-free kernels are compiled by BuildCommand and linked in, checking all of the CUDA build but the bindings.
        return CppExtension("attn_ext._C", sources, include_dirs=include_dirs, extra_compile_args=CXX_FLAGS,
                            library_dirs=[plan.cudart_dir], libraries=["cudart"], extra_link_args=["-fopenmp"])
    return CppExtension("attn_ext._C", sources, include_dirs=include_dirs, extra_compile_args=CXX_FLAGS,
                        extra_link_args=["-fopenmp"])


def nvcc_objects(plan: BuildPlan, root: str, out_dir: str):
    """Compiles csrc/cuda/*.cu to position-independent objects with ``plan``'s nvcc and architectures."""
    os.makedirs(out_dir, exist_ok=True)
    objects = []
    for source in _sources(root, "csrc/cuda/*.cu"):
        obj = os.path.join(out_dir, os.path.basename(source) + ".o")
        layout.log(f"nvcc {source}")
        subprocess.check_call([plan.nvcc, "-c", os.path.join(root, source), "-o", obj, "-std=c++17", *NVCC_FLAGS,
                               "-Xcompiler", "-fPIC", *cuda_arch.gencode_flags(plan.archs),
                               f"-I{os.path.join(root, 'csrc', 'include')}", f"-I{os.path.join(root, 'csrc')}"])
        objects.append(obj)
    return objects


def build_command(plan: BuildPlan, torch_version: str, root: str):
    """The ``build_ext`` class for ``plan``."""
    from torch.utils import cpp_extension

    class BuildCommand(cpp_extension.BuildExtension):
        def finalize_options(self):
            explicit = self.build_temp  # `setup.py build_ext -t DIR` wins; pip's throw-away folder does not
            super().finalize_options()
            self._pinned = explicit is None
            self._plan = plan
            self._set_build_temp()

        def _set_build_temp(self):
            if self._pinned:
                variant = "cpu" if self._plan.variant == "force_cuda" else self._plan.variant
                self.build_temp = layout.build_temp_dir(root, sysconfig.get_platform(), sys.implementation.cache_tag,
                                                        torch_version, variant)

        def run(self):
            layout.log(f"object folder {self.build_temp} (kept between builds: rebuilds compile what changed)")
            layout.log(layout.ccache_note(shutil.which("ccache"), hasattr(cpp_extension, "_wrap_compiler"),
                                          bool(os.environ.get("TORCH_NO_COMPILER_WRAPPER"))))
            if self._plan.variant == "force_cuda":
                for ext in self.extensions:
                    ext.extra_objects = nvcc_objects(self._plan, root, os.path.join(self.build_temp, "cuda_objects"))
            # run() replaces the compiler option (a name) by the compiler it makes, and clears inplace until it
            # succeeds: a second run after a failure needs both as they were.
            compiler, inplace = self.compiler, self.inplace
            try:
                super().run()
            except Exception as exc:  # a compiler or linker failure, reported by ninja, distutils or torch's checks
                if self._plan.variant != "cuda":
                    raise
                self.compiler, self.inplace = compiler, inplace
                self._fall_back(f"compiling the CUDA part failed ({type(exc).__name__}: {exc}); the compiler's "
                                "messages are above in the build log (`pip install -v` shows them)")
                super().run()
            self._check_runtime()
            self._record()

        def _check_runtime(self):
            for ext in self.extensions:
                problem = cxx_runtime.check_built_extension(self.get_ext_fullpath(ext.name))
                if problem:
                    raise BuildConfigError(problem)

        def _fall_back(self, reason):
            self._plan = self._plan.fallback(reason)  # raises under ATTN_EXT_REQUIRE_CUDA=1
            layout.describe(self._plan)
            cpu = make_extension(self._plan, root)
            for ext in self.extensions:  # in place: finalize_options gave the extension attributes run() needs
                ext.__dict__.update({k: v for k, v in vars(cpu).items() if not k.startswith("_")})
            self._set_build_temp()

        def _info_paths(self):
            regular = os.path.join(self.build_lib, "attn_ext", layout.BUILD_INFO_NAME)
            package_dir = self.get_finalized_command("build_py").get_package_dir("attn_ext")
            return regular, os.path.join(package_dir, layout.BUILD_INFO_NAME)

        def _record(self):
            regular, inplace = self._info_paths()
            info = layout.build_info(self._plan, torch_version)
            layout.write_build_info(regular, info)
            if self.inplace:
                layout.write_build_info(inplace, info)

        def get_outputs(self):
            outputs = super().get_outputs()
            return outputs if self.inplace else outputs + [self._info_paths()[0]]

        def get_output_mapping(self):
            mapping = super().get_output_mapping()
            if self.inplace:
                regular, inplace = self._info_paths()
                mapping[regular] = inplace
            return mapping

    return BuildCommand
