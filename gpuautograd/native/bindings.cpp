// The Python module: the walker's classes and functions (walk.h, table.h, delivery.h, key.h) and
// the node hooks' (node_hooks.h), as one extension.

#include "delivery.h"
#include "key.h"
#include "node_hooks.h"
#include "table.h"
#include "walk.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace gpuautograd;
  py::class_<NativeWalk>(m, "NativeWalk")
      .def_property_readonly("key", &NativeWalk::key)
      .def("take_saved", &NativeWalk::take_saved)
      .def_property_readonly("read_by_readers", &NativeWalk::read_by_readers)
      .def_property_readonly("unsupported", &NativeWalk::unsupported)
      .def_property_readonly("fallback", &NativeWalk::fallback)
      .def_property_readonly("hooked_nodes", &NativeWalk::hooked_nodes)
      .def_property_readonly("aliases", &NativeWalk::aliases)
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
