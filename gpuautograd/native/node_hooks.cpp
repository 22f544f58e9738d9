// Running the hooks autograd keeps on a node, the way eager's engine calls them
// (torch/csrc/autograd/engine.cpp: call_tensor_pre_hooks, call_pre_hooks, call_post_hooks, and
// AccumulateGrad's post-accumulate-grad hook). A captured program yields to the host at each
// hooked node and calls these: the hook objects themselves run, so what a hook sees, returns and
// raises is eager's, whichever API registered it.

#include "node_hooks.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <type_traits>

namespace py = pybind11;
using torch::autograd::AccumulateGrad;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace gpuautograd {
namespace {

// A custom Function's THPFunction holds its node as a weak_ptr<PyNode> (torch 2.11) or an
// owning intrusive_ptr<Node> (2.13).
template <typename T>
Node* raw_node(const std::weak_ptr<T>& p) {
  return p.lock().get();  // the graph being run keeps the node alive
}
template <typename T>
Node* raw_node(const c10::intrusive_ptr<T>& p) {
  return p.get();
}

Node* node_of(const py::handle& obj) {
  PyObject* o = obj.ptr();
  if (torch::autograd::THPCppFunction_Check(o)) {
    return reinterpret_cast<torch::autograd::THPCppFunction*>(o)->cdata.get();
  }
  if (PyObject_TypeCheck(o, &THPFunctionType)) {
    Node* node = raw_node(reinterpret_cast<THPFunction*>(o)->cdata);
    TORCH_CHECK(node != nullptr, "the custom Function's autograd node was freed");
    return node;
  }
  TORCH_CHECK(false, "expected an autograd node, got ", Py_TYPE(o)->tp_name);
}

variable_list to_variables(const py::list& values) {
  variable_list out;
  out.reserve(values.size());
  for (const auto& v : values) {
    out.push_back(v.is_none() ? at::Tensor() : THPVariable_Unpack(v.ptr()));
  }
  return out;
}

py::list to_list(const variable_list& values) {
  py::list out(values.size());
  for (size_t k = 0; k < values.size(); ++k) {
    out[k] = values[k].defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(values[k])) : py::none();
  }
  return out;
}

// A hook that raised: its own Python exception reaches the caller, as in eager. (Called with the
// GIL held: `body` releases it in an inner scope, which unwinding leaves before these handlers.)
template <typename F>
auto rethrowing(F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (python_error& e) {
    e.restore();
    throw py::error_already_set();
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    throw py::error_already_set();
  }
}

int64_t hook_bits_of(py::object node) {
  Node* n = node_of(node);
  return hook_bits(*n, dynamic_cast<AccumulateGrad*>(n));
}

// The hooks run without the GIL, as eager's engine runs them: a Python hook takes it itself, and a
// C++ one (DDP's reducer) may wait on threads that need it (a communication future's callback).
py::list call_tensor_pre_hooks(py::object node, py::list grads) {
  Node* n = node_of(node);
  variable_list values = to_variables(grads);
  rethrowing([&] {
    py::gil_scoped_release no_gil;
    for (const auto& hook : n->tensor_pre_hooks()) {
      values = (*hook)(values);
    }
    return 0;
  });
  return to_list(values);
}

py::list call_pre_hooks(py::object node, py::list grads) {
  Node* n = node_of(node);
  variable_list values = to_variables(grads);
  rethrowing([&] {
    py::gil_scoped_release no_gil;
    for (const auto& hook : n->pre_hooks()) {
      values = (*hook)(values);
    }
    return 0;
  });
  return to_list(values);
}

py::list call_post_hooks(py::object node, py::list outputs, py::list inputs) {
  Node* n = node_of(node);
  variable_list results = to_variables(outputs);
  const variable_list given = to_variables(inputs);
  rethrowing([&] {
    py::gil_scoped_release no_gil;
    for (const auto& hook : n->post_hooks()) {
      results = (*hook)(results, given);
    }
    return 0;
  });
  return to_list(results);
}

void call_post_accumulate_grad_hooks(py::object node) {
  auto* acc = dynamic_cast<AccumulateGrad*>(node_of(node));
  TORCH_CHECK(acc != nullptr, "call_post_accumulate_grad_hooks: not an AccumulateGrad node");
  rethrowing([&] {
    py::gil_scoped_release no_gil;
    if (auto& hook = acc->tensor_post_acc_grad_hooks()) {
      (*hook)(acc->variable);
    }
    return 0;
  });
}

}  // namespace

void register_node_hooks(py::module& m) {
  m.def("hook_bits", &hook_bits_of, "The node's hooks as bits: 1 tensor pre-hooks, 2 pre-hooks, 4 post-hooks, 8 post-accumulate-grad hooks.");
  m.def("call_tensor_pre_hooks", &call_tensor_pre_hooks, "The node's tensor pre-hooks on its incoming gradients (None: undefined), as eager calls them.");
  m.def("call_pre_hooks", &call_pre_hooks, "The node's pre-hooks on its incoming gradients, as eager calls them.");
  m.def("call_post_hooks", &call_post_hooks, "The node's post-hooks on (its results, its incoming gradients), as eager calls them.");
  m.def("call_post_accumulate_grad_hooks", &call_post_accumulate_grad_hooks, "An AccumulateGrad node's post-accumulate-grad hook, on its leaf.");
}

}  // namespace gpuautograd
