// fp8_autocast's exit, planned. Handing every layer's state tensors to C++ each step cost
// ~2.7 us a layer of host time (each conversion of a Python tensor touches its Python object);
// a plan is made once for a set of layers (tpfp8/scaling.py), holds the tensors and the
// launches' parameters, and each step only checks, at C++ speed, that every layer still holds
// what it was planned with.
#include "update_plan.h"

#include <pybind11/stl.h>
#include <torch/extension.h>

#include <memory>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <vector>

#include "linear.h"
#include "py_lookup.h"

namespace py = pybind11;

namespace tpfp8 {
namespace {

// fp8_autocast's exit for a set of layers: a DelayedUpdate per group of them (device, recipe,
// amax group; `groups[k]` the positions of update k's layers), and for every layer what it held
// when the plan was made: the objects of its state buffers (`buffer_names`, in its `_buffers`)
// and of the attributes that chose its group (`attr_names`, in its __dict__), and an int update
// count (`count_name`). run() updates only if every layer, in the same order, still holds
// exactly those objects and no tensor changed under an update (`.data =`, `set_`); else it does
// nothing and returns false, and the caller plans again. After each update it adds one to the
// count of its layers (activation checkpoints read it to know which scales a recompute uses).
class UpdatePlan {
 public:
  UpdatePlan(const py::tuple& layers, std::vector<py::str> buffer_names,
             std::vector<py::str> attr_names, py::str count_name,
             std::vector<std::shared_ptr<DelayedUpdate>> updates,
             std::vector<std::vector<size_t>> groups)
      : buffer_names_(std::move(buffer_names)),
        attr_names_(std::move(attr_names)),
        count_name_(std::move(count_name)),
        layers_(layers.size()),
        updates_(std::move(updates)),
        groups_(std::move(groups)) {
    TORCH_CHECK_VALUE(groups_.size() == updates_.size(), "UpdatePlan: one group per update, got ",
                      groups_.size(), " for ", updates_.size());
    for (const auto& group : groups_) {
      for (const size_t i : group) {
        TORCH_CHECK_VALUE(i < layers_, "UpdatePlan: layer ", i, " of ", layers_);
      }
    }
    for (const py::handle layer : layers) {
      const py::object attrs = instance_dict(layer);
      PyObject* buffers = dict_entry(attrs.ptr(), buffers_key_.ptr());
      TORCH_CHECK_TYPE(buffers != nullptr && PyDict_Check(buffers),
                       "UpdatePlan: a layer without a `_buffers` dict");
      for (const py::str& name : buffer_names_) expected_.push_back(held(buffers, name));
      for (const py::str& name : attr_names_) expected_.push_back(held(attrs.ptr(), name));
    }
  }

  bool run(const py::tuple& layers) {
    std::vector<py::object> dicts;
    if (!holds(layers, dicts)) return false;
    for (const auto& update : updates_) {
      if (!update->unchanged()) return false;
    }
    for (size_t k = 0; k < updates_.size(); ++k) {
      {
        const py::gil_scoped_release release;
        updates_[k]->launch();
      }
      for (const size_t i : groups_[k]) count(dicts[i]);
    }
    return true;
  }

 private:
  // Whether `layers` hold what they were planned with and an int count each; `dicts` gets their
  // __dict__s.
  bool holds(const py::tuple& layers, std::vector<py::object>& dicts) const {
    if (layers.size() != layers_) return false;
    dicts.reserve(layers_);
    auto expected = expected_.begin();
    for (const py::handle layer : layers) {
      dicts.push_back(instance_dict(layer));
      PyObject* attrs = dicts.back().ptr();
      PyObject* buffers = dict_entry(attrs, buffers_key_.ptr());
      if (buffers == nullptr || !PyDict_Check(buffers)) return false;
      for (const py::str& name : buffer_names_) {
        if (dict_entry(buffers, name.ptr()) != (expected++)->ptr()) return false;
      }
      for (const py::str& name : attr_names_) {
        if (dict_entry(attrs, name.ptr()) != (expected++)->ptr()) return false;
      }
      PyObject* count = dict_entry(attrs, count_name_.ptr());
      if (count == nullptr || !PyLong_CheckExact(count)) return false;
    }
    return true;
  }

