// gpuautograd's native walker: the hit path's walk over an autograd graph, in C++.
//
// One call walks the graph breadth-first over next_edges() in the same discovery order as the
// Python walk (capture/walk.py), writes the cache key as bytes, collects every saved tensor, and
// notes what would make the functional backward wrong (hooks, unpack hooks, layouts). Saved
// values are read with Node::compiled_args, the visitor compiled autograd uses: it reaches every
// generated node's saved fields without Python and without running anything.
//
// Decisions stay in Python; this file reads the graph, and delivers leaf gradients the way
// eager's AccumulateGrad does (LeafDelivery), since only C++ can see whether a gradient is
// referenced elsewhere (torch's use_count rule for stealing it as .grad).

#include <torch/extension.h>

#include "node_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_function.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/utils/grad_layout_contract.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/dynamo/compiled_autograd.h>

#include <ATen/EmptyTensor.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/SavedTensorHooks.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/profiler/orchestration/observer.h>
#include <ATen/ops/_foreach_add.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace py = pybind11;
using torch::autograd::AccumulateGrad;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
namespace ca = torch::dynamo::autograd;
// How the graph holds its nodes: std::shared_ptr in torch 2.11, c10::intrusive_ptr in 2.13.
using NodePtr = decltype(torch::autograd::Edge::function);

namespace {

// Tags keep fields of different kinds from running into each other in the key bytes.
enum Tag : uint8_t {
  kNode = 1, kEdge, kNoEdge, kMeta, kSaved, kSizes, kLifted, kLeaf, kPython, kRoot, kInput,
  kHooked,  // a node whose saved values carry unpack hooks: it runs opaque
  kGrad,    // an incoming gradient of a root
  kRead,    // a node's saved values, read by its generated reader (saved_readers.inc)
  kHookBits,  // a node with Python-visible hooks (node_hooks.h's bits): the program yields there
};

// The bytes of a Python bytes object, without a copy.
std::string_view bytes_view(const py::bytes& b) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &data, &size) != 0) {
    throw py::error_already_set();
  }
  return {data, static_cast<size_t>(size)};
}

// A key's digest for the plan cache's lookup: four multiply-xor lanes over its 8-byte words. Not
// a guard (a digest match is compared in full), so it needs speed and spread, not strength.
uint64_t digest_bytes(const char* data, size_t size) {
  constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;
  uint64_t lanes[4] = {size, size ^ 0xC2B2AE3D27D4EB4Full, size ^ 0x165667B19E3779F9ull, size ^ 0x27D4EB2F165667C5ull};
  size_t i = 0;
  for (; i + 32 <= size; i += 32) {
    for (int l = 0; l < 4; ++l) {
      uint64_t w;
      std::memcpy(&w, data + i + 8 * l, 8);
      lanes[l] = (lanes[l] ^ w) * kMul;
      lanes[l] ^= lanes[l] >> 29;
    }
  }
  uint64_t tail = 0;
  std::memcpy(&tail, data + i, std::min<size_t>(size - i, 8));
  uint64_t h = (lanes[0] ^ tail) * kMul;
  for (size_t j = i + 8; j < size; j += 8) {  // at most three more words
    uint64_t w = 0;
    std::memcpy(&w, data + j, std::min<size_t>(size - j, 8));
    h = ((h ^ w) * kMul) ^ (h >> 31);
  }
  for (int l = 1; l < 4; ++l) {
    h = ((h ^ lanes[l]) * kMul) ^ (h >> 31);
  }
  return h ^ (h >> 33);
}

class KeyWriter {
 public:
  KeyWriter() : bytes_(static_cast<char*>(std::malloc(kInitial))), capacity_(kInitial) {
    TORCH_CHECK(bytes_ != nullptr, "KeyWriter: out of memory");
  }
  ~KeyWriter() { std::free(bytes_); }
  KeyWriter(const KeyWriter&) = delete;
  KeyWriter& operator=(const KeyWriter&) = delete;

  // Inline with a constant size, unlike std::string::append: the walk writes a few hundred small
  // fields per node, so each becomes a store.
  template <typename T>
  C10_ALWAYS_INLINE void put(const T& value) {
    reserve(sizeof(T));
    std::memcpy(bytes_ + size_, &value, sizeof(T));
    size_ += sizeof(T);
  }
  void put_ints(c10::IntArrayRef values) {
    put<uint32_t>(values.size());
    append(values.data(), values.size() * sizeof(int64_t));
  }
  void put_raw(const uint8_t* data, size_t size) {
    put<uint32_t>(size);
    append(data, size);
  }
  py::bytes bytes() const { return py::bytes(bytes_, size_); }
  void clear() { size_ = 0; }
  uint64_t digest() const { return digest_bytes(bytes_, size_); }
  bool equals(const py::bytes& other) const { return bytes_view(other) == std::string_view(bytes_, size_); }

 private:
  static constexpr size_t kInitial = 16384;  // gpt's key is 13 kB

  void reserve(size_t n) {
    if (C10_UNLIKELY(size_ + n > capacity_)) {
      capacity_ = std::max(capacity_ * 2, size_ + n);
      auto* grown = static_cast<char*>(std::realloc(bytes_, capacity_));
      TORCH_CHECK(grown != nullptr, "KeyWriter: out of memory");
      bytes_ = grown;
    }
  }
  void append(const void* data, size_t n) {
    reserve(n);
    std::memcpy(bytes_ + size_, data, n);
    size_ += n;
  }

  char* bytes_;  // not a std::vector: that zero-fills 16 kB per walk
  size_t capacity_;
  size_t size_ = 0;
};

