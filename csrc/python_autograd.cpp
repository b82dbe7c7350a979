// The C++ autograd of the public functions' ordinary reverse-mode calls.
//
// A forward op's autograd is a Python torch.autograd.Function (attn_ext/ops/utils/autograd.py): every
// derivative order, forward mode and torch.func go through it. For the common case — inputs that require
// grad, no forward-mode tangent, no torch.func transform, not compiling — its Python forward, context
// set-up and backward cost several times a small attention call. Here the same first-order rule (the op's
// fused backward kernel) is a torch::autograd::Function in C++; whenever the backward is itself
// differentiated (create_graph, or gradients that require grad) it hands over to the Python composite
// (`fallback`), exactly what the Python Function does, so every order stays exact.
//
//   register_autograd(forward, backward, layout, differentiable_inputs, differentiable_outputs, fallback)
//   call_op_autograd(index, *args) -> Tensor or tuple, or NotImplemented (the caller takes the Python path)
//
// `layout` names the backward op's arguments in order: "g<j>" the gradient of output j (zeros where none
// flowed), "i<j>" forward argument j, "o<j>" forward output j. The backward op returns one gradient per
// differentiable input, in order.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "python_module.h"

namespace attn_ext::python {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Source {
  char kind;  // 'g', 'i' or 'o'
  int index;
};

struct AutogradSpec {
  const OpEntry* forward;
  const OpEntry* backward;
  std::vector<Source> layout;
  std::vector<int> differentiable_inputs, differentiable_outputs;
  // (inputs, outputs, grads) -> one gradient or None per input, differentiable. Owned for the life of the
  // process: specs are never freed (a reference dropped at exit would outlive the interpreter).
  PyObject* fallback;
};

std::vector<std::unique_ptr<AutogradSpec>>& specs() {
  static std::vector<std::unique_ptr<AutogradSpec>> all;
  return all;
}

PyObject* to_python(const c10::IValue& value) {
  if (value.isTensor()) return THPVariable_Wrap(value.toTensor());
  if (value.isDouble()) return PyFloat_FromDouble(value.toDouble());
  if (value.isBool()) return PyBool_FromLong(value.toBool());
  if (value.isInt()) return PyLong_FromLongLong(value.toInt());
  Py_RETURN_NONE;
}

/// A Python list of `values` (new reference); throws the pending Python error on failure.
PyObject* python_list(const std::vector<c10::IValue>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  if (list == nullptr) throw python_error();
  for (size_t i = 0; i < values.size(); ++i) {
    PyObject* item = to_python(values[i]);
    if (item == nullptr) {
      Py_DECREF(list);
      throw python_error();
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

struct FusedOp : torch::autograd::Function<FusedOp> {
  // `args`: the forward op's arguments; `inputs`: its differentiable ones (the node's inputs).
  static variable_list forward(AutogradContext* ctx, const AutogradSpec* spec, const torch::jit::Stack& args,
                               at::TensorList inputs) {
    torch::jit::Stack stack = args;
    {
      at::AutoDispatchBelowAutograd below;
      spec->forward->handle.callBoxed(stack);
    }
    variable_list outputs;
    outputs.reserve(stack.size());
    for (c10::IValue& value : stack) outputs.push_back(std::move(value).toTensor());
    for (size_t j = 0; j < outputs.size(); ++j) {
      if (std::find(spec->differentiable_outputs.begin(), spec->differentiable_outputs.end(), static_cast<int>(j)) ==
          spec->differentiable_outputs.end()) {
        ctx->mark_non_differentiable({outputs[j]});
      }
    }
    // Tensors (undefined for the other arguments) and outputs, through the context so that the version
    // checks and the release after backward are autograd's own; the other arguments as they were.
    variable_list saved;
    c10::impl::GenericList constants(c10::AnyType::get());
    for (const c10::IValue& arg : args) {
      saved.push_back(arg.isTensor() ? arg.toTensor() : at::Tensor());
      constants.push_back(arg.isTensor() ? c10::IValue() : arg);
    }
    saved.insert(saved.end(), outputs.begin(), outputs.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["constants"] = constants;
    ctx->saved_data["spec"] = reinterpret_cast<int64_t>(spec);
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* spec = reinterpret_cast<const AutogradSpec*>(ctx->saved_data["spec"].toInt());
    const variable_list saved = ctx->get_saved_variables();
    const c10::List<c10::IValue> constants = ctx->saved_data["constants"].toList();
    const size_t n_args = constants.size();
    std::vector<c10::IValue> inputs(n_args), outputs;
    for (size_t i = 0; i < n_args; ++i) {
      inputs[i] = saved[i].defined() ? c10::IValue(saved[i]) : constants.get(i);
    }
    for (size_t j = n_args; j < saved.size(); ++j) outputs.emplace_back(saved[j]);

    bool graph_wanted = at::GradMode::is_enabled();
    for (const at::Tensor& g : grads) graph_wanted = graph_wanted || (g.defined() && g.requires_grad());
    variable_list result(2 + spec->differentiable_inputs.size());  // nothing for `spec` and `args`
    if (graph_wanted) {
      // Derivatives of this backward are wanted: the composite's, from Python, differentiable again.
      pybind11::gil_scoped_acquire gil;
      std::vector<c10::IValue> grad_values(grads.begin(), grads.end());
      PyObject* py_inputs = python_list(inputs);
      PyObject* py_outputs = python_list(outputs);
      PyObject* py_grads = python_list(grad_values);
      PyObject* got = PyObject_CallFunctionObjArgs(spec->fallback, py_inputs, py_outputs, py_grads, nullptr);
      Py_DECREF(py_inputs), Py_DECREF(py_outputs), Py_DECREF(py_grads);
      if (got == nullptr) throw python_error();
      for (size_t j = 0; j < spec->differentiable_inputs.size(); ++j) {
        PyObject* g = PySequence_GetItem(got, spec->differentiable_inputs[j]);
        if (g == nullptr) {
          Py_DECREF(got);
          throw python_error();
        }
        if (THPVariable_Check(g)) result[2 + j] = THPVariable_Unpack(g);
        Py_DECREF(g);
      }
      Py_DECREF(got);
      return result;
    }
    torch::jit::Stack stack;
    stack.reserve(spec->layout.size());
    for (const Source& source : spec->layout) {
      if (source.kind == 'g') {
        const at::Tensor& g = grads[source.index];
        stack.emplace_back(g.defined() ? g
                                       : at::zeros_like(outputs[source.index].toTensor(), at::MemoryFormat::Contiguous));
      } else if (source.kind == 'i') {
        stack.push_back(inputs[source.index]);
      } else {
        stack.push_back(outputs[source.index]);
      }
    }
    {
      at::AutoDispatchBelowAutograd below;
      spec->backward->handle.callBoxed(stack);
    }
    TORCH_CHECK(stack.size() == spec->differentiable_inputs.size(), "attn_ext: the backward op returned ",
                stack.size(), " gradients for ", spec->differentiable_inputs.size(), " differentiable inputs");
    for (size_t j = 0; j < stack.size(); ++j) result[2 + j] = std::move(stack[j]).toTensor();
    return result;
  }
};

std::vector<int> int_tuple(PyObject* tuple) {
  std::vector<int> values;
  const Py_ssize_t n = PySequence_Size(tuple);
  TORCH_CHECK(n >= 0, "attn_ext._C.register_autograd: expected a tuple of ints");
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* item = PySequence_GetItem(tuple, i);
    values.push_back(static_cast<int>(PyLong_AsLong(item)));
    Py_XDECREF(item);
  }
  if (PyErr_Occurred()) throw python_error();
  return values;
}

}  // namespace

PyObject* register_autograd(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *forward, *backward, *differentiable_inputs, *differentiable_outputs, *fallback;
  const char* layout;
  if (!PyArg_ParseTuple(args, "OOsOOO", &forward, &backward, &layout, &differentiable_inputs, &differentiable_outputs,
                        &fallback)) {
    return nullptr;
  }
  auto spec = std::make_unique<AutogradSpec>();
  spec->forward = &op_entry(forward);
  spec->backward = &op_entry(backward);
  std::istringstream tokens(layout);
  for (std::string token; tokens >> token;) {
    TORCH_CHECK(token.size() >= 2 && (token[0] == 'g' || token[0] == 'i' || token[0] == 'o'),
                "attn_ext._C.register_autograd: bad layout entry '", token, "'");
    spec->layout.push_back({token[0], std::stoi(token.substr(1))});
  }
  spec->differentiable_inputs = int_tuple(differentiable_inputs);
  spec->differentiable_outputs = int_tuple(differentiable_outputs);
  Py_INCREF(fallback);
  spec->fallback = fallback;
  specs().push_back(std::move(spec));
  return PyLong_FromSsize_t(static_cast<Py_ssize_t>(specs().size()) - 1);
  END_HANDLE_TH_ERRORS
}

PyObject* call_op_autograd(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  TORCH_CHECK(nargs >= 1 && PyLong_CheckExact(args[0]), "attn_ext._C.call_op_autograd(index, *args)");
  const Py_ssize_t index = PyLong_AsSsize_t(args[0]);
  TORCH_CHECK(index >= 0 && index < static_cast<Py_ssize_t>(specs().size()), "attn_ext._C: no autograd ", index);
  const AutogradSpec& spec = *specs()[index];
  torch::jit::Stack stack;
  if (!convert_arguments(*spec.forward, args + 1, nargs - 1, stack)) Py_RETURN_NOTIMPLEMENTED;
  variable_list inputs;
  for (size_t i = 0; i < stack.size(); ++i) {
    const bool differentiable = std::find(spec.differentiable_inputs.begin(), spec.differentiable_inputs.end(),
                                          static_cast<int>(i)) != spec.differentiable_inputs.end();
    if (differentiable) {
      if (!stack[i].isTensor()) Py_RETURN_NOTIMPLEMENTED;
      inputs.push_back(stack[i].toTensor());
    } else if (stack[i].isTensor() && stack[i].toTensor().requires_grad()) {
      Py_RETURN_NOTIMPLEMENTED;  // a gradient this rule does not give: the Python path says so
    }
  }
  variable_list outputs;
  {
    pybind11::gil_scoped_release no_gil;
    outputs = FusedOp::apply(&spec, stack, at::TensorList(inputs));
  }
  torch::jit::Stack results(outputs.begin(), outputs.end());
  return wrap_results(results);
  END_HANDLE_TH_ERRORS
}

}  // namespace attn_ext::python