  // Adds one to the layer's count (an int: holds() saw it).
  void count(const py::object& attrs) const {
    PyObject* count = dict_entry(attrs.ptr(), count_name_.ptr());
    const py::object next = py::reinterpret_steal<py::object>(PyNumber_Add(count, one_.ptr()));
    if (!next || PyDict_SetItem(attrs.ptr(), count_name_.ptr(), next.ptr()) != 0) {
      throw py::error_already_set();
    }
  }

  // The entry `name` of `dict`, held; KeyError if missing.
  static py::object held(PyObject* dict, const py::str& name) {
    py::object value = held_entry(dict, name.ptr());
    if (!value) throw py::key_error(std::string(name));
    return value;
  }

  std::vector<py::str> buffer_names_, attr_names_;
  py::str count_name_;
  size_t layers_;
  // Per layer: its buffers, then its attributes. Declared before updates_, so destroyed after
  // them: where a layer's amax group ends with the plan, its last owner is then the Python
  // object, whose destructor lets the GIL go (a ProcessGroup's joins threads that may need it).
  std::vector<py::object> expected_;
  std::vector<std::shared_ptr<DelayedUpdate>> updates_;
  std::vector<std::vector<size_t>> groups_;
  const py::str buffers_key_{"_buffers"};
  const py::int_ one_{1};
};

}  // namespace

void bind_update_plan(py::module_& m) {
  py::class_<DelayedUpdate, std::shared_ptr<DelayedUpdate>>(
      m, "DelayedUpdate",
      "The delayed-scaling update of a fixed set of layers' states, checked and laid out once")
      .def(py::init([](const std::vector<at::Tensor>& scales,
                       const std::vector<at::Tensor>& scale_invs,
                       const std::vector<at::Tensor>& histories,
                       const std::vector<at::Tensor>& grad_histories,
                       const std::vector<double>& fp8_max, int64_t margin, bool use_history_max,
                       const std::string& amax_group, const std::vector<at::Tensor>& previous) {
             return std::make_shared<DelayedUpdate>(layers_update(
                 scales, scale_invs, histories, grad_histories, fp8_max, margin, use_history_max,
                 amax_group.empty() ? ProcessGroupPtr() : c10d::resolve_process_group(amax_group),
                 previous));
           }),
           py::arg("scales"), py::arg("scale_invs"), py::arg("histories"),
           py::arg("grad_histories"), py::arg("fp8_max"), py::arg("margin"),
           py::arg("use_history_max"), py::arg("amax_group"),
           py::arg("previous") = std::vector<at::Tensor>(),
           "Layer j's scale and scale_inv [3], histories [2, H] and [1, H], fp8_max 3 a layer; "
           "the newest amaxes all-reduced (MAX) over the named group first, if any; `previous`, "
           "if given, receives each layer's scales before each update")
      .def("unchanged", &DelayedUpdate::unchanged,
           "Whether every tensor still has the memory, dtype, shape and strides it was laid out "
           "with")
      .def("run", &DelayedUpdate::run, py::call_guard<py::gil_scoped_release>(),
           "The update, now (RuntimeError if a tensor changed: see unchanged())");
  py::class_<UpdatePlan>(m, "UpdatePlan",
                         "fp8_autocast's exit for one set of layers, checked at every step")
      .def(
          py::init<const py::tuple&, std::vector<py::str>, std::vector<py::str>, py::str,
                   std::vector<std::shared_ptr<DelayedUpdate>>, std::vector<std::vector<size_t>>>(),
          py::arg("layers"), py::arg("buffer_names"), py::arg("attr_names"), py::arg("count_name"),
          py::arg("updates"), py::arg("groups"))
      .def("run", &UpdatePlan::run, py::arg("layers"),
           "Runs the updates and counts them in each layer if every layer still holds what it "
           "was planned with; else does nothing and returns False (plan again)");
}

}  // namespace tpfp8
