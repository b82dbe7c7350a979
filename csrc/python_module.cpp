// The extension module attn_ext._C. Importing it runs every registration of this library (the schemas of
// schemas.cpp, the kernels of cpu/registration.cpp and cuda/bindings/registration.cpp). Its functions are
// the Python API's fast way into an op (and, in python_autograd.cpp, register_autograd / call_op_autograd):
//
//   op_index("attn_ext::cross_attention_fwd") -> int     once per op, at first use
//   call_op(index, below_autograd, *args) -> Tensor or tuple of Tensors
//
// A Python call of torch.ops.attn_ext.<op> matches its arguments against the schema, builds the boxed stack
// in the generic way of the JIT and costs a few microseconds, as much as a whole small attention. call_op
// converts the few argument kinds our schemas use directly, then calls the same dispatcher entry
// (optionally below the Autograd keys, as the Python autograd kernel itself does when no graph is
// wanted), so every dispatch key (Autograd, Python modes, Fake, Meta, CUDA) behaves as with torch.ops.
// Whatever it does not convert — a tensor subclass, a NumPy scalar, an active __torch_function__ mode —
// returns NotImplemented and the caller takes torch.ops' path.
#include "python_module.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/LegacyTypeDispatch.h>  // at::AutoDispatchBelowAutograd
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>
#include <vector>

namespace attn_ext::python {

std::deque<OpEntry>& op_entries() {
  static std::deque<OpEntry> entries;  // never shrinks: indexes and references handed out stay valid
  return entries;
}

namespace {

ArgKind kind_of(const c10::Argument& argument, const std::string& op) {
  const c10::TypePtr& type = argument.type();
  if (type->kind() == c10::TypeKind::TensorType) return ArgKind::kTensor;
  if (type->kind() == c10::TypeKind::FloatType) return ArgKind::kFloat;
  if (type->kind() == c10::TypeKind::IntType) return ArgKind::kInt;
  if (type->kind() == c10::TypeKind::BoolType) return ArgKind::kBool;
  if (type->kind() == c10::TypeKind::OptionalType &&
      type->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::TensorType) {
    return ArgKind::kOptionalTensor;
  }
  TORCH_CHECK(false, "attn_ext._C.op_index: ", op, " has an argument of type ", type->str(), " (", argument.name(),
              ") that call_op does not convert");
}

PyObject* op_index(PyObject* /*module*/, PyObject* name) {
  HANDLE_TH_ERRORS
  const char* qualified = PyUnicode_AsUTF8(name);
  if (qualified == nullptr) return nullptr;
  const c10::OperatorHandle handle = c10::Dispatcher::singleton().findSchemaOrThrow(qualified, "");
  OpEntry entry{handle, {}};
  for (const c10::Argument& argument : handle.schema().arguments()) entry.args.push_back(kind_of(argument, qualified));
  for (const c10::Argument& result : handle.schema().returns()) {
    TORCH_CHECK(result.type()->kind() == c10::TypeKind::TensorType, "attn_ext._C.op_index: ", qualified,
                " returns a ", result.type()->str(), "; call_op returns tensors only");
  }
  op_entries().push_back(std::move(entry));
  return PyLong_FromSsize_t(static_cast<Py_ssize_t>(op_entries().size()) - 1);
  END_HANDLE_TH_ERRORS
}

/// Appends `object` to `stack` as `kind`; false when it is not plainly of that kind.
bool push_argument(PyObject* object, ArgKind kind, torch::jit::Stack& stack) {
  switch (kind) {
    case ArgKind::kOptionalTensor:
      if (object == Py_None) {
        stack.emplace_back();
        return true;
      }
      [[fallthrough]];
    case ArgKind::kTensor:
      if (!THPVariable_CheckExact(object)) return false;  // subclasses keep their __torch_function__
      stack.emplace_back(THPVariable_Unpack(object));
      return true;
    case ArgKind::kFloat:
      if (!PyFloat_CheckExact(object)) return false;
      stack.emplace_back(PyFloat_AS_DOUBLE(object));
      return true;
    case ArgKind::kInt: {
      if (!PyLong_CheckExact(object)) return false;  // bool is a subclass of int: not taken here
      int overflow = 0;
      const long long value = PyLong_AsLongLongAndOverflow(object, &overflow);
      if (overflow != 0 || (value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      stack.emplace_back(static_cast<int64_t>(value));
      return true;
    }
    case ArgKind::kBool:
      if (object != Py_True && object != Py_False) return false;
      stack.emplace_back(object == Py_True);
      return true;
  }
  return false;
}

}  // namespace

bool convert_arguments(const OpEntry& entry, PyObject* const* args, Py_ssize_t n, torch::jit::Stack& stack) {
  if (static_cast<size_t>(n) != entry.args.size() || at::impl::torch_function_mode_enabled()) return false;
  stack.reserve(entry.args.size());
  for (size_t i = 0; i < entry.args.size(); ++i) {
    if (!push_argument(args[i], entry.args[i], stack)) return false;
  }
  return true;
}

const OpEntry& op_entry(PyObject* index_object) {
  TORCH_CHECK(PyLong_CheckExact(index_object), "attn_ext._C: an op index must be an int");
  const Py_ssize_t index = PyLong_AsSsize_t(index_object);
  TORCH_CHECK(index >= 0 && index < static_cast<Py_ssize_t>(op_entries().size()), "attn_ext._C: no op ", index);
  return op_entries()[index];
}

PyObject* wrap_results(torch::jit::Stack& stack) {
  if (stack.size() == 1) return THPVariable_Wrap(std::move(stack[0]).toTensor());
  PyObject* results = PyTuple_New(static_cast<Py_ssize_t>(stack.size()));
  if (results == nullptr) return nullptr;
  for (size_t i = 0; i < stack.size(); ++i) {
    PyObject* tensor = THPVariable_Wrap(std::move(stack[i]).toTensor());
    if (tensor == nullptr) {
      Py_DECREF(results);
      return nullptr;
    }
    PyTuple_SET_ITEM(results, static_cast<Py_ssize_t>(i), tensor);
  }
  return results;
}

namespace {

PyObject* call_op(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs >= 2, "attn_ext._C.call_op(index, below_autograd, *args)");
  const OpEntry& entry = op_entry(args[0]);
  const bool below_autograd = args[1] == Py_True;
  torch::jit::Stack stack;
  if (!convert_arguments(entry, args + 2, nargs - 2, stack)) Py_RETURN_NOTIMPLEMENTED;
  {
    pybind11::gil_scoped_release no_gil;  // as torch's own bindings: kernels written in Python take it back
    std::optional<at::AutoDispatchBelowAutograd> below;
    if (below_autograd) below.emplace();
    entry.handle.callBoxed(stack);
  }
  return wrap_results(stack);
  END_HANDLE_TH_ERRORS
}

PyMethodDef methods[] = {
    {"op_index", op_index, METH_O, "Index of an attn_ext op for call_op (torch.library name, default overload)."},
    {"call_op", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_op)), METH_FASTCALL,
     "call_op(index, below_autograd, *args): the op's results, or NotImplemented for arguments it does not convert."},
    {"register_autograd", register_autograd, METH_VARARGS,
     "register_autograd(forward, backward, layout, differentiable_inputs, differentiable_outputs, fallback) -> int"},
    {"call_op_autograd", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(call_op_autograd)), METH_FASTCALL,
     "call_op_autograd(index, *args): the op with its C++ autograd node, or NotImplemented."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace
}  // namespace attn_ext::python

extern "C" PyObject* PyInit__C(void) {
  using attn_ext::python::methods;
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module_def);
}