// What the Python walk keys a tensor by: shape, strides, dtype, device.
void put_tensor_meta(KeyWriter& key, const at::Tensor& t) {
  key.put_ints(t.sizes());
  key.put_ints(t.strides());
  key.put(t.scalar_type());
  key.put(t.device().type());
  key.put(t.device().index());
}

// Why a tensor can't be keyed or read by the functional backward (nullopt: it can). `where` is
// called only to word a problem: the check runs for every saved tensor of every walk.
template <typename Where>
std::optional<std::string> layout_problem(const at::Tensor& t, const Where& where) {
  if (C10_LIKELY(t.layout() == at::kStrided && !t.is_nested())) {
    return std::nullopt;
  }
  if (t.is_nested()) {
    return "a nested tensor is " + std::string(where());
  }
  std::ostringstream os;
  os << "a tensor with layout " << t.layout() << " is " << where();
  return os.str();
}

// The private fields of SavedVariable that its unpack() reads. Access checks don't apply to the
// names in an explicit instantiation, which is how Expose hands out pointers to them.
template <typename Tag, typename Tag::type Member>
struct Expose {
  friend typename Tag::type member(Tag) { return Member; }
};
#define GPUAUTOGRAD_SAVED_FIELD(Tag, Type, field)                      \
  struct Tag {                                                        \
    using type = Type SavedVariable::*;                               \
    friend type member(Tag);                                          \
  };                                                                  \
  template struct Expose<Tag, &SavedVariable::field>
GPUAUTOGRAD_SAVED_FIELD(SavedData, at::Tensor, data_);
GPUAUTOGRAD_SAVED_FIELD(SavedVersion, uint32_t, saved_version_);
GPUAUTOGRAD_SAVED_FIELD(SavedDefault, bool, was_default_constructed_);
GPUAUTOGRAD_SAVED_FIELD(SavedInplaceOnView, bool, is_inplace_on_view_);
GPUAUTOGRAD_SAVED_FIELD(SavedOriginal, bool, saved_original_);
GPUAUTOGRAD_SAVED_FIELD(SavedLeaf, bool, is_leaf_);
GPUAUTOGRAD_SAVED_FIELD(SavedOutput, bool, is_output_);
#undef GPUAUTOGRAD_SAVED_FIELD

template <typename Tag>
const auto& field(const SavedVariable& sv) {
  return sv.*member(Tag{});
}

// Reads one generated node's saved fields (the readers in saved_readers.inc call it once per field,
// in declaration order): values go into the key, tensors into the walk's saved list. A tensor is
// what SavedVariable::unpack would give, checked as unpack checks it (released, modified in place,
// detached in place), without the fresh tensor unpack makes of a saved output: the data itself.
class SavedReader {
 public:
  SavedReader(KeyWriter& key, std::vector<at::Tensor>& tensors, std::vector<const SavedVariable*>& sources, const NodePtr& node)
      : key_(key), tensors_(tensors), sources_(sources), node_(node) {}

  void operator()(const SavedVariable& sv) {
    if (sv.has_hooks()) {
      hooked = true;  // never unpacked here: the node runs opaque, and its hooks run then
      return;
    }
    if (field<SavedDefault>(sv)) {
      key_.put<uint8_t>(0);  // saved None
      return;
    }
    const at::Tensor& data = field<SavedData>(sv);
    if (C10_UNLIKELY(!data.defined() || field<SavedInplaceOnView>(sv) || !unpacks_as_is(sv, data))) {
      // Released, a view written in place, or a check that fails: unpack as compiled_args does,
      // which raises torch's own error (or, for the view, makes the tensor).
      push(sv, sv.unpack(field<SavedOutput>(sv) ? node_ : NodePtr()));
      return;
    }
    push(sv, data);
  }
  void operator()(const std::vector<SavedVariable>& list) {
    key_.put<uint32_t>(list.size());
    for (const auto& sv : list) {
      (*this)(sv);
    }
  }
  void operator()(bool v) { key_.put(v); }
  void operator()(int64_t v) { key_.put(v); }
  void operator()(uint64_t v) { key_.put(v); }
  void operator()(double v) { key_.put(v); }
  void operator()(at::ScalarType v) { key_.put(v); }
  void operator()(at::Layout v) { key_.put(v); }
  void operator()(const c10::SymInt& v) {
    if (auto i = v.maybe_as_int()) {
      key_.put(*i);
    } else {
      symbolic = true;
    }
  }
  void operator()(c10::SymIntArrayRef values) {
    key_.put<uint32_t>(values.size());
    for (const auto& v : values) {
      (*this)(v);
    }
  }
  void operator()(const at::Scalar& v) {
    if (v.isSymbolic()) {
      symbolic = true;
      return;
    }
    key_.put(v.type());
    if (v.isComplex()) {
      auto c = v.toComplexDouble();
      key_.put(c.real());
      key_.put(c.imag());
    } else if (v.isFloatingPoint()) {
      key_.put(v.toDouble());
    } else if (v.isBoolean()) {
      key_.put(v.toBool());
    } else if (v.type() == at::kUInt64) {
      key_.put(v.to<uint64_t>());
    } else {
      key_.put(v.toLong());
    }
  }
  void operator()(const std::string& v) { key_.put_raw(reinterpret_cast<const uint8_t*>(v.data()), v.size()); }
  void operator()(const at::TensorOptions& v) {
    key_.put<uint8_t>(v.has_dtype());
    if (v.has_dtype()) {
      key_.put(v.dtype().toScalarType());
    }
    key_.put<uint8_t>(v.has_device());
    if (v.has_device()) {
      key_.put(v.device().type());
      key_.put(v.device().index());
    }
    key_.put<uint8_t>(v.has_layout());
    if (v.has_layout()) {
      key_.put(v.layout());
    }
    key_.put(v.requires_grad());
    key_.put(v.pinned_memory());
    key_.put<uint8_t>(v.has_memory_format());
    if (v.has_memory_format()) {
      key_.put(*v.memory_format_opt());
    }
  }
  void operator()(const at::TensorGeometry& v) {
    (*this)(v.sym_sizes());
    (*this)(v.sym_strides());
    (*this)(v.sym_storage_offset());
  }
  void operator()(const torch::autograd::TypeAndSize& v) {
    (*this)(v.sym_sizes);
    (*this)(v.options);
  }
  template <typename T>
  void operator()(const std::vector<T>& values) {
    key_.put<uint32_t>(values.size());
    for (const auto& v : values) {
      (*this)(v);
    }
  }
  template <typename T>
  void operator()(const std::optional<T>& v) {
    key_.put<uint8_t>(v.has_value());
    if (v) {
      (*this)(*v);
    }
  }
  template <typename T>
  void operator()(const c10::OptionalArray<T>& v) {
    (*this)(v.list);
  }

