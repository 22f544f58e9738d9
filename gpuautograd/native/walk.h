// The native walk over an autograd graph (NativeWalk, walk.cpp says how it goes), its buffers,
// and the hit path's calls around it: the short path's walk and lookup, loss.backward()'s short
// entry and the global state it checks, and what Python asks of a node that only C++ can see.
#pragma once

#include "key.h"
#include "saved_reader.h"

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace gpuautograd C10_HIDDEN {  // hidden: key.h says why

using torch::autograd::AccumulateGrad;
namespace ca = torch::dynamo::autograd;
class ArgumentPlan;  // table.h
class LeafDelivery;  // delivery.h
class ReplayPlan;    // table.h

// Node -> its index in the walk. Open addressing: std::unordered_map allocates once per entry,
// and every edge of every node looks its target up.
class NodeIndex {
 public:
  NodeIndex() : slots_(kInitial) {}

  // The index of `node`, inserting `next` if it has none; second: whether it was inserted.
  std::pair<int64_t, bool> try_emplace(const Node* node, int64_t next) {
    if ((size_ + 1) * 2 > slots_.size()) {
      grow();
    }
    Slot& slot = slots_[position(node)];
    if (slot.node == node) {
      return {slot.index, false};
    }
    slot = {node, next};
    ++size_;
    return {next, true};
  }

  // Empty again, at the initial size (a grown table would cost its size in every later clear).
  void clear() {
    if (slots_.size() != kInitial) {
      slots_.assign(kInitial, Slot{});
    } else {
      std::fill(slots_.begin(), slots_.end(), Slot{});
    }
    size_ = 0;
  }

  // The index of `node`, or -1.
  int64_t find(const Node* node) const {
    const Slot& slot = slots_[position(node)];
    return slot.node == node ? slot.index : -1;
  }

 private:
  struct Slot {
    const Node* node = nullptr;
    int64_t index = -1;
  };
  static constexpr size_t kInitial = 512;  // a power of two; gpt's 102 nodes fit without growing

  // The position of the slot holding `node`, or of the empty one where it would go.
  size_t position(const Node* node) const {
    size_t mask = slots_.size() - 1;
    size_t h = ((reinterpret_cast<uintptr_t>(node) >> 4) * 0x9E3779B97F4A7C15ull) >> 32;
    for (h &= mask;; h = (h + 1) & mask) {
      const Slot& slot = slots_[h];
      if (slot.node == node || slot.node == nullptr) {
        return h;
      }
    }
  }

  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    for (const auto& slot : old) {
      if (slot.node != nullptr) {
        slots_[position(slot.node)] = slot;
      }
    }
  }

  std::vector<Slot> slots_;
  size_t size_ = 0;
};

// A walk's growable buffers, which each thread keeps one set of between walks: a hit's walk
// then allocates none of them (about 7 µs of gpt's walk with the caches cold after a forward).
struct WalkBuffers {
  using Edge = std::pair<int64_t, uint32_t>;  // (node index, input_nr) in the walk
  WalkBuffers() {
    nodes.reserve(256);
    saved_sources.reserve(256);
    saved.reserve(256);
  }
  std::vector<NodePtr> nodes;
  NodeIndex index;
  KeyWriter key;
  std::vector<const SavedVariable*> saved_sources;  // the saved list's SavedVariable (compiled_args': nullptr)
  std::vector<at::Tensor> saved;  // a walk's saved list, between walks: its capacity, emptied
  std::vector<Edge> root_edges;
  std::vector<std::optional<Edge>> input_edges;
  std::vector<std::pair<const c10::TensorImpl*, int64_t>> by_impl;  // put_aliases' (tensor, saved index)

  // This thread's kept buffers, or new ones.
  static std::unique_ptr<WalkBuffers> take();
  // Keeps `used` for this thread's next walk, emptied (its nodes let go of).
  static void give_back(std::unique_ptr<WalkBuffers> used);

 private:
  static std::unique_ptr<WalkBuffers>& spare();
};

