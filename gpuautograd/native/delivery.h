// Leaf gradients to their AccumulateGrad nodes, the way eager's AccumulateGrad delivers them
// (LeafDelivery): only C++ can see whether a gradient is referenced elsewhere (torch's use_count
// rule for stealing it as .grad).
#pragma once

#include <torch/extension.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/ops/_foreach_add.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

namespace py = pybind11;

namespace gpuautograd C10_HIDDEN {  // hidden: key.h says why

using torch::autograd::AccumulateGrad;
using torch::autograd::Node;

// Node::mutex_ is protected; eager's AccumulateGrad::apply holds it while it writes .grad, so the
// delivery's own fast path takes it too (this type is never instantiated).
struct NodeMutex : Node {
  static std::mutex& of(Node& node) { return node.*(&NodeMutex::mutex_); }
};

// The leaf sinks of one captured program: output k of the program goes to the AccumulateGrad
// node `node[k]` of the walk. `copy[k]` marks an output that may share storage with something
// else the program returned or read (a view of an input): never stolen, whatever its use_count.
class LeafDelivery {
 public:
  LeafDelivery(std::vector<int64_t> output, std::vector<int64_t> node, std::vector<bool> copy)
      : output_(std::move(output)), node_(std::move(node)), copy_(std::move(copy)) {
    TORCH_CHECK(output_.size() == node_.size() && node_.size() == copy_.size(), "LeafDelivery: lengths differ");
  }

  // Leaves that have a dense .grad add in place (AccumulateGrad's `grad += new`), all in one
  // _foreach_add_; every other leaf runs AccumulateGrad::apply itself, so stealing, the layout
  // contract, sparse gradients and frozen leaves follow eager exactly. `outs` loses the entries
  // it delivers: a gradient nothing else holds then has use_count 1 and becomes .grad uncopied.
  template <typename NodeAt>
  void run(py::list outs, const NodeAt& node_at) const {
    TORCH_CHECK(std::all_of(output_.begin(), output_.end(), [&](int64_t j) { return j < PyList_GET_SIZE(outs.ptr()); }),
                "LeafDelivery: fewer results than the plan delivers");
    run_from(
        [&](int64_t j) {
          PyObject* item = PyList_GET_ITEM(outs.ptr(), j);
          if (item == Py_None) {
            return at::Tensor();
          }
          at::Tensor grad = THPVariable_Unpack(item);
          Py_INCREF(Py_None);
          PyList_SetItem(outs.ptr(), j, Py_None);  // drops the list's reference
          return grad;
        },
        node_at);
  }

  // The same from results held in C++, which lose the entries delivered.
  template <typename NodeAt>
  void run(std::vector<at::Tensor>& outs, const NodeAt& node_at) const {
    run_from([&](int64_t j) { return std::move(outs.at(j)); }, node_at);
  }

  size_t size() const { return output_.size(); }

 private:
  // `take(j)`: result j, undefined for None, with the caller's reference to it dropped.
  template <typename Take, typename NodeAt>
  void run_from(const Take& take, const NodeAt& node_at) const {
    at::NoGradGuard no_grad;  // eager's backward runs with grad mode = create_graph (False here)
    std::vector<at::Tensor> existing, incoming;
    for (size_t k = 0; k < output_.size(); ++k) {
      at::Tensor grad = take(output_[k]);
      if (!grad.defined()) {
        continue;
      }
      auto* acc = node_at(node_[k]);
      const at::Tensor& variable = acc->variable;
      if (!variable.requires_grad()) {
        continue;  // frozen after the forward: AccumulateGrad skips it too
      }
      const at::Tensor& current = variable.grad();
      if (current.defined() && current.layout() == at::kStrided && grad.layout() == at::kStrided && !current.is_nested()) {
        existing.push_back(current);
        incoming.push_back(std::move(grad));
        continue;
      }
      if (!current.defined() && !copy_[k] && stealable(grad, variable)) {
        // AccumulateGrad's Case 1.1 (stealing a dense gradient), minus the detach: the program ran
        // without grad mode, so the gradient has no history to cut.
        std::lock_guard<std::mutex> lock(NodeMutex::of(*acc));  // as AccumulateGrad::apply holds it
        variable.mutable_grad() = std::move(grad);
        continue;
      }
      at::Tensor hold = copy_[k] ? grad : at::Tensor();  // a second reference forbids stealing
      torch::autograd::variable_list in;
      in.reserve(1);
      in.push_back(std::move(grad));
      acc->apply(std::move(in));
    }
    if (!existing.empty()) {
      at::_foreach_add_(existing, incoming);
    }
  }

  static bool stealable(const at::Tensor& grad, const at::Tensor& variable);  // delivery.cpp

  std::vector<int64_t> output_, node_;
  std::vector<bool> copy_;
};

// Node `i` of a walk as the AccumulateGrad node it must be (a TORCH_CHECK error names it if not).
AccumulateGrad* as_accumulate_grad(Node* node, int64_t i);

// LeafDelivery for the Python walk's node list (`nodes`, the nodes' Python objects).
void deliver_to_python_nodes(const LeafDelivery& plan, py::list outs, py::list nodes);

}  // namespace gpuautograd