  // A list's released flag: its getter raises then, and so does unpacking its elements.
  void released(bool flag) const { TORCH_CHECK(!flag, torch::autograd::ERR_BACKWARD_TWICE); }

  bool hooked = false;  // a saved value carries unpack hooks
  bool symbolic = false;  // a value is symbolic (not a plain number)
  std::optional<std::string> problem;  // a saved tensor's layout the functional backward can't read

 private:
  // unpack()'s checks, where they pass, without its work: the version matches, and a saved
  // input that is not a leaf still has its grad_fn (else unpack names the in-place detach).
  static bool unpacks_as_is(const SavedVariable& sv, const at::Tensor& data) {
    if (torch::autograd::impl::version_counter(data).current_version() != field<SavedVersion>(sv)) {
      return false;
    }
    if (!field<SavedOriginal>(sv) || field<SavedLeaf>(sv)) {
      return true;
    }
    // grad_fn() without its call and reference count: a saved non-leaf that lost its grad_fn_
    // was detached in place (views, whose grad_fn() may regenerate, can't be detached in place).
    const auto* meta = static_cast<const torch::autograd::AutogradMeta*>(data.unsafeGetTensorImpl()->autograd_meta());
    return meta != nullptr && meta->grad_fn_ != nullptr;
  }

  void push(const SavedVariable& sv, at::Tensor tensor) {
    if (!tensor.defined()) {
      key_.put<uint8_t>(0);
      return;
    }
    key_.put<uint8_t>(1);
    if (!problem) {
      problem = layout_problem(tensor, [&] { return "saved by " + node_->name(); });
    }
    if (!problem) {
      put_tensor_meta(key_, tensor);
    }
    tensors_.push_back(std::move(tensor));
    sources_.push_back(&sv);
  }

  KeyWriter& key_;
  std::vector<at::Tensor>& tensors_;
  std::vector<const SavedVariable*>& sources_;
  const NodePtr& node_;
};

using ReadSaved = void (*)(const Node&, SavedReader&);
struct ReaderEntry {
  const std::type_info* type;
  ReadSaved read;
};

#include "saved_readers.inc"

// The generated readers by node class: an open-addressing table of (type_info address, reader),
// 16 bytes a slot, so a lookup with the caches cold after a forward costs one line. (A
// std::unordered_map's bucket, node and chain cost two or three, and hashing the type's name
// reads the name.) A type_info's address names one class: a generated node class has its key
// function in libtorch, which holds its one type_info, and the readers' typeid() refers to it.
class ReaderTable {
 public:
  ReaderTable() {
    size_t n = 0;
    while (saved_readers::kReaders[n].type != nullptr) {
      ++n;
    }
    size_t capacity = 64;  // a power of two, at most half full: short probes
    while (capacity < 2 * n + 2) {
      capacity *= 2;
    }
    slots_.resize(capacity);
    mask_ = capacity - 1;
    for (const ReaderEntry* e = saved_readers::kReaders; e->type != nullptr; ++e) {
      size_t k = slot_of(e->type);
      while (slots_[k].type != nullptr && slots_[k].type != e->type) {
        k = (k + 1) & mask_;
      }
      slots_[k] = *e;
    }
  }

  ReadSaved find(const std::type_info* type) const {
    for (size_t k = slot_of(type);; k = (k + 1) & mask_) {
      const ReaderEntry& e = slots_[k];
      if (e.type == type) {
        return e.read;
      }
      if (e.type == nullptr) {
        return nullptr;
      }
    }
  }

 private:
  size_t slot_of(const std::type_info* type) const {
    // Fibonacci hashing of the address: type_info objects sit 16 or more bytes apart
    return static_cast<size_t>((reinterpret_cast<uintptr_t>(type) * 0x9E3779B97F4A7C15ull) >> 32) & mask_;
  }

  std::vector<ReaderEntry> slots_;
  size_t mask_ = 0;
};

// The generated reader of a node class, or nullptr: the class goes through compiled_args.
ReadSaved reader_of(const std::type_info& type) {
  static const ReaderTable table;
  return table.find(&type);
}

