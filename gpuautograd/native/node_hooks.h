// Running the Python hooks autograd keeps on a node (see node_hooks.cpp).
#pragma once

#include <torch/extension.h>

namespace gpuautograd {

// The hooks of a node, as bits (the walks key them; lowering emits a yield point per bit).
enum HookBits : int64_t {
  kTensorPreHooks = 1,   // Tensor.register_hook on one of the node's outputs (a leaf's, for AccumulateGrad)
  kPreHooks = 2,         // grad_fn.register_prehook, module backward pre-hooks
  kPostHooks = 4,        // grad_fn.register_hook, module full backward hooks
  kPostAccGradHooks = 8, // register_post_accumulate_grad_hook (AccumulateGrad only)
};

int64_t hook_bits(const torch::autograd::Node& node);

void register_node_hooks(pybind11::module& m);

}  // namespace gpuautograd
