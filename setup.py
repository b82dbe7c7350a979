"""Build of attn_ext._C, the C++ (and, with a CUDA torch, CUDA) kernels.

Environment:
  ATTN_EXT_SKIP_BUILD=1   install the pure-Python part only (reference and Triton backends).
  ATTN_EXT_FORCE_CUDA=1   build the CUDA sources even if torch or nvcc look unable to.
  MAX_JOBS                parallel compile jobs (read by torch's ninja builder).
"""
import glob
import os
import shutil

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _sources(pattern):
    return sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, pattern), recursive=True))


def _extensions():
    if os.environ.get("ATTN_EXT_SKIP_BUILD") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    # -g0: debug info triples the compile time of the ATen headers and is not shipped.
    cxx_flags = ["-O3", "-std=c++17", "-fopenmp", "-g0", "-Wall", "-Wno-unknown-pragmas"]
    include_dirs = [os.path.join(HERE, "csrc", "include"), os.path.join(HERE, "csrc")]
    sources = _sources("csrc/*.cpp") + _sources("csrc/cpu/*.cpp")
    with_cuda = os.environ.get("ATTN_EXT_FORCE_CUDA") == "1" or (
        torch.version.cuda is not None and CUDA_HOME is not None and shutil.which("nvcc") is not None
    )
    if with_cuda:
        # The torch bindings of the CUDA kernels need c10/cuda headers, present only in CUDA builds of torch.
        sources += _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/bindings/*.cpp")
        ext = CUDAExtension(
            "attn_ext._C",
            sources,
            include_dirs=include_dirs,
            define_macros=[("ATTN_EXT_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "-std=c++17", "-lineinfo", "-gencode=arch=compute_80,code=sm_80",
                         "-gencode=arch=compute_90,code=sm_90"],
            },
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension("attn_ext._C", sources, include_dirs=include_dirs,
                           extra_compile_args=cxx_flags, extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
