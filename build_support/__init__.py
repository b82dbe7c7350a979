"""Build logic of attn_ext._C, used by setup.py (never installed with the package).

- ``cuda_arch``: which GPU architectures to compile for (``TORCH_CUDA_ARCH_LIST`` or the default).
- ``cuda_toolkit``: finding the CUDA toolkit, its nvcc version and the CUDA library headers.
- ``plan``: from the environment and what was found, what to build (CPU only or CPU + CUDA) and why.
- ``layout``: the persistent build directory and the build record installed with the package.
- ``command``: the setuptools command that compiles the plan, falling back to CPU only on failure.

Everything but ``command`` is free of torch and of the compilers, so that it can be unit-tested on any machine.
"""
