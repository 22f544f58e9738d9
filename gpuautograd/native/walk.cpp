// gpuautograd's native walker: the hit path's walk over an autograd graph, in C++.
//
// One call walks the graph breadth-first over next_edges() in the same discovery order as the
// Python walk (capture/walk.py), writes the cache key as bytes, collects every saved tensor, and
// notes what would make the functional backward wrong (hooks, unpack hooks, layouts). Saved
// values are read by their node class's generated reader (saved_reader.h), or else with
// Node::compiled_args, the visitor compiled autograd uses: it reaches every generated node's saved
// fields without Python and without running anything.
//
// Decisions stay in Python; the walker reads the graph, and delivers leaf gradients the way
// eager's AccumulateGrad does (LeafDelivery), since only C++ can see whether a gradient is
// referenced elsewhere (torch's use_count rule for stealing it as .grad).
//
// The walker's files, one concern each, built into one extension (native/__init__.py):
//   walk.h/.cpp          this file: the walk (NativeWalk) and the hit path's calls around it
//   key.h/.cpp           the cache key's bytes: tags, KeyWriter, a tensor's metadata, the digest
//   saved_reader.h/.cpp  saved values through the generated readers (saved_readers.inc)
//   table.h/.cpp         a bound plan's replay: pointer-table slots, fresh buffers, argument order
//   delivery.h/.cpp      leaf gradients to their AccumulateGrad nodes (LeafDelivery)
//   node_hooks.h/.cpp    a node's Python hooks, run where the program yields
//   bindings.cpp         the Python module

#include "walk.h"

#include "delivery.h"
#include "node_hooks.h"
#include "table.h"

#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/SavedTensorHooks.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <cstdlib>
#include <cstring>
#include <unordered_map>