// One walk of the graph behind some roots (walk.cpp): its key, its saved tensors, and what it
// found that rules out the functional backward; then the program's arguments and leaf
// deliveries made from them.
class NativeWalk {
 public:
  NativeWalk();  // no allocation unless take_saved() took the last walk's
  ~NativeWalk();
  NativeWalk(const NativeWalk&) = delete;
  NativeWalk& operator=(const NativeWalk&) = delete;

  void run(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& inputs, const std::vector<std::optional<at::Tensor>>& grads);

  // (node index, output_nr) of a tensor's gradient edge in this walk, or None.
  py::object find(const at::Tensor& t) const;

  // For each SavedTensor of the Python walk's slots, the index of its tensor in the saved list.
  // At capture only.
  std::vector<int64_t> saved_index(const std::vector<py::object>& raw);

  py::object node(int64_t i) const;

  // The program's arguments, built straight from the collected tensors; the walk then lets go of
  // them, so the list holds the only references this walk had. With `release` (a backward without
  // retain_graph), the plan's functional nodes then free their saved values, as eager's do.
  py::list arguments(const ArgumentPlan& plan, py::list grads, bool release);

  void deliver(const LeafDelivery& plan, py::list outs) const;

  // The short path's replay, before its segments run: the program's arguments (the walk's saved
  // tensors and the incoming gradients, as `arguments` makes them) and fresh buffers bound into
  // the pointer table, held here until deliver_replay. False, with the walk as it was and nothing
  // released, when an address broke a promise: the caller then binds the Python way, which names it.
  bool bind_replay(const ArgumentPlan& plan, py::list grads, const ReplayPlan& replay, at::Tensor table, int64_t lo, bool release);

  // After the segments ran: the results to their leaves, the call's tensors let go of first (so a
  // result nothing else holds is stolen as .grad, as eager's AccumulateGrad steals it).
  void deliver_replay(const ReplayPlan& replay, const LeafDelivery& plan);

  // The cache key of this walk among `table`'s (runtime/cache.py: digest -> the keys
  // (backend, accumulate, "native", key bytes, retained, grad dtypes) with that digest): the one
  // with these head fields, no retained grads and this walk's bytes, compared in full; else None,
  // and None for a walk the short path can't use (unsupported or falling back: the general path
  // reads why). One call for what the digest, a Python tuple and a comparison per candidate cost.
  py::object match(const py::dict& table, const py::object& backend, bool accumulate, const py::object& grad_dtypes) const;

  // Saved tensor `i` of this walk, for an argument.
  const at::Tensor& saved_argument(int64_t i) const;

  // After binding: the walk lets go of its saved tensors and, with `release`, the plan's
  // functional nodes free theirs.
  void let_go(const ArgumentPlan& plan, bool release);

  // What eager's backward does after running a node without retain_graph.
  void release(const std::vector<int64_t>& indices);

  py::bytes key() const { return key_.bytes(); }
  // The saved tensors, handed over: afterwards the caller's list holds the only references this
  // walk had, so releasing them frees memory as eager's backward does.
  std::vector<at::Tensor> take_saved() { return std::exchange(saved_, {}); }
  // How many nodes the generated readers read (the rest went through compiled_args).
  int64_t read_by_readers() const { return read_by_readers_; }
  size_t size() const { return nodes_.size(); }
  std::optional<std::string> unsupported() const { return unsupported_; }
  std::optional<std::string> fallback() const { return fallback_; }
  // (node index, hook bits) of each node with hooks, in walk order.
  const std::vector<std::pair<int64_t, int64_t>>& hooked_nodes() const { return hooked_nodes_; }
  const std::vector<std::pair<int64_t, int64_t>>& aliases() const { return aliases_; }
  py::tuple root_edges() const;
  py::tuple input_edges() const;

 private:
  using Edge = WalkBuffers::Edge;

  // The walk's steps, defined in walk.cpp with their comments and called nowhere else. Declared
  // inline so the compiler may fold them into their callers, as it did when the walker was one
  // file: a plain declaration makes each a function another file could call, kept out of line.
  inline int64_t discover(const NodePtr& fn);
  inline std::optional<Edge> find_edge(const at::Tensor& t) const;
  inline void set_fallback(std::string reason);
  inline void visit(size_t i);
  inline void put_edges(const Node& node);
  inline void put_input_metadata(const Node& node);
  inline void put_leaf(AccumulateGrad& acc);
  inline void put_python(PyObject* obj);
  inline void put_cpp(size_t i, const std::type_info& type);
  inline void read_saved(const NodePtr& node, ReadSaved read);
  inline void collect_saved(const NodePtr& node);
  inline void check_node_hooks(size_t i, Node& node, AccumulateGrad* acc);
  inline void put_aliases();