// The words of some pointer-table slots (runtime/replay.py): slot lo + k holds the address of
// the k-th tensor plus the view's byte offset `deltas[k]`, or, for a value slot, the bits of a 0-dim
// host tensor. The addresses must keep the promises the captured kernels were built on: 16-byte
// alignment where a kernel vectorizes, and the same address where a library call reads a
// parameter in place.
class SlotFill {
 public:
  SlotFill(std::vector<int64_t> deltas, std::vector<bool> values, std::vector<int64_t> aligned, std::vector<int64_t> pinned_slots,
           std::vector<int64_t> pinned_addresses, int64_t alignment)
      : deltas_(std::move(deltas)), values_(std::move(values)), aligned_(std::move(aligned)), pinned_slots_(std::move(pinned_slots)),
        pinned_addresses_(std::move(pinned_addresses)), alignment_(alignment) {
    TORCH_CHECK(deltas_.size() == values_.size() && pinned_slots_.size() == pinned_addresses_.size(), "SlotFill: lengths differ");
  }

  size_t size() const { return deltas_.size(); }

  // Writes the slots into `table` (a host int64 tensor), slot k from `tensor_at(k)`; false, with
  // nothing written, when a promise is broken: the caller then finds and names what moved.
  template <typename TensorAt>
  bool fill(at::Tensor& table, int64_t lo, const TensorAt& tensor_at) const {
    TORCH_CHECK(table.scalar_type() == at::kLong && table.is_cpu() && lo + static_cast<int64_t>(size()) <= table.numel(),
                "the pointer table is not a host int64 tensor with room for the slots");
    scratch_.resize(size());
    for (size_t k = 0; k < size(); ++k) {
      const at::Tensor& tensor = tensor_at(k);
      if (!values_[k]) {
        scratch_[k] = reinterpret_cast<int64_t>(tensor.data_ptr()) + deltas_[k];
      } else if (!value_bits(tensor, scratch_[k])) {
        return false;
      }
    }
    for (auto k : aligned_) {
      if (scratch_[k] % alignment_ != 0) {
        return false;
      }
    }
    for (size_t j = 0; j < pinned_slots_.size(); ++j) {
      if (scratch_[pinned_slots_[j]] != pinned_addresses_[j]) {
        return false;
      }
    }
    std::memcpy(table.data_ptr<int64_t>() + lo, scratch_.data(), scratch_.size() * sizeof(int64_t));
    return true;
  }

 private:
  // A slot that holds a 0-dim host tensor's value: its bytes as the integer of its width (signed,
  // except one byte), as replay.value_bits writes them. False for a tensor not on the host.
  static bool value_bits(const at::Tensor& t, int64_t& out) {
    if (!t.is_cpu() || t.dim() != 0) {
      return false;
    }
    const void* p = t.const_data_ptr();
    switch (t.element_size()) {
      case 8: out = *static_cast<const int64_t*>(p); return true;
      case 4: out = *static_cast<const int32_t*>(p); return true;
      case 2: out = *static_cast<const int16_t*>(p); return true;
      case 1: out = *static_cast<const uint8_t*>(p); return true;
      default: return false;
    }
  }

  std::vector<int64_t> deltas_;
  std::vector<bool> values_;
  std::vector<int64_t> aligned_, pinned_slots_, pinned_addresses_;
  int64_t alignment_;
  mutable std::vector<int64_t> scratch_;  // calls of one plan take turns (its lock)
};

// One upload group of a bound plan's pointer table: slot k from the call's tensor `names[k]`.
class TableGroup {
 public:
  TableGroup(std::vector<py::object> names, std::vector<int64_t> deltas, std::vector<bool> values, std::vector<int64_t> aligned,
             std::vector<int64_t> pinned_slots, std::vector<int64_t> pinned_addresses, int64_t alignment)
      : names_(std::move(names)),
        slots_(std::move(deltas), std::move(values), std::move(aligned), std::move(pinned_slots), std::move(pinned_addresses), alignment) {
    TORCH_CHECK(names_.size() == slots_.size(), "TableGroup: lengths differ");
  }

  // False, with nothing written, when a promise is broken.
  bool fill(at::Tensor& table, int64_t lo, py::dict call) const {
    return slots_.fill(table, lo, [&](size_t k) -> const at::Tensor& {
      PyObject* t = PyDict_GetItemWithError(call.ptr(), names_[k].ptr());
      if (t == nullptr) {
        if (PyErr_Occurred()) {
          throw py::error_already_set();
        }
        throw py::key_error(py::str(names_[k]));
      }
      return THPVariable_Unpack(t);
    });
  }

 private:
  std::vector<py::object> names_;
  SlotFill slots_;
};

// An uninitialized buffer for a program's result (its kernels write every element). On the host
// without the dispatcher, which costs as much again as the allocation.
at::Tensor fresh_tensor(c10::IntArrayRef shape, at::ScalarType dtype, at::Device device) {
  if (device.is_cpu()) {
    return at::detail::empty_cpu(shape, dtype);
  }
  return at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
}

// The fresh output buffers of one bound-plan call (runtime/replay.py): allocated and put into the
// call's dict by name, without a Python call of torch.empty per buffer.
class FreshBuffers {
 public:
  FreshBuffers(std::vector<py::object> names, std::vector<std::vector<int64_t>> shapes, std::vector<at::ScalarType> dtypes, at::Device device)
      : names_(std::move(names)), shapes_(std::move(shapes)), dtypes_(std::move(dtypes)), device_(device) {
    TORCH_CHECK(names_.size() == shapes_.size() && shapes_.size() == dtypes_.size(), "FreshBuffers: lengths differ");
  }

  void allocate(py::dict call) const {
    for (size_t k = 0; k < names_.size(); ++k) {
      at::Tensor t = fresh_tensor(shapes_[k], dtypes_[k], device_);
      PyObject* obj = THPVariable_Wrap(std::move(t));
      if (obj == nullptr || PyDict_SetItem(call.ptr(), names_[k].ptr(), obj) != 0) {
        Py_XDECREF(obj);
        throw py::error_already_set();
      }
      Py_DECREF(obj);
    }
  }

