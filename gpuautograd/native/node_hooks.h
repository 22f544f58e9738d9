// Running the Python hooks autograd keeps on a node (see node_hooks.cpp).
#pragma once

#include <torch/extension.h>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

namespace gpuautograd {

// The hooks of a node, as bits (the walks key them; lowering emits a yield point per bit).
enum HookBits : int64_t {
  kTensorPreHooks = 1,   // Tensor.register_hook on one of the node's outputs (a leaf's, for AccumulateGrad)
  kPreHooks = 2,         // grad_fn.register_prehook, module backward pre-hooks
  kPostHooks = 4,        // grad_fn.register_hook, module full backward hooks
  kPostAccGradHooks = 8, // register_post_accumulate_grad_hook (AccumulateGrad only)
};

// `acc`: the node as an AccumulateGrad, or nullptr (the walk knows it without a dynamic_cast).
// The emptiness checks only: no node has hooks on the common hit.
inline int64_t hook_bits(torch::autograd::Node& node, torch::autograd::AccumulateGrad* acc) {
  int64_t bits = 0;
  if (!node.tensor_pre_hooks().empty()) {
    bits |= kTensorPreHooks;
  }
  if (!node.pre_hooks().empty()) {
    bits |= kPreHooks;
  }
  if (!node.post_hooks().empty()) {
    bits |= kPostHooks;
  }
  if (acc != nullptr && acc->tensor_post_acc_grad_hooks() != nullptr) {
    bits |= kPostAccGradHooks;
  }
  return bits;
}

void register_node_hooks(pybind11::module& m);

}  // namespace gpuautograd
