// What the two halves of the extension module share: the ops indexed for call_op (python_module.cpp)
// and the C++ autograd path of the public functions (python_autograd.cpp).
#pragma once

#include <Python.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <deque>
#include <vector>

namespace attn_ext::python {

/// The argument kinds of our schemas that call_op converts from Python objects.
enum class ArgKind { kTensor, kOptionalTensor, kFloat, kInt, kBool };

struct OpEntry {
  c10::OperatorHandle handle;
  std::vector<ArgKind> args;
};

/// Every op indexed by op_index, by its index.
std::deque<OpEntry>& op_entries();  // a deque: references stay valid as it grows

/// The entry of a Python int index; raises for anything else.
const OpEntry& op_entry(PyObject* index_object);

/// The stack of the Python arguments `args[0..n)` of `entry`'s op; false (the stack unusable) when there is
/// not one per schema argument, a __torch_function__ mode is active, or one is not plainly of its kind (a
/// tensor subclass, a NumPy scalar, a bool for an int, ...): then the caller leaves the call to torch.ops.
bool convert_arguments(const OpEntry& entry, PyObject* const* args, Py_ssize_t n, torch::jit::Stack& stack);

/// The tensors of `stack`: one Tensor, or a tuple of them.
PyObject* wrap_results(torch::jit::Stack& stack);

PyObject* register_autograd(PyObject* module, PyObject* args);
PyObject* call_op_autograd(PyObject* module, PyObject* const* args, Py_ssize_t nargs);

}  // namespace attn_ext::python