 private:
  std::vector<py::object> names_;
  std::vector<std::vector<int64_t>> shapes_;
  std::vector<at::ScalarType> dtypes_;
  at::Device device_;
};

// A bound plan's replay on the native short path, planned at the plan's first replay
// (runtime/replay.py): the call's tensors are the program's arguments, then its fresh result
// buffers; table slot k holds an address in tensor `slot_sources[k]`; result j is tensor
// `out_sources[j]` itself (-1: None) or, where `out_views[j]`, the view of it with the given sizes,
// strides and storage offset past its own. No tensor of the call becomes a Python object.
class ReplayPlan {
 public:
  ReplayPlan(int64_t num_args, std::vector<std::vector<int64_t>> fresh_shapes, std::vector<at::ScalarType> fresh_dtypes, at::Device device,
             std::vector<int64_t> slot_sources, std::vector<int64_t> deltas, std::vector<bool> values, std::vector<int64_t> aligned,
             std::vector<int64_t> pinned_slots, std::vector<int64_t> pinned_addresses, int64_t alignment, std::vector<int64_t> out_sources,
             std::vector<bool> out_views, std::vector<std::vector<int64_t>> out_sizes, std::vector<std::vector<int64_t>> out_strides,
             std::vector<int64_t> out_offsets)
      : num_args_(num_args), fresh_shapes_(std::move(fresh_shapes)), fresh_dtypes_(std::move(fresh_dtypes)), device_(device),
        slot_sources_(std::move(slot_sources)),
        slots_(std::move(deltas), std::move(values), std::move(aligned), std::move(pinned_slots), std::move(pinned_addresses), alignment),
        out_sources_(std::move(out_sources)), out_views_(std::move(out_views)), out_sizes_(std::move(out_sizes)),
        out_strides_(std::move(out_strides)), out_offsets_(std::move(out_offsets)) {
    auto tensors = num_args_ + static_cast<int64_t>(fresh_shapes_.size());
    TORCH_CHECK(fresh_shapes_.size() == fresh_dtypes_.size() && slot_sources_.size() == slots_.size(), "ReplayPlan: lengths differ");
    TORCH_CHECK(out_views_.size() == out_sources_.size() && out_sizes_.size() == out_sources_.size() &&
                    out_strides_.size() == out_sources_.size() && out_offsets_.size() == out_sources_.size(),
                "ReplayPlan: result lengths differ");
    for (auto k : slot_sources_) {
      TORCH_CHECK(k >= 0 && k < tensors, "ReplayPlan: slot source ", k, " is not one of the call's ", tensors, " tensors");
    }
    for (auto k : out_sources_) {
      TORCH_CHECK(k >= -1 && k < tensors, "ReplayPlan: result source ", k, " is not one of the call's ", tensors, " tensors");
    }
  }

  int64_t num_args() const { return num_args_; }

  // Appends the fresh buffers to `tensors` (the arguments) and fills the table from them; false,
  // with `tensors` as it came, when an address broke a promise.
  bool bind(std::vector<at::Tensor>& tensors, at::Tensor& table, int64_t lo) const {
    TORCH_CHECK(static_cast<int64_t>(tensors.size()) == num_args_, "ReplayPlan.bind: ", tensors.size(), " arguments for ", num_args_);
    for (size_t k = 0; k < fresh_shapes_.size(); ++k) {
      tensors.push_back(fresh_tensor(fresh_shapes_[k], fresh_dtypes_[k], device_));
    }
    if (!slots_.fill(table, lo, [&](size_t k) -> const at::Tensor& { return tensors[slot_sources_[k]]; })) {
      tensors.resize(num_args_);
      return false;
    }
    return true;
  }

  // The program's results from the call's tensors, which it then lets go of.
  std::vector<at::Tensor> results(std::vector<at::Tensor>& tensors) const {
    std::vector<at::Tensor> out(out_sources_.size());
    for (size_t j = 0; j < out.size(); ++j) {
      auto k = out_sources_[j];
      if (k < 0) {
        continue;
      }
      const at::Tensor& t = tensors.at(k);
      out[j] = out_views_[j] ? at::as_strided(t, out_sizes_[j], out_strides_[j], t.storage_offset() + out_offsets_[j]) : t;
    }
    tensors.clear();
    return out;
  }

 private:
  int64_t num_args_;
  std::vector<std::vector<int64_t>> fresh_shapes_;
  std::vector<at::ScalarType> fresh_dtypes_;
  at::Device device_;
  std::vector<int64_t> slot_sources_;
  SlotFill slots_;
  std::vector<int64_t> out_sources_;
  std::vector<bool> out_views_;
  std::vector<std::vector<int64_t>> out_sizes_, out_strides_;
  std::vector<int64_t> out_offsets_;
};

// The argument list a captured program expects, in its order: each entry names a saved tensor of
// the native walk (its compiled_args index), an incoming gradient, or a node (an opaque one).
// `release` lists the nodes the program runs functionally: what eager frees after running them.
class ArgumentPlan {
 public:
  enum Kind : uint8_t { kSavedArg = 0, kGradArg = 1, kNodeArg = 2 };
  ArgumentPlan(std::vector<uint8_t> kinds, std::vector<int64_t> indices, std::vector<int64_t> release)
      : kinds_(std::move(kinds)), indices_(std::move(indices)), release_(std::move(release)) {
    TORCH_CHECK(kinds_.size() == indices_.size(), "ArgumentPlan: lengths differ");
    for (auto k : kinds_) {
      TORCH_CHECK(k <= kNodeArg, "ArgumentPlan: unknown argument kind ", int(k));
    }
  }
  const std::vector<uint8_t>& kinds() const { return kinds_; }
  const std::vector<int64_t>& indices() const { return indices_; }
  const std::vector<int64_t>& release() const { return release_; }

