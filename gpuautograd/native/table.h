// A bound plan's replay from C++ (runtime/replay.py plans it): the pointer table's slots
// (SlotFill, TableGroup), the fresh result buffers (FreshBuffers), the replay of a plan's call
// (ReplayPlan), and the order of a captured program's arguments (ArgumentPlan).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace py = pybind11;

namespace gpuautograd C10_HIDDEN {  // hidden: key.h says why

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
  bool fill(at::Tensor& table, int64_t lo, py::dict call) const;

 private:
  std::vector<py::object> names_;
  SlotFill slots_;
};

// The fresh output buffers of one bound-plan call (runtime/replay.py): allocated and put into the
// call's dict by name, without a Python call of torch.empty per buffer.
class FreshBuffers {
 public:
  FreshBuffers(std::vector<py::object> names, std::vector<std::vector<int64_t>> shapes, std::vector<at::ScalarType> dtypes, at::Device device)
      : names_(std::move(names)), shapes_(std::move(shapes)), dtypes_(std::move(dtypes)), device_(device) {
    TORCH_CHECK(names_.size() == shapes_.size() && shapes_.size() == dtypes_.size(), "FreshBuffers: lengths differ");
  }

  void allocate(py::dict call) const;

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
             std::vector<int64_t> out_offsets);

  int64_t num_args() const { return num_args_; }

  // Appends the fresh buffers to `tensors` (the arguments) and fills the table from them; false,
  // with `tensors` as it came, when an address broke a promise.
  bool bind(std::vector<at::Tensor>& tensors, at::Tensor& table, int64_t lo) const;

  // The program's results from the call's tensors, which it then lets go of.
  std::vector<at::Tensor> results(std::vector<at::Tensor>& tensors) const;

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

}  // namespace gpuautograd