namespace gpuautograd C10_HIDDEN {  // hidden: key.h says why
namespace {

using Edge = WalkBuffers::Edge;

py::object edge_object(const std::optional<Edge>& edge) {
  return edge ? py::object(py::make_tuple(edge->first, edge->second)) : py::object(py::none());
}

// The edges as Python tuples, made when asked (the general path asks; a hit does not).
template <typename Edges>
py::tuple edge_objects(const Edges& edges) {
  py::tuple out(edges.size());
  for (size_t k = 0; k < edges.size(); ++k) {
    out[k] = edge_object(edges[k]);
  }
  return out;
}

bool equal(PyObject* a, PyObject* b) {
  if (a == b) {
    return true;
  }
  int same = PyObject_RichCompareBool(a, b, Py_EQ);
  if (same < 0) {
    throw py::error_already_set();
  }
  return same == 1;
}

// The node's Python object: a plain pointer in torch 2.11, behind a PyObjectSlot in 2.13 (the
// first overload exists only where pyobj_slot() does).
template <typename N>
auto load_pyobj(const N& node, int) -> decltype(node.pyobj_slot()->load_pyobj()) {
  return node.pyobj_slot()->load_pyobj();
}
template <typename N>
PyObject* load_pyobj(const N& node, long) {
  return node.pyobj();
}

// The THPFunction of a node defined in Python (a PyNode), else nullptr. PyNode's type info is
// not exported from libtorch_python, so the node's Python object tells.
PyObject* python_function(const Node& node) {
  PyObject* obj = load_pyobj(node, 0);
  return obj != nullptr && PyObject_TypeCheck(obj, &THPFunctionType) ? obj : nullptr;
}

std::string first_line(const char* what) {
  std::string s(what);
  auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

}  // namespace

std::unique_ptr<WalkBuffers> WalkBuffers::take() {
  auto& kept = spare();
  return kept ? std::move(kept) : std::make_unique<WalkBuffers>();
}

void WalkBuffers::give_back(std::unique_ptr<WalkBuffers> used) {
  used->nodes.clear();
  used->index.clear();
  used->key.clear();
  used->saved_sources.clear();
  used->saved.clear();
  used->root_edges.clear();
  used->input_edges.clear();
  used->by_impl.clear();
  spare() = std::move(used);
}

std::unique_ptr<WalkBuffers>& WalkBuffers::spare() {
  thread_local std::unique_ptr<WalkBuffers> kept;
  return kept;
}

NativeWalk::NativeWalk() {
  saved_.reserve(256);
}

NativeWalk::~NativeWalk() {
  saved_.clear();  // its tensors let go of here, as before; its capacity serves the next walk
  buffers_->saved = std::move(saved_);
  WalkBuffers::give_back(std::move(buffers_));
}

void NativeWalk::run(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& inputs,
                     const std::vector<std::optional<at::Tensor>>& grads) {
  for (const auto& g : grads) {
    // Keyed as the Python walk keys them; a gradient without strides is the Python walk's to
    // refuse, with its words.
    if (!g || !g->defined() || layout_problem(*g, [] { return "a root gradient"; })) {
      unsupported_ = "a root gradient the native key can't describe";
      return;
    }
    key_.put(kGrad);
    put_tensor_meta(key_, *g);
  }
  for (const auto& t : roots) {
    auto edge = torch::autograd::impl::gradient_edge(t);
    TORCH_CHECK(edge.function, "a root tensor has no gradient edge (does it require grad?)");
    root_edges_.emplace_back(discover(edge.function), edge.input_nr);
  }
  for (size_t i = 0; i < nodes_.size() && !unsupported_; ++i) {  // nodes_ grows: breadth-first
    visit(i);
  }
  for (auto [j, nr] : root_edges_) {
    key_.put(kRoot);
    key_.put(j);
    key_.put(nr);
  }
  for (const auto& t : inputs) {
    auto edge = find_edge(t);
    input_edges_.push_back(edge);
    key_.put(kInput);
    if (edge) {
      key_.put(edge->first);
      key_.put(edge->second);
    }
  }
  if (!unsupported_ && !fallback_) {
    put_aliases();
  }
}

// Saved tensors that are one tensor (the input x of both x * r and x.pow(2)): the plan reads it
// once, so the key says which are, and a call where they are two tensors misses. One tensor is
// one TensorImpl, not the same data: that stays true whatever happens to its storage between the
// walk and the run (FSDP frees a parameter's storage after the forward and refills it before the
// backward uses it). A capture reads as one only the slots that both this key and the Python
// walk pair (capture/native_walk.py's confirmed_aliases).
void NativeWalk::put_aliases() {
  auto& by_impl = buffers_->by_impl;
  for (size_t k = 0; k < saved_.size(); ++k) {
    if (saved_[k].defined()) {
      by_impl.emplace_back(saved_[k].unsafeGetTensorImpl(), static_cast<int64_t>(k));
    }
  }
  std::sort(by_impl.begin(), by_impl.end());  // one impl's slots in saved order: the first is the one read
  for (size_t a = 1, first = 0; a < by_impl.size(); ++a) {
    if (by_impl[a].first != by_impl[first].first) {
      first = a;
    } else {
      aliases_.emplace_back(by_impl[a].second, by_impl[first].second);
    }
  }
  if (!aliases_.empty()) {
    std::sort(aliases_.begin(), aliases_.end());
    key_.put(kAliases);
    key_.put<uint32_t>(aliases_.size());
    for (const auto& [k, rep] : aliases_) {
      key_.put(k);
      key_.put(rep);
    }
  }
}

py::object NativeWalk::find(const at::Tensor& t) const {
  return edge_object(find_edge(t));
}

std::vector<int64_t> NativeWalk::saved_index(const std::vector<py::object>& raw) {
  std::unordered_map<const SavedVariable*, int64_t> read;  // the readers' SavedVariables
  for (size_t k = 0; k < saved_sources_.size(); ++k) {
    if (saved_sources_[k] != nullptr) {
      read.emplace(saved_sources_[k], static_cast<int64_t>(k));
    }
  }
  std::vector<int64_t> out;
  out.reserve(raw.size());
  for (const auto& obj : raw) {
    const auto* sv = &obj.cast<const SavedVariable&>();
    if (auto it = read.find(sv); it != read.end()) {
      out.push_back(it->second);
      continue;
    }
    TORCH_CHECK(compiler_, "a saved tensor the native walk did not read");
    out.push_back(ca_index_.at(compiler_->tensor_args.lookup(*sv).index()));
  }
  return out;
}

py::object NativeWalk::node(int64_t i) const {
  return py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(nodes_.at(i)));
}

py::list NativeWalk::arguments(const ArgumentPlan& plan, py::list grads, bool release) {
  const auto& kinds = plan.kinds();
  const auto& indices = plan.indices();
  py::list args(kinds.size());
  for (size_t k = 0; k < kinds.size(); ++k) {
    int64_t i = indices[k];
    PyObject* obj;
    if (kinds[k] == ArgumentPlan::kSavedArg) {
      obj = THPVariable_Wrap(saved_argument(i));
    } else if (kinds[k] == ArgumentPlan::kGradArg) {
      obj = PyList_GetItem(grads.ptr(), i);
      Py_XINCREF(obj);
    } else {
      obj = torch::autograd::functionToPyObject(nodes_.at(i));
    }
    if (obj == nullptr) {
      throw py::error_already_set();
    }
    PyList_SET_ITEM(args.ptr(), k, obj);  // steals the reference
  }
  let_go(plan, release);
  return args;
}

void NativeWalk::deliver(const LeafDelivery& plan, py::list outs) const {
  plan.run(outs, [&](int64_t i) { return as_accumulate_grad(nodes_.at(i).get(), i); });
}

bool NativeWalk::bind_replay(const ArgumentPlan& plan, py::list grads, const ReplayPlan& replay, at::Tensor table, int64_t lo,
                             bool release) {
  const auto& kinds = plan.kinds();
  const auto& indices = plan.indices();
  TORCH_CHECK(static_cast<int64_t>(kinds.size()) == replay.num_args(), "bind_replay: the argument plan does not match the replay's");
  call_tensors_.clear();
  call_tensors_.reserve(kinds.size());
  for (size_t k = 0; k < kinds.size(); ++k) {
    int64_t i = indices[k];
    if (kinds[k] == ArgumentPlan::kSavedArg) {
      call_tensors_.push_back(saved_argument(i));
    } else if (kinds[k] == ArgumentPlan::kGradArg) {
      TORCH_CHECK(i >= 0 && i < PyList_GET_SIZE(grads.ptr()), "gradient argument ", i, " is not one of the ", PyList_GET_SIZE(grads.ptr()));
      call_tensors_.push_back(THPVariable_Unpack(PyList_GET_ITEM(grads.ptr(), i)));
    } else {
      call_tensors_.clear();
      TORCH_CHECK(false, "bind_replay: a node argument (an opaque node) is not the short path's");
    }
  }
  if (!replay.bind(call_tensors_, table, lo)) {
    call_tensors_.clear();
    return false;
  }
  let_go(plan, release);  // the call's tensors hold the only references this walk had
  return true;
}

void NativeWalk::deliver_replay(const ReplayPlan& replay, const LeafDelivery& plan) {
  auto outs = replay.results(call_tensors_);
  plan.run(outs, [&](int64_t i) { return as_accumulate_grad(nodes_.at(i).get(), i); });
}

py::object NativeWalk::match(const py::dict& table, const py::object& backend, bool accumulate, const py::object& grad_dtypes) const {
  if (unsupported_ || fallback_) {
    return py::none();
  }
  py::int_ digest(key_.digest());
  PyObject* keys = PyDict_GetItemWithError(table.ptr(), digest.ptr());
  if (keys == nullptr) {
    if (PyErr_Occurred()) {
      throw py::error_already_set();
    }
    return py::none();
  }
  TORCH_CHECK(PyList_Check(keys), "match: the digest table holds a ", Py_TYPE(keys)->tp_name, ", not a list of keys");
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(keys); ++k) {
    PyObject* key = PyList_GET_ITEM(keys, k);
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 6 || !PyBytes_Check(PyTuple_GET_ITEM(key, 3))) {
      continue;
    }
    PyObject* retained = PyTuple_GET_ITEM(key, 4);
    if (PyTuple_GET_ITEM(key, 1) != (accumulate ? Py_True : Py_False) || !PyTuple_Check(retained) || PyTuple_GET_SIZE(retained) != 0) {
      continue;
    }
    if (!equal(PyTuple_GET_ITEM(key, 0), backend.ptr()) || !equal(PyTuple_GET_ITEM(key, 5), grad_dtypes.ptr())) {
      continue;
    }
    if (key_.equals(py::reinterpret_borrow<py::bytes>(PyTuple_GET_ITEM(key, 3)))) {
      return py::reinterpret_borrow<py::object>(key);
    }
  }
  return py::none();
}

