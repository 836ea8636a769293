// Reading a layer's Python state from C++ without Python's attribute machinery: what the update
// plan (update_plan.cpp) and the call template (call_template.cpp) check at every step or call.
#pragma once

#include <pybind11/pybind11.h>

namespace tpfp8 {

// A borrowed dict entry, or null (also when `dict` is null or not a dict).
inline PyObject* dict_entry(PyObject* dict, PyObject* key) {
  if (dict == nullptr || !PyDict_Check(dict)) return nullptr;
  PyObject* value = PyDict_GetItemWithError(dict, key);
  if (value == nullptr && PyErr_Occurred()) throw pybind11::error_already_set();
  return value;
}

// The same entry, held (a null object where there is none).
inline pybind11::object held_entry(PyObject* dict, PyObject* key) {
  return pybind11::reinterpret_borrow<pybind11::object>(dict_entry(dict, key));
}

// An object's __dict__ (a null object if it has none).
inline pybind11::object instance_dict(pybind11::handle obj) {
  PyObject* attrs = PyObject_GenericGetDict(obj.ptr(), nullptr);
  if (attrs == nullptr) PyErr_Clear();
  return pybind11::reinterpret_steal<pybind11::object>(attrs);
}

}  // namespace tpfp8
