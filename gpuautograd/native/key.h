// The cache key's bytes: the tags that keep its fields apart, KeyWriter (which the walk and the
// saved-value readers write them with), the key of a tensor's metadata, and the key's digest.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>

namespace py = pybind11;

// The walker's files share their classes and functions in namespace gpuautograd, with hidden
// visibility: nothing outside the extension uses them, and hidden (like the anonymous namespace
// that held them when they were one file) they are called directly and the compiler may inline
// them. Under -fPIC, default visibility would call each one through the PLT and keep it out of line.
namespace gpuautograd C10_HIDDEN {


// Tags keep fields of different kinds from running into each other in the key bytes.
enum Tag : uint8_t {
  kNode = 1, kEdge, kNoEdge, kMeta, kSaved, kSizes, kLifted, kLeaf, kPython, kRoot, kInput,
  kHooked,  // a node whose saved values carry unpack hooks: it runs opaque
  kGrad,    // an incoming gradient of a root
  kRead,    // a node's saved values, read by its generated reader (saved_readers.inc)
  kHookBits,  // a node with Python-visible hooks (node_hooks.h's bits): the program yields there
  kAliases,   // saved tensors that are one tensor: the plan reads each such tensor once
};

// The bytes of a Python bytes object, without a copy.
inline std::string_view bytes_view(const py::bytes& b) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &data, &size) != 0) {
    throw py::error_already_set();
  }
  return {data, static_cast<size_t>(size)};
}

// A key's digest for the plan cache's lookup (key.cpp).
uint64_t digest_bytes(const char* data, size_t size);

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
inline void put_tensor_meta(KeyWriter& key, const at::Tensor& t) {
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

}  // namespace gpuautograd