const at::Tensor& NativeWalk::saved_argument(int64_t i) const {
  TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(saved_.size()), "saved argument ", i, " is not in this walk");
  return saved_[i];
}

void NativeWalk::let_go(const ArgumentPlan& plan, bool release) {
  saved_.clear();
  if (release) {
    this->release(plan.release());
  }
}

void NativeWalk::release(const std::vector<int64_t>& indices) {
  for (auto i : indices) {
    nodes_.at(i)->release_variables();
  }
}

py::tuple NativeWalk::root_edges() const {
  return edge_objects(root_edges_);
}

py::tuple NativeWalk::input_edges() const {
  return edge_objects(input_edges_);
}

int64_t NativeWalk::discover(const NodePtr& fn) {
  auto [i, fresh] = index_.try_emplace(fn.get(), static_cast<int64_t>(nodes_.size()));
  if (fresh) {
    nodes_.push_back(fn);
  }
  return i;
}

std::optional<Edge> NativeWalk::find_edge(const at::Tensor& t) const {
  auto edge = torch::autograd::impl::gradient_edge(t);
  if (!edge.function) {
    return std::nullopt;
  }
  int64_t i = index_.find(edge.function.get());
  if (i < 0) {
    return std::nullopt;
  }
  return Edge(i, edge.input_nr);
}

