"""Build of attn_ext._C, the C++ (and, with a CUDA torch, CUDA) kernels.

Environment:
  ATTN_EXT_SKIP_BUILD=1   install the pure-Python part only (reference and Triton backends).
  ATTN_EXT_FORCE_CUDA=1   with a CPU build of torch: compile the CUDA kernels with nvcc and link them
                          into the extension (a build check; their torch bindings need a CUDA torch).
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
    # No -std flag: BuildExtension adds the standard this torch needs (C++17 for older torch, C++20
    # for recent ones, whose headers warn under C++17); the sources are valid in both.
    cxx_flags = ["-O3", "-fopenmp", "-g0", "-Wall", "-Wno-unknown-pragmas"]
    include_dirs = [os.path.join(HERE, "csrc", "include"), os.path.join(HERE, "csrc")]
    sources = _sources("csrc/*.cpp") + _sources("csrc/checks/*.cpp") + _sources("csrc/cpu/*.cpp")
    cuda_torch = torch.version.cuda is not None and CUDA_HOME is not None and shutil.which("nvcc") is not None
    if cuda_torch:
        # The torch bindings of the CUDA kernels need c10/cuda headers, present only in CUDA builds of torch.
        sources += _sources("csrc/cuda/*.cu") + _sources("csrc/cuda/bindings/*.cpp")
        ext = CUDAExtension(
            "attn_ext._C",
            sources,
            include_dirs=include_dirs,
            define_macros=[("ATTN_EXT_WITH_CUDA", "1")],
            extra_compile_args={
                "cxx": cxx_flags,
                "nvcc": ["-O3", "-lineinfo", "-gencode=arch=compute_80,code=sm_80",
                         "-gencode=arch=compute_90,code=sm_90"],
            },
            extra_link_args=["-fopenmp"],
        )
    elif os.environ.get("ATTN_EXT_FORCE_CUDA") == "1":
        # A CPU build of torch cannot compile the CUDA bindings (no c10/cuda headers) and
        # CUDAExtension refuses to run, but the torch-free kernels still compile and link: build
        # them with nvcc ourselves, so that a CPU machine checks the whole CUDA build but the bindings.
        objects, cuda_home = _nvcc_objects(include_dirs)
        ext = CppExtension("attn_ext._C", sources, include_dirs=include_dirs, extra_compile_args=cxx_flags,
                           extra_objects=objects, library_dirs=[os.path.join(cuda_home, "lib64")],
                           libraries=["cudart"], extra_link_args=["-fopenmp"])
    else:
        ext = CppExtension("attn_ext._C", sources, include_dirs=include_dirs,
                           extra_compile_args=cxx_flags, extra_link_args=["-fopenmp"])
    return [ext], {"build_ext": BuildExtension}


def _nvcc_objects(include_dirs):
    """Compile csrc/cuda/*.cu to position-independent objects; returns (objects, CUDA root)."""
    import subprocess

    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    if not os.path.exists(nvcc):
        raise RuntimeError("ATTN_EXT_FORCE_CUDA=1 but nvcc was not found on PATH or in /usr/local/cuda/bin")
    out_dir = os.path.join(HERE, "build", "cuda_objects")
    os.makedirs(out_dir, exist_ok=True)
    objects = []
    for source in _sources("csrc/cuda/*.cu"):
        obj = os.path.join(out_dir, os.path.basename(source) + ".o")
        subprocess.check_call([nvcc, "-c", os.path.join(HERE, source), "-o", obj, "-O3", "-std=c++17",
                               "-Xcompiler", "-fPIC", "--threads", "2",
                               "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
                               *[f"-I{d}" for d in include_dirs]])
        objects.append(obj)
    return objects, _cuda_root(nvcc)


def _cuda_root(nvcc):
    """The CUDA install holding libcudart: $CUDA_HOME, else nvcc's install, else /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for root in filter(None, candidates):
        if glob.glob(os.path.join(root, "lib64", "libcudart.so*")):
            return root
    raise RuntimeError(f"ATTN_EXT_FORCE_CUDA=1: no libcudart under any of {[c for c in candidates if c]}; set CUDA_HOME")


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