  std::unique_ptr<WalkBuffers> buffers_ = WalkBuffers::take();
  std::vector<NodePtr>& nodes_ = buffers_->nodes;
  NodeIndex& index_ = buffers_->index;
  KeyWriter& key_ = buffers_->key;
  std::vector<at::Tensor> saved_ = std::move(buffers_->saved);  // the walk's saved tensors: the program's saved arguments
  std::vector<const SavedVariable*>& saved_sources_ = buffers_->saved_sources;
  int64_t read_by_readers_ = 0;
  std::optional<ca::AutogradCompilerCall> compiler_;  // made for the first node without a reader
  std::vector<int64_t> ca_index_;  // compiled_args' tensor index -> the saved list's
  ca::NodeCall call_{0, NodePtr()};
  std::vector<at::Tensor> call_tensors_;  // bind_replay's to deliver_replay's
  std::vector<Edge>& root_edges_ = buffers_->root_edges;
  std::vector<std::optional<Edge>>& input_edges_ = buffers_->input_edges;
  std::optional<std::string> unsupported_;  // this graph needs the Python walk
  std::optional<std::string> fallback_;  // this backward must run eagerly
  std::vector<std::pair<int64_t, int64_t>> hooked_nodes_;
  std::vector<std::pair<int64_t, int64_t>> aliases_;  // (saved index, the first saved index of the same tensor)
};

std::unique_ptr<NativeWalk> walk(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& inputs,
                                 const std::vector<std::optional<at::Tensor>>& grads);

// The short path's walk and lookup in one call: (the walk, the plan cache's entry for its key or
// None), for a call with no grad dtypes to key. `table` is PlanCache.by_digest, where match finds
// the key; `entries` is PlanCache.entries, an OrderedDict that PlanCache.get reads and moves to its
// most recent end, as this does; `backends` as short_path_backend reads it. (None, None), with
// nothing walked, where that finds no backend. One call where a Python frame per step costs a
// microsecond or more with the caches cold after a forward.
py::tuple walk_lookup(const std::vector<at::Tensor>& roots, const std::vector<std::optional<at::Tensor>>& grads, const py::dict& table,
                      const py::object& entries, const py::object& backends, bool accumulate);

// What rules out every functional backward right now, as api._global_fallback_reason checks it
// through torch's Python bindings (each binding those checks call reads what this reads), in its
// order: one call where six cost a microsecond or more each with the caches cold after a forward.
enum GlobalState : int { kClear = 0, kAnomaly, kSavedTensorHooks, kTransform, kObserved };
int global_state();

// torch's implicit gradient of loss.backward() (torch.ones_like(out, memory_format=
// torch.preserve_format)) for a plain tensor (type torch.Tensor) that requires grad and is one
// floating-point element, not nested; None for anything else, and while a torch function mode is
// active (it would see the ones_like call eager makes in Python).
py::object implicit_grad(py::handle obj);

// loss.backward()'s short entry, in one call where the checks cost a microsecond or more each with
// the caches cold after a forward: the implicit gradient (implicit_grad) where the native walker is
// not turned off (GPUAUTOGRAD_NATIVE "auto" or "1", read as os.environ writes it) and no global
// state rules out a functional backward; else None, and api.backward's general path decides.
py::object loss_grad(py::handle out);

// How many C++ post hooks an AccumulateGrad node carries (DDP's reducer registers one per
// parameter; Python can't see them). `node` is the Python object of a C++ node.
int64_t post_hook_count(py::object node);

// The geometry (sizes, strides, storage offset) of as_strided's input, which autograd keeps in C++
// only: as_strided's backward depends on it. The native key holds it (the node's generated reader
// reads every field), so a plan captured under this walker may depend on it. None for other nodes.
py::object as_strided_geometry(py::object node);

}  // namespace gpuautograd