 private:
  std::vector<uint8_t> kinds_;
  std::vector<int64_t> indices_;
  std::vector<int64_t> release_;
};

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

  // The conditions under which eager's AccumulateGrad makes a fresh dense gradient the .grad as is.
  static bool stealable(const at::Tensor& grad, const at::Tensor& variable) {
    return !variable.grad_fn() && grad.layout() == at::kStrided && !grad.is_nested() && !grad.is_mkldnn() && !grad.requires_grad() &&
        !variable.is_sparse_csr() && grad.use_count() == 1 && !at::caching::is_cached_tensor(grad) &&
        (!layout_enforced(c10::AutogradState::get_tls_state(), 0) || torch::autograd::utils::obeys_layout_contract(grad, variable));
  }

  // Whether the gradient layout contract is on (a switch newer torches have; before it, always).
  template <typename State>
  static auto layout_enforced(const State& state, int) -> decltype(state.get_grad_layout_enforcement_enabled()) {
    return state.get_grad_layout_enforcement_enabled();
  }
  template <typename State>
  static bool layout_enforced(const State&, long) {
    return true;
  }

  std::vector<int64_t> output_, node_;
  std::vector<bool> copy_;
};

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

AccumulateGrad* as_accumulate_grad(Node* node, int64_t i) {
  auto* acc = node != nullptr && &typeid(*node) == &typeid(AccumulateGrad) ? static_cast<AccumulateGrad*>(node) : nullptr;
  TORCH_CHECK(acc, "node ", i, " (", node ? node->name() : std::string("null"), ") is not an AccumulateGrad node");
  return acc;
}


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

  static std::unique_ptr<WalkBuffers> take() {
    auto& kept = spare();
    return kept ? std::move(kept) : std::make_unique<WalkBuffers>();
  }
  // Keeps `used` for this thread's next walk, emptied (its nodes let go of).
  static void give_back(std::unique_ptr<WalkBuffers> used) {
    used->nodes.clear();
    used->index.clear();
    used->key.clear();
    used->saved_sources.clear();
    used->saved.clear();
    used->root_edges.clear();
    used->input_edges.clear();
    spare() = std::move(used);
  }

 private:
  static std::unique_ptr<WalkBuffers>& spare() {
    thread_local std::unique_ptr<WalkBuffers> kept;
    return kept;
  }
};

class NativeWalk {
 public:
  NativeWalk() { saved_.reserve(256); }  // no allocation unless take_saved() took the last walk's
  ~NativeWalk() {
    saved_.clear();  // its tensors let go of here, as before; its capacity serves the next walk
    buffers_->saved = std::move(saved_);
    WalkBuffers::give_back(std::move(buffers_));
  }
  NativeWalk(const NativeWalk&) = delete;
  NativeWalk& operator=(const NativeWalk&) = delete;

  void run(const std::vector<at::Tensor>& roots, const std::vector<at::Tensor>& inputs, const std::vector<std::optional<at::Tensor>>& grads) {
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
  }

  // (node index, output_nr) of a tensor's gradient edge in this walk, or None.
  py::object find(const at::Tensor& t) const { return edge_object(find_edge(t)); }

