// A bound plan's replay from C++: filling a pointer-table group from a call's tensors, the fresh
// result buffers, and ReplayPlan's binding and results (table.h declares them).

#include "table.h"

#include <torch/csrc/autograd/python_variable.h>

#include <ATen/EmptyTensor.h>

namespace gpuautograd C10_HIDDEN {  // hidden: key.h says why
namespace {

// An uninitialized buffer for a program's result (its kernels write every element). On the host
// without the dispatcher, which costs as much again as the allocation.
at::Tensor fresh_tensor(c10::IntArrayRef shape, at::ScalarType dtype, at::Device device) {
  if (device.is_cpu()) {
    return at::detail::empty_cpu(shape, dtype);
  }
  return at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
}

}  // namespace

bool TableGroup::fill(at::Tensor& table, int64_t lo, py::dict call) const {
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

void FreshBuffers::allocate(py::dict call) const {
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

ReplayPlan::ReplayPlan(int64_t num_args, std::vector<std::vector<int64_t>> fresh_shapes, std::vector<at::ScalarType> fresh_dtypes,
                       at::Device device, std::vector<int64_t> slot_sources, std::vector<int64_t> deltas, std::vector<bool> values,
                       std::vector<int64_t> aligned, std::vector<int64_t> pinned_slots, std::vector<int64_t> pinned_addresses,
                       int64_t alignment, std::vector<int64_t> out_sources, std::vector<bool> out_views,
                       std::vector<std::vector<int64_t>> out_sizes, std::vector<std::vector<int64_t>> out_strides,
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

bool ReplayPlan::bind(std::vector<at::Tensor>& tensors, at::Tensor& table, int64_t lo) const {
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

std::vector<at::Tensor> ReplayPlan::results(std::vector<at::Tensor>& tensors) const {
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

}  // namespace gpuautograd
