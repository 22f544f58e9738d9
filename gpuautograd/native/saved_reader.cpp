// Reading saved values: the private fields of SavedVariable that SavedReader checks, and the
// generated readers (saved_readers.inc, which readers.py writes into the build directory) with
// the table that finds them by node class.

#include "saved_reader.h"

#include <torch/csrc/autograd/generated/Functions.h>
#include <torch/csrc/autograd/variable.h>

namespace gpuautograd C10_HIDDEN {  // hidden: key.h says why
namespace {

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

}  // namespace

void SavedReader::operator()(const SavedVariable& sv) {
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

// unpack()'s checks, where they pass, without its work: the version matches, and a saved
// input that is not a leaf still has its grad_fn (else unpack names the in-place detach).
bool SavedReader::unpacks_as_is(const SavedVariable& sv, const at::Tensor& data) {
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

namespace {
#include "saved_readers.inc"
}  // namespace

ReaderTable::ReaderTable() {
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

}  // namespace gpuautograd
