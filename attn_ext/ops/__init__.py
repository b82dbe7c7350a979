"""The op families of attn_ext, one folder each, the same files in each:

* ``__init__.py``: the family's public functions (re-exported as ``attn_ext.<name>``);
* the public API, in files named after the algorithm (``scaled_dot_product.py``, ``chunked.py``, ``retrieval.py``,
  ``ridge.py``, ...);
* ``naive.py``: the readable PyTorch reference (the ``reference`` backend and the tests' ground truth);
* ``registration.py``: the custom ops of the Python backends, fake kernels, autograd, and the backends
  each op declares (:mod:`attn_ext.ops.utils.dispatch`, one table for every op), opening with the table
  public function → op → backend → kernel function;
* ``triton_*.py``: the Triton kernels.

The compiled kernels (C++ for CPU, CUDA) live in ``csrc/`` and register under the same op names.
Shared pieces are in :mod:`attn_ext.ops.utils`.
"""
from attn_ext.ops import attention, intention, te_attention, tree  # noqa: F401  (registers every op)

__all__ = ["attention", "intention", "te_attention", "tree"]
