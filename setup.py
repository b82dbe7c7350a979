"""Build of attn_ext._C, the C++ (and, with a CUDA torch, CUDA) kernels. The logic is in build_support/.

Environment (docs/install.md describes each):
  ATTN_EXT_SKIP_BUILD=1     install the pure-Python part only (reference and Triton backends).
  ATTN_EXT_SKIP_CUDA=1      with a CUDA torch: build the C++ CPU kernels only.
  ATTN_EXT_REQUIRE_CUDA=1   fail instead of falling back to the CPU kernels when the CUDA part cannot be built.
  ATTN_EXT_FORCE_CUDA=1     with a CPU build of torch: compile the CUDA kernels with nvcc and link them
                            into the extension (a build check; their torch bindings need a CUDA torch).
  TORCH_CUDA_ARCH_LIST      GPU architectures, e.g. "8.0;9.0+PTX" (default: torch's, those attn_ext supports).
  CUDA_HOME                 the CUDA toolkit (default: found from nvcc on PATH, then /usr/local/cuda).
  MAX_JOBS                  parallel compile jobs (read by torch's ninja builder).

`python setup.py --version` resolves and prints the configuration without compiling anything. Every run writes
attn_ext/_op_schemas.json, the op schemas of csrc/op_list.h (build_support/schemas.py).
"""
import os
import sys

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # build_support/ is a folder of the source tree, not an installed package

from build_support.schemas import write_schemas  # noqa: E402  (torch-free; needs the path above)


def _extensions():
    if os.environ.get("ATTN_EXT_SKIP_BUILD") == "1":
        return [], {}
    from build_support.command import build_command, configure, make_extension
    from build_support.plan import BuildConfigError

    try:
        plan, torch_version = configure()
    except BuildConfigError as exc:  # a request that cannot be met: the message, not a traceback
        sys.exit(f"attn_ext build: error: {exc}")
    return [make_extension(plan, HERE)], {"build_ext": build_command(plan, torch_version, HERE)}


# Every run, ATTN_EXT_SKIP_BUILD=1 included: the Python side needs the schemas with or without the kernels.
write_schemas(HERE)
ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