void NativeWalk::set_fallback(std::string reason) {
  if (!fallback_) {
    fallback_ = std::move(reason);
  }
}

void NativeWalk::visit(size_t i) {
  // A plain pointer: nodes_ keeps the node alive, and discover() may move nodes_'s elements.
  Node* node = nodes_[i].get();
  key_.put(kNode);
  put_edges(*node);
  put_input_metadata(*node);
  // The exact type, not a dynamic_cast: a failed cast searches the node's class hierarchy. Its
  // type_info's address, not type_info::operator==, which compares the names of two types that
  // differ: AccumulateGrad's one type_info is libtorch's (its key function is there).
  const std::type_info& type = typeid(*node);
  auto* acc = &type == &typeid(AccumulateGrad) ? static_cast<AccumulateGrad*>(node) : nullptr;
  if (acc != nullptr) {
    put_leaf(*acc);
  } else if (PyObject* obj = python_function(*node)) {
    put_python(obj);
  } else {
    put_cpp(i, type);
  }
  check_node_hooks(i, *node, acc);
}

void NativeWalk::put_edges(const Node& node) {
  const auto& edges = node.next_edges();
  key_.put<uint32_t>(edges.size());
  for (const auto& e : edges) {
    if (!e.is_valid()) {
      key_.put(kNoEdge);
      continue;
    }
    key_.put(kEdge);
    key_.put(discover(e.function));
    key_.put(e.input_nr);
  }
}

void NativeWalk::put_input_metadata(const Node& node) {
  uint32_t n = node.num_inputs();
  key_.put(n);
  for (uint32_t k = 0; k < n; ++k) {
    const auto& m = node.input_metadata(k);
    key_.put(kMeta);
    if (m.is_nested_tensor()) {
      set_fallback("a nested tensor flows into " + node.name());
      continue;
    }
    if (m.layout() != at::kStrided) {
      std::ostringstream os;
      os << "a gradient with layout " << m.layout() << " flows into " << node.name();
      set_fallback(os.str());
    }
    auto shape = m.shape_as_dim_vector();
    key_.put<uint32_t>(shape.size());
    for (const auto& s : shape) {
      auto size = s.maybe_as_int();
      key_.put(size ? *size : s.guard_int(__FILE__, __LINE__));  // a symbolic size: as compiled autograd guards it
    }
    key_.put(m.dtype().toScalarType());
    key_.put(m.device().type());
    key_.put(m.device().index());
    key_.put(m.is_tensor_subclass());
  }
}