  // For each SavedTensor of the Python walk's slots, the index of its tensor in the saved list.
  // At capture only.
  std::vector<int64_t> saved_index(const std::vector<py::object>& raw) {
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

  py::object node(int64_t i) const {
    return py::reinterpret_steal<py::object>(torch::autograd::functionToPyObject(nodes_.at(i)));
  }

  // The program's arguments, built straight from the collected tensors; the walk then lets go of
  // them, so the list holds the only references this walk had. With `release` (a backward without
  // retain_graph), the plan's functional nodes then free their saved values, as eager's do.
  py::list arguments(const ArgumentPlan& plan, py::list grads, bool release) {
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

  void deliver(const LeafDelivery& plan, py::list outs) const {
    plan.run(outs, [&](int64_t i) { return as_accumulate_grad(nodes_.at(i).get(), i); });
  }

  // The short path's replay, before its segments run: the program's arguments (the walk's saved
  // tensors and the incoming gradients, as `arguments` makes them) and fresh buffers bound into
  // the pointer table, held here until deliver_replay. False, with the walk as it was and nothing
  // released, when an address broke a promise: the caller then binds the Python way, which names it.
  bool bind_replay(const ArgumentPlan& plan, py::list grads, const ReplayPlan& replay, at::Tensor table, int64_t lo, bool release) {
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

  // After the segments ran: the results to their leaves, the call's tensors let go of first (so a
  // result nothing else holds is stolen as .grad, as eager's AccumulateGrad steals it).
  void deliver_replay(const ReplayPlan& replay, const LeafDelivery& plan) {
    auto outs = replay.results(call_tensors_);
    plan.run(outs, [&](int64_t i) { return as_accumulate_grad(nodes_.at(i).get(), i); });
  }

  // The cache key of this walk among `table`'s (runtime/cache.py: digest -> the keys
  // (backend, accumulate, "native", key bytes, retained, grad dtypes) with that digest): the one
  // with these head fields, no retained grads and this walk's bytes, compared in full; else None,
  // and None for a walk the short path can't use (unsupported or falling back: the general path
  // reads why). One call for what the digest, a Python tuple and a comparison per candidate cost.
  py::object match(const py::dict& table, const py::object& backend, bool accumulate, const py::object& grad_dtypes) const {
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

  // Saved tensor `i` of this walk, for an argument.
  const at::Tensor& saved_argument(int64_t i) const {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(saved_.size()), "saved argument ", i, " is not in this walk");
    return saved_[i];
  }

  // After binding: the walk lets go of its saved tensors and, with `release`, the plan's
  // functional nodes free theirs.
  void let_go(const ArgumentPlan& plan, bool release) {
    saved_.clear();
    if (release) {
      this->release(plan.release());
    }
  }

  // What eager's backward does after running a node without retain_graph.
  void release(const std::vector<int64_t>& indices) {
    for (auto i : indices) {
      nodes_.at(i)->release_variables();
    }
  }

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
  py::tuple root_edges() const { return edge_objects(root_edges_); }
  py::tuple input_edges() const { return edge_objects(input_edges_); }

 private:
  int64_t discover(const NodePtr& fn) {
    auto [i, fresh] = index_.try_emplace(fn.get(), static_cast<int64_t>(nodes_.size()));
    if (fresh) {
      nodes_.push_back(fn);
    }
    return i;
  }

  using Edge = WalkBuffers::Edge;

  std::optional<Edge> find_edge(const at::Tensor& t) const {
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

  static py::object edge_object(const std::optional<Edge>& edge) {
    return edge ? py::object(py::make_tuple(edge->first, edge->second)) : py::object(py::none());
  }

  // The edges as Python tuples, made when asked (the general path asks; a hit does not).
  template <typename Edges>
  static py::tuple edge_objects(const Edges& edges) {
    py::tuple out(edges.size());
    for (size_t k = 0; k < edges.size(); ++k) {
      out[k] = edge_object(edges[k]);
    }
    return out;
  }

  void set_fallback(std::string reason) {
    if (!fallback_) {
      fallback_ = std::move(reason);
    }
  }

  void visit(size_t i) {
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

  static bool equal(PyObject* a, PyObject* b) {
    if (a == b) {
      return true;
    }
    int same = PyObject_RichCompareBool(a, b, Py_EQ);
    if (same < 0) {
      throw py::error_already_set();
    }
    return same == 1;
  }

  void put_edges(const Node& node) {
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

  void put_input_metadata(const Node& node) {
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

  void put_leaf(AccumulateGrad& acc) {
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

  // The THPFunction of a node defined in Python (a PyNode), else nullptr. PyNode's type info is
  // not exported from libtorch_python, so the node's Python object tells.
  static PyObject* python_function(const Node& node) {
    PyObject* obj = load_pyobj(node, 0);
    return obj != nullptr && PyObject_TypeCheck(obj, &THPFunctionType) ? obj : nullptr;
  }

  // The node's Python object: a plain pointer in torch 2.11, behind a PyObjectSlot in 2.13 (the
  // first overload exists only where pyobj_slot() does).
  template <typename N>
  static auto load_pyobj(const N& node, int) -> decltype(node.pyobj_slot()->load_pyobj()) {
    return node.pyobj_slot()->load_pyobj();
  }
  template <typename N>
  static PyObject* load_pyobj(const N& node, long) {
    return node.pyobj();
  }

  void put_python(PyObject* obj) {
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

  void put_cpp(size_t i, const std::type_info& type) {
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
  void read_saved(const NodePtr& node, ReadSaved read) {
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
  void collect_saved(const NodePtr& node) {
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
  void check_node_hooks(size_t i, Node& node, AccumulateGrad* acc) {
    using namespace gpuautograd;
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

  static std::string first_line(const char* what) {
    std::string s(what);
    auto nl = s.find('\n');
    return nl == std::string::npos ? s : s.substr(0, nl);
  }

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
};

// The Python walk's nodes are Python objects: a C++ node's object holds the node.
void deliver_to_python_nodes(const LeafDelivery& plan, py::list outs, py::list nodes) {
  plan.run(outs, [&](int64_t i) {
    PyObject* obj = PyList_GET_ITEM(nodes.ptr(), i);
    TORCH_CHECK(torch::autograd::THPCppFunction_Check(obj), "node ", i, " of the walk is not a C++ autograd node");
    return as_accumulate_grad(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata.get(), i);
  });
}

// How many C++ post hooks an AccumulateGrad node carries (DDP's reducer registers one per
// parameter; Python can't see them). `node` is the Python object of a C++ node.
int64_t post_hook_count(py::object node) {
  PyObject* obj = node.ptr();
  TORCH_CHECK(torch::autograd::THPCppFunction_Check(obj), "post_hook_count: not a C++ autograd node");
  return static_cast<int64_t>(reinterpret_cast<torch::autograd::THPCppFunction*>(obj)->cdata->post_hooks().size());
}

// The geometry (sizes, strides, storage offset) of as_strided's input, which autograd keeps in C++
// only: as_strided's backward depends on it. The native key holds it (the node's generated reader
// reads every field), so a plan captured under this walker may depend on it. None for other nodes.
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

// The short path's walk and lookup in one call: (the walk, the plan cache's entry for its key or
// None), for a call with no grad dtypes to key. `table` is PlanCache.by_digest, where match finds
// the key; `entries` is PlanCache.entries, an OrderedDict that PlanCache.get reads and moves to its
// most recent end, as this does; `backends` as short_path_backend reads it. (None, None), with
// nothing walked, where that finds no backend. One call where a Python frame per step costs a
// microsecond or more with the caches cold after a forward.
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

// What rules out every functional backward right now, as api._global_fallback_reason checks it
// through torch's Python bindings (each binding those checks call reads what this reads), in its
// order: one call where six cost a microsecond or more each with the caches cold after a forward.
enum GlobalState : int { kClear = 0, kAnomaly, kSavedTensorHooks, kTransform, kObserved };
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

// torch's implicit gradient of loss.backward() (torch.ones_like(out, memory_format=
// torch.preserve_format)) for a plain tensor (type torch.Tensor) that requires grad and is one
// floating-point element, not nested; None for anything else, and while a torch function mode is
// active (it would see the ones_like call eager makes in Python).
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

// loss.backward()'s short entry, in one call where the checks cost a microsecond or more each with
// the caches cold after a forward: the implicit gradient (implicit_grad) where the native walker is
// not turned off (GPUAUTOGRAD_NATIVE "auto" or "1", read as os.environ writes it) and no global
// state rules out a functional backward; else None, and api.backward's general path decides.
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<NativeWalk>(m, "NativeWalk")
      .def_property_readonly("key", &NativeWalk::key)
      .def("take_saved", &NativeWalk::take_saved)
      .def_property_readonly("read_by_readers", &NativeWalk::read_by_readers)
      .def_property_readonly("unsupported", &NativeWalk::unsupported)
      .def_property_readonly("fallback", &NativeWalk::fallback)
      .def_property_readonly("hooked_nodes", &NativeWalk::hooked_nodes)
      .def_property_readonly("root_edges", &NativeWalk::root_edges)
      .def_property_readonly("input_edges", &NativeWalk::input_edges)
      .def("__len__", &NativeWalk::size)
      .def("find", &NativeWalk::find)
      .def("node", &NativeWalk::node)
      .def("saved_index", &NativeWalk::saved_index)
      .def("release", &NativeWalk::release)
      .def("arguments", &NativeWalk::arguments,
           "The captured program's argument list (the walk lets go of its tensors); with `release`, free the plan's functional nodes.")
      .def("deliver", &NativeWalk::deliver, "Hand the program's leaf gradients in `outs` to their AccumulateGrad nodes.")
      .def("bind_replay", &NativeWalk::bind_replay,
           "Bind the program's arguments and fresh buffers into the pointer table for a replay; False when an address broke a promise.")
      .def("deliver_replay", &NativeWalk::deliver_replay, "After the replay, hand its results to their AccumulateGrad nodes.")
      .def("match", &NativeWalk::match, "This walk's cache key among a digest table's (compared in full), or None.");
  py::class_<LeafDelivery>(m, "LeafDelivery")
      .def(py::init<std::vector<int64_t>, std::vector<int64_t>, std::vector<bool>>())
      .def("__len__", &LeafDelivery::size);
  py::class_<ArgumentPlan>(m, "ArgumentPlan").def(py::init<std::vector<uint8_t>, std::vector<int64_t>, std::vector<int64_t>>());
  py::class_<TableGroup>(m, "TableGroup")
      .def(py::init<std::vector<py::object>, std::vector<int64_t>, std::vector<bool>, std::vector<int64_t>, std::vector<int64_t>,
                    std::vector<int64_t>, int64_t>())
      .def("fill", &TableGroup::fill, "Write this call's addresses into the table; False when one broke a promise.");
  py::class_<ReplayPlan>(m, "ReplayPlan")
      .def(py::init<int64_t, std::vector<std::vector<int64_t>>, std::vector<at::ScalarType>, at::Device, std::vector<int64_t>,
                    std::vector<int64_t>, std::vector<bool>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, int64_t,
                    std::vector<int64_t>, std::vector<bool>, std::vector<std::vector<int64_t>>, std::vector<std::vector<int64_t>>,
                    std::vector<int64_t>>());
  m.def(
      "digest",
      [](const py::bytes& key) {
        auto bytes = bytes_view(key);
        return digest_bytes(bytes.data(), bytes.size());
      },
      "The digest of key bytes, as NativeWalk.match computes its own.");
  py::class_<FreshBuffers>(m, "FreshBuffers")
      .def(py::init<std::vector<py::object>, std::vector<std::vector<int64_t>>, std::vector<at::ScalarType>, at::Device>())
      .def("allocate", &FreshBuffers::allocate, "Put a new empty tensor into the call's dict for every fresh output.");
  m.def("global_state", &global_state, "What rules out every functional backward now: 0 nothing, 1 anomaly mode, 2 saved-tensor hooks, 3 a torch.func transform, 4 a dispatch mode or the profiler.");
  m.def("implicit_grad", &implicit_grad, "loss.backward()'s implicit gradient of `out`, or None where torch's general path decides.");
  m.def("loss_grad", &loss_grad, "loss.backward()'s implicit gradient where the short entry may take it (native walker on, no global state), else None.");
  m.def("walk_lookup", &walk_lookup, "walk(), NativeWalk.match() and PlanCache.get() in one call: (the walk, the cached entry for its key or None).");
  m.def("as_strided_geometry", &as_strided_geometry, "(sizes, strides, storage offset) of an AsStridedBackward0 node's input, else None.");
  gpuautograd::register_node_hooks(m);
  m.def("post_hook_count", &post_hook_count, "The number of C++ post hooks of a C++ autograd node.");
  m.def("deliver", &deliver_to_python_nodes, "LeafDelivery for the Python walk's node list.");
  m.def("walk", &walk,
        "Walk the graph behind `roots`; `inputs` are autograd.grad's inputs (may be empty), `grads` the roots' incoming gradients (keyed).");
}
