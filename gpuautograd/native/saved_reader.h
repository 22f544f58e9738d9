// Reading a generated node's saved values without compiled_args: SavedReader, which the generated
// readers (saved_readers.inc, written by readers.py) hand each field to, and the lookup of a node
// class's reader.
#pragma once

#include "key.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

namespace gpuautograd C10_HIDDEN {  // hidden: key.h says why

using torch::autograd::Node;
using torch::autograd::SavedVariable;
// How the graph holds its nodes: std::shared_ptr in torch 2.11, c10::intrusive_ptr in 2.13.
using NodePtr = decltype(torch::autograd::Edge::function);

// Reads one generated node's saved fields (the readers in saved_readers.inc call it once per field,
// in declaration order): values go into the key, tensors into the walk's saved list. A tensor is
// what SavedVariable::unpack would give, checked as unpack checks it (released, modified in place,
// detached in place), without the fresh tensor unpack makes of a saved output: the data itself.
class SavedReader {
 public:
  SavedReader(KeyWriter& key, std::vector<at::Tensor>& tensors, std::vector<const SavedVariable*>& sources, const NodePtr& node)
      : key_(key), tensors_(tensors), sources_(sources), node_(node) {}

  void operator()(const SavedVariable& sv);  // saved_reader.cpp, next to the private fields it reads
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
  // Defined in saved_reader.cpp, its one caller's file; inline, so it may be folded into the caller.
  static inline bool unpacks_as_is(const SavedVariable& sv, const at::Tensor& data);

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

// The generated readers by node class: an open-addressing table of (type_info address, reader),
// 16 bytes a slot, so a lookup with the caches cold after a forward costs one line. (A
// std::unordered_map's bucket, node and chain cost two or three, and hashing the type's name
// reads the name.) A type_info's address names one class: a generated node class has its key
// function in libtorch, which holds its one type_info, and the readers' typeid() refers to it.
class ReaderTable {
 public:
  ReaderTable();  // saved_reader.cpp, where the generated readers are

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
// Inline: the walk looks up every C++ node's class.
inline ReadSaved reader_of(const std::type_info& type) {
  static const ReaderTable table;
  return table.find(&type);
}

}  // namespace gpuautograd
