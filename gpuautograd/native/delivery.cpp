// Leaf gradient delivery (delivery.h): when eager's AccumulateGrad would steal a gradient as
// .grad, and the delivery to the Python walk's nodes.

#include "delivery.h"

#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/utils/grad_layout_contract.h>

#include <string>
#include <typeinfo>

namespace gpuautograd C10_HIDDEN {  // hidden: key.h says why
namespace {

// Whether the gradient layout contract is on (a switch newer torches have; before it, always).
template <typename State>
auto layout_enforced(const State& state, int) -> decltype(state.get_grad_layout_enforcement_enabled()) {
  return state.get_grad_layout_enforcement_enabled();
}
template <typename State>
bool layout_enforced(const State&, long) {
  return true;
}

}  // namespace

// The conditions under which eager's AccumulateGrad makes a fresh dense gradient the .grad as is.
bool LeafDelivery::stealable(const at::Tensor& grad, const at::Tensor& variable) {
  return !variable.grad_fn() && grad.layout() == at::kStrided && !grad.is_nested() && !grad.is_mkldnn() && !grad.requires_grad() &&
      !variable.is_sparse_csr() && grad.use_count() == 1 && !at::caching::is_cached_tensor(grad) &&
      (!layout_enforced(c10::AutogradState::get_tls_state(), 0) || torch::autograd::utils::obeys_layout_contract(grad, variable));
}

AccumulateGrad* as_accumulate_grad(Node* node, int64_t i) {
  auto* acc = node != nullptr && &typeid(*node) == &typeid(AccumulateGrad) ? static_cast<AccumulateGrad*>(node) : nullptr;
  TORCH_CHECK(acc, "node ", i, " (", node ? node->name() : std::string("null"), ") is not an AccumulateGrad node");
  return acc;
}

// The Python walk's nodes are Python objects: a C++ node's object holds the node.
void deliver_to_python_nodes(const LeafDelivery& plan, py::list outs, py::list nodes) {
  plan.run(outs, [&](int64_t i) {
    PyObject* obj = PyList_GET_ITEM(nodes.ptr(), i);
    TORCH_CHECK(torch::autograd::THPCppFunction_Check(obj), "node ", i, " of the walk is not a C++ autograd node");
    return as_accumulate_grad(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata.get(), i);
  });
}

}  // namespace gpuautograd