void NativeWalk::put_leaf(AccumulateGrad& acc) {
  key_.put(kLeaf);
  const auto& var = acc.variable;
  if (!var.defined()) {
    unsupported_ = "an AccumulateGrad node whose variable was released";
    return;
  }
  if (auto problem = layout_problem(var, [] { return "a leaf of the graph"; })) {
    set_fallback(*problem);
    return;
  }
  put_tensor_meta(key_, var);
}

void NativeWalk::put_python(PyObject* obj) {
  key_.put(kPython);
  // The class object stays alive while a plan keyed by it is cached: the entry holds the Python
  // walk's key, which holds the class.
  key_.put(reinterpret_cast<uintptr_t>(Py_TYPE(obj)));
  PyObject* needs = reinterpret_cast<THPFunction*>(obj)->needs_input_grad;
  if (needs == nullptr || !PyTuple_Check(needs)) {
    unsupported_ = "a Python autograd node without needs_input_grad";
    return;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(needs);
  key_.put<uint32_t>(n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    key_.put<uint8_t>(PyTuple_GET_ITEM(needs, k) == Py_True);
  }
}

void NativeWalk::put_cpp(size_t i, const std::type_info& type) {
  const NodePtr& node = nodes_[i];
  // The type_info's address names one C++ type (see ReaderTable) and lives as long as the process.
  key_.put(reinterpret_cast<uintptr_t>(&type));
  if (ReadSaved read = reader_of(type)) {
    read_saved(node, read);
  } else {
    collect_saved(node);
  }
}

// A generated node's saved values, through its reader.
void NativeWalk::read_saved(const NodePtr& node, ReadSaved read) {
  ++read_by_readers_;
  size_t before = saved_.size();
  key_.put(kRead);
  SavedReader reader(key_, saved_, saved_sources_, node);
  read(*node, reader);
  if (reader.hooked) {
    // As below: the node runs opaque, keyed by what reads without unpacking.
    saved_.resize(before);
    saved_sources_.resize(before);
    key_.put(kHooked);
  } else if (reader.symbolic) {
    unsupported_ = node->name() + " saves a symbolic value";
  } else if (reader.problem) {
    set_fallback(*reader.problem);
  }
}

// Any other node's saved values, through compiled_args: the tensors it collects are moved to
// the saved list, each distinct tensor once (ca_index_ maps its index to theirs).
void NativeWalk::collect_saved(const NodePtr& node) {
  if (!compiler_) {
    compiler_.emplace(ca::SizeInput::STATIC);
  }
  auto& compiler = *compiler_;
  size_t tensors_before = compiler.tensor_args.inputs.size();
  size_t sizes_before = compiler.all_size_inputs.size();
  size_t lifted_before = compiler.lifted_ivalue_args.args.size();
  size_t hooks_before = compiler.hooks.size();
  // One NodeCall for every node: compiled_args reads only its node (to unpack saved outputs),
  // and a map entry per node would cost an allocation each.
  call_.node = node;
  ca::CompiledNodeArgs args(compiler, call_);
  try {
    node->compiled_args(args);
  } catch (const c10::NotImplementedError& e) {
    unsupported_ = node->name() + " can't be read natively (" + first_line(e.what_without_backtrace()) + ")";
    return;
  }
  auto& tensors = compiler.tensor_args.inputs;
  for (size_t k = tensors_before; k < tensors.size(); ++k) {
    ca_index_.push_back(static_cast<int64_t>(saved_.size()));
    saved_.push_back(std::move(tensors[k]));
    saved_sources_.push_back(nullptr);
  }
  if (compiler.hooks.size() != hooks_before) {
    // compiled_args saw a saved variable with unpack hooks and did not unpack it. The node runs
    // opaque, when eager would run it (its unpack hooks run then, once), so its key is what
    // reads without unpacking: its type, edges and input metadata (written above), no saved value.
    key_.put(kHooked);
    return;
  }
  auto ck = args.key();
  key_.put(kSaved);
  key_.put_raw(ck.key, ck.key_size);
  for (size_t k = saved_.size() - (tensors.size() - tensors_before); k < saved_.size(); ++k) {
    if (auto problem = layout_problem(saved_[k], [&] { return "saved by " + node->name(); })) {
      set_fallback(*problem);
      return;
    }
    put_tensor_meta(key_, saved_[k]);
  }
  key_.put(kSizes);
  const auto& sizes = compiler.all_size_inputs;
  key_.put<uint32_t>(sizes.size() - sizes_before);
  for (size_t k = sizes_before; k < sizes.size(); ++k) {
    key_.put(sizes[k].value);
  }
  key_.put(kLifted);
  const auto& lifted = compiler.lifted_ivalue_args.args;
  for (size_t k = lifted_before; k < lifted.size(); ++k) {
    const at::IValue& iv = *lifted[k].actual_ptr;
    key_.put(iv.isInt() ? iv.toInt() : 0);
    key_.put(iv.isDouble() ? iv.toDouble() : 0.0);
    if (!iv.isInt() && !iv.isDouble()) {
      unsupported_ = node->name() + " saves a symbolic value";
    }
  }
}

// Hooks on the node: the program yields to the host there and runs them (node_hooks.cpp), so
// which hooks hang where is part of the key. The emptiness checks first: no node has hooks on
// the common hit. Hooks on an AccumulateGrad node itself (not its leaf's) are C++ hooks of
// DDP-like wrappers, which the distributed planner drives, or the eager engine.
void NativeWalk::check_node_hooks(size_t i, Node& node, AccumulateGrad* acc) {
  int64_t bits = hook_bits(node, acc);
  if (bits == 0) {
    return;
  }
  if (acc != nullptr && (bits & (kPreHooks | kPostHooks))) {
    set_fallback(std::string("a ") + ((bits & kPreHooks) ? "pre-hook" : "hook") + " is registered on autograd node " +
                 node.name() + " (grad_fn.register_hook or a C++ hook of a wrapper)");
    return;
  }
  key_.put(kHookBits);
  key_.put(static_cast<int64_t>(i));
  key_.put(bits);
  hooked_nodes_.emplace_back(static_cast<int64_t>(i), bits);
}

int64_t post_hook_count(py::object node) {
  PyObject* obj = node.ptr();
  TORCH_CHECK(torch::autograd::THPCppFunction_Check(obj), "post_hook_count: not a C++ autograd node");
  return static_cast<int64_t>(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata->post_hooks().size());
}

py::object as_strided_geometry(py::object node) {
  PyObject* obj = node.ptr();
  TORCH_CHECK(torch::autograd::THPCppFunction_Check(obj), "as_strided_geometry: not a C++ autograd node");
  Node* n = reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata.get();
  const at::TensorGeometry* g = nullptr;
  if (auto* a = dynamic_cast<torch::autograd::generated::AsStridedBackward0*>(n)) {
    g = &a->self_geometry;
  } else if (auto* c = dynamic_cast<torch::autograd::generated::AsStridedBackward0_copy*>(n)) {
    g = &c->self_geometry;
  }
  if (g == nullptr) {
    return py::none();
  }
  return py::make_tuple(g->sizes().vec(), g->strides().vec(), g->storage_offset());
}

std::unique_ptr<NativeWalk> walk(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& inputs,
                                 const std::vector<std::optional<at::Tensor>>& grads) {
  auto w = std::make_unique<NativeWalk>();
  w->run(roots, inputs, grads);
  return w;
}

namespace {

// The backend of a short-path lookup, resolved for the device of `root`, or None: `backends` is
// the (CPU, CUDA) pair of one backend (engine._backend_by_device), or a dict of such pairs by name
// for GPUAUTOGRAD_BACKEND's value ("auto" where unset), read as os.environ writes it. None for
// another device, a backend that can't run on this one, or a value not in the dict: the general
// path resolves it and says why.
py::object short_path_backend(const at::Tensor& root, const py::object& backends) {
  PyObject* pair = backends.ptr();
  if (PyDict_Check(pair)) {
    const char* name = std::getenv("GPUAUTOGRAD_BACKEND");
    pair = PyDict_GetItemString(pair, name != nullptr ? name : "auto");  // borrowed
    if (pair == nullptr) {
      return py::none();
    }
  }
  TORCH_CHECK(PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2, "walk_lookup: backends is not a (CPU, CUDA) pair or a dict of them");
  PyObject* backend = root.is_cpu() ? PyTuple_GET_ITEM(pair, 0) : root.is_cuda() ? PyTuple_GET_ITEM(pair, 1) : Py_None;
  return py::reinterpret_borrow<py::object>(backend);
}

}  // namespace

py::tuple walk_lookup(const std::vector<at::Tensor>& roots, const std::vector<std::optional<at::Tensor>>& grads, const py::dict& table,
                      const py::object& entries, const py::object& backends, bool accumulate) {
  TORCH_CHECK(PyDict_Check(entries.ptr()), "walk_lookup: the cache's entries are a ", Py_TYPE(entries.ptr())->tp_name, ", not a dict");
  TORCH_CHECK(!roots.empty(), "walk_lookup: no roots");
  py::object backend = short_path_backend(roots[0], backends);
  if (backend.is_none()) {
    return py::make_tuple(py::none(), py::none());
  }
  auto w = walk(roots, {}, grads);
  py::object key = w->match(table, backend, accumulate, py::tuple());
  py::object entry = py::none();
  if (!key.is_none()) {
    // An OrderedDict keeps its items in its dict part: a plain lookup, then the LRU touch
    PyObject* found = PyDict_GetItemWithError(entries.ptr(), key.ptr());
    if (found == nullptr && PyErr_Occurred()) {
      throw py::error_already_set();
    }
    if (found != nullptr) {
      entry = py::reinterpret_borrow<py::object>(found);
      static PyObject* move_to_end = PyUnicode_InternFromString("move_to_end");
      PyObject* done = PyObject_CallMethodOneArg(entries.ptr(), move_to_end, key.ptr());
      if (done == nullptr) {
        throw py::error_already_set();
      }
      Py_DECREF(done);
    }
  }
  return py::make_tuple(py::cast(std::move(w)), std::move(entry));
}

int global_state() {
  if (torch::autograd::AnomalyMode::is_enabled()) {
    return kAnomaly;
  }
  if (at::SavedTensorDefaultHooks::get_hooks(false).has_value()) {
    return kSavedTensorHooks;
  }
  auto included = c10::impl::tls_local_dispatch_key_set().included_;
  if (included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) || included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode)) {
    return kTransform;
  }
  if (c10::impl::TorchDispatchModeTLS::stack_len() > 0 || torch::profiler::impl::profilerEnabled()) {
    return kObserved;
  }
  return kClear;
}

py::object implicit_grad(py::handle obj) {
  if (Py_TYPE(obj.ptr()) != reinterpret_cast<PyTypeObject*>(THPVariableClass) || at::impl::PythonTorchFunctionTLS::stack_len() > 0) {
    return py::none();
  }
  const at::Tensor& out = THPVariable_Unpack(obj.ptr());
  if (!out.requires_grad() || out.is_nested() || !at::isFloatingType(out.scalar_type()) || out.numel() != 1) {
    return py::none();
  }
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(at::ones_like(out, at::TensorOptions(), at::MemoryFormat::Preserve)));
}

py::object loss_grad(py::handle out) {
  const char* mode = std::getenv("GPUAUTOGRAD_NATIVE");
  if (mode != nullptr && std::strcmp(mode, "auto") != 0 && std::strcmp(mode, "1") != 0) {
    return py::none();  // "0", or a value the flag's Python reader rejects with its own error
  }
  if (global_state() != kClear) {
    return py::none();
  }
  return implicit_grad(out);
}

}  // namespace gpuautograd
