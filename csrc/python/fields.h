// Binding plain C++ structs to Python field by field (csrc/python/planner_bindings.cpp,
// csrc/python/sim_bindings.cpp).
//
// Struct<S> is a py::class_<S> whose data members are named properties: read as Python
// values (numbers, enum members, numpy arrays for vectors of ints, lists for vectors of
// structs, the nested struct itself for a struct member, so `input.memory.budget_bytes
// = b` writes through), written with a check that names the field: a value of the wrong
// type raises TypeError, one the member cannot hold (an int past int32) ValueError, so
// nothing wraps around on its way into the planner. Every struct is built by keyword,
// `PlanInput(num_ranks=2, ...)`, lists its fields in `_fields` (declaration order) and
// prints them in its repr.
//
// No torch here: the bindings see only pybind11 and the plain C++ of csrc/planner and
// csrc/sim.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace lrmoe {
namespace python {

namespace py = pybind11;

template <typename T>
struct is_vector : std::false_type {};
template <typename T>
struct is_vector<std::vector<T>> : std::true_type {};

// str(v) as a std::string. Taking a handle keeps the call unambiguous: py::str(int_) has
// two candidate constructors under GCC 13 with pybind11 3 (the H200 image's build failed).
inline std::string text(py::handle v) { return py::str(v).cast<std::string>(); }

inline std::string describe(py::handle v) {
  return py::repr(v).cast<std::string>() + " (" +
         text(py::type::of(v).attr("__name__")) + ")";
}

template <typename I>
std::string int_range() {
  return "[" + std::to_string(std::numeric_limits<I>::min()) + ", " +
         std::to_string(std::numeric_limits<I>::max()) + "]";
}

// An integer array-like (numpy array, list, nested lists) as a flat C-order vector of I,
// with its shape. Floats and bools are refused rather than truncated, values outside I
// rather than wrapped. `where` names the argument or field in the messages.
template <typename I>
std::vector<I> int_vector(py::handle v, const std::string& where,
                          std::vector<int64_t>* shape = nullptr) {
  py::array a;
  try {
    a = py::module_::import("numpy").attr("asarray")(v);
  } catch (py::error_already_set& e) {
    throw py::type_error(where + " must be an array of ints, got " + describe(v) + ": " +
                         e.what());
  }
  const char kind = a.dtype().kind();
  // np.asarray([]) is float64: an empty list is an empty array of ints
  if (a.size() > 0 && kind != 'i' && kind != 'u')
    throw py::type_error(where + " must hold ints, got dtype " +
                         text(a.dtype()));
  // only a wider or unsigned source can hold values I cannot (the min/max scans cost
  // more than the copy)
  const auto size = static_cast<size_t>(a.itemsize());
  if (a.size() > 0 && (size > sizeof(I) || (kind == 'u' && size == sizeof(I)))) {
    const py::int_ lo = a.attr("min")(), hi = a.attr("max")();
    if (lo < py::int_(std::numeric_limits<I>::min()) ||
        hi > py::int_(std::numeric_limits<I>::max()))
      throw py::value_error(where + " must hold values in " + int_range<I>() + ", got " +
                            text(lo) + " .. " +
                            text(hi));
  }
  if (shape) shape->assign(a.shape(), a.shape() + a.ndim());
  const auto c = py::array_t<I, py::array::c_style | py::array::forcecast>::ensure(a);
  if (!c) throw py::error_already_set();
  return std::vector<I>(c.data(), c.data() + c.size());
}

// A Python value as the member type T, or an error naming `where`.
template <typename T>
T from_python(py::handle v, const std::string& where) {
  PyObject* p = v.ptr();
  if constexpr (std::is_same_v<T, bool>) {
    if (PyBool_Check(p)) return p == Py_True;
    if (py::isinstance(v, py::module_::import("numpy").attr("bool_")))
      return PyObject_IsTrue(p) == 1;
    throw py::type_error(where + " must be a bool, got " + describe(v));
  } else if constexpr (std::is_integral_v<T>) {
    if (PyBool_Check(p) || !PyIndex_Check(p))
      throw py::type_error(where + " must be an int, got " + describe(v));
    const auto i = py::reinterpret_steal<py::object>(PyNumber_Index(p));
    if (!i) throw py::error_already_set();
    int overflow = 0;
    const long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
    if (overflow || x < std::numeric_limits<T>::min() || x > std::numeric_limits<T>::max())
      throw py::value_error(where + " must be an int in " + int_range<T>() + ", got " +
                            text(i));
    return static_cast<T>(x);
  } else if constexpr (std::is_floating_point_v<T>) {
    if (PyBool_Check(p) || PyUnicode_Check(p) || PyBytes_Check(p))
      throw py::type_error(where + " must be a number, got " + describe(v));
    const double d = PyFloat_AsDouble(p);
    if (d == -1.0 && PyErr_Occurred()) {
      const bool too_big = PyErr_ExceptionMatches(PyExc_OverflowError);
      PyErr_Clear();
      if (too_big) throw py::value_error(where + " is too large for a double, got " + describe(v));
      throw py::type_error(where + " must be a number, got " + describe(v));
    }
    return static_cast<T>(d);
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!PyUnicode_Check(p)) throw py::type_error(where + " must be a str, got " + describe(v));
    return v.cast<std::string>();
  } else if constexpr (std::is_enum_v<T>) {
    // the registered enum's type, from one of its members (py::type::of<T> takes classes only)
    const py::object type = py::type::of(py::cast(T{}));
    const py::dict members = type.attr("__members__");
    if (PyUnicode_Check(p)) {  // a member's name: input.quota_rule = "water_level"
      if (members.contains(v)) return members[v].template cast<T>();
    } else if (py::isinstance(v, type)) {
      return v.cast<T>();
    }
    std::string names;
    for (const auto& kv : members)
      names += (names.empty() ? "" : ", ") + text(kv.first);
    throw py::value_error(where + " must be one of " + names + " (a name or a member of " +
                          text(type.attr("__name__")) + "), got " +
                          describe(v));
  } else if constexpr (is_vector<T>::value) {
    using E = typename T::value_type;
    if constexpr (std::is_integral_v<E>) {
      return int_vector<E>(v, where);
    } else {  // a vector of bound structs: any sequence of them
      if (!py::isinstance<py::sequence>(v) || PyUnicode_Check(p))
        throw py::type_error(where + " must be a list of " +
                             text(py::type::of<E>().attr("__name__")) +
                             ", got " + describe(v));
      T out;
      size_t j = 0;
      for (const auto item : v)
        out.push_back(from_python<E>(item, where + "[" + std::to_string(j++) + "]"));
      return out;
    }
  } else {  // a bound struct
    if (!py::isinstance<T>(v))
      throw py::type_error(where + " must be a " +
                           text(py::type::of<T>().attr("__name__")) +
                           ", got " + describe(v));
    return v.cast<T>();
  }
}

// The member as a Python value; a struct member is returned by reference, kept alive by
// `self` (so that writing its fields writes the owner's).
template <typename T>
py::object to_python(const T& value, py::handle self) {
  if constexpr (is_vector<T>::value) {
    using E = typename T::value_type;
    if constexpr (std::is_integral_v<E>) {
      return py::array_t<E>(static_cast<py::ssize_t>(value.size()), value.data());  // a copy
    } else {
      py::list out;
      for (const E& e : value) out.append(py::cast(e));  // copies
      return std::move(out);
    }
  } else if constexpr (std::is_arithmetic_v<T> || std::is_enum_v<T> ||
                       std::is_same_v<T, std::string>) {
    return py::cast(value);
  } else {
    return py::cast(value, py::return_value_policy::reference_internal, self);
  }
}

// hidden as pybind11's own types are (its class_ is a member)
template <typename S>
class __attribute__((visibility("hidden"))) Struct {
 public:
  Struct(py::handle scope, const char* name, const char* doc)
      : cls_(scope, name, doc), name_(name) {}

  // Bind data member `member` as the property `name`.
  template <typename T>
  Struct& field(const char* name, T S::*member, const char* doc) {
    const std::string where = name_ + "." + name;
    auto set = [member, where](S& s, py::handle v) { s.*member = from_python<T>(v, where); };
    cls_.def_property(
        name, [member](py::object self) { return to_python(self.cast<S&>().*member, self); },
        set, doc);
    setters_->emplace_back(name, set);
    return *this;
  }

  // A method or anything else py::class_::def takes.
  template <typename... Args>
  Struct& def(Args&&... args) {
    cls_.def(std::forward<Args>(args)...);
    return *this;
  }

  // After the last field: `_fields`, the keyword constructor and the repr.
  void done() {
    const auto setters = setters_;
    py::tuple names(setters->size());
    std::string all;
    for (size_t j = 0; j < setters->size(); ++j) {
      names[j] = py::str((*setters)[j].first);
      all += (j ? ", " : "") + (*setters)[j].first;
    }
    cls_.attr("_fields") = names;
    const std::string cname = name_;
    // the fields' own setters, called on a C++ S: no Python object until it is built
    cls_.def(py::init([setters, cname, all](const py::kwargs& kw) {
               S s{};
               for (const auto& kv : kw) {
                 const std::string k = text(kv.first);
                 const auto f = std::find_if(setters->begin(), setters->end(),
                                             [&k](const auto& e) { return e.first == k; });
                 if (f == setters->end())
                   throw py::type_error(cname + " has no field '" + k + "'; its fields: " + all);
                 f->second(s, kv.second);
               }
               return s;
             }),
             ("A " + cname + " with the fields given by name (the others at their C++ "
              "defaults); TypeError/ValueError name a bad field.").c_str());
    cls_.def("__repr__", [setters, cname](py::object self) {
      std::string text = cname + "(";
      for (size_t j = 0; j < setters->size(); ++j) {
        const std::string& name = (*setters)[j].first;
        text += (j ? ", " : "") + name + "=" +
                py::repr(self.attr(name.c_str())).cast<std::string>();
      }
      return text + ")";
    });
  }

  py::class_<S>& cls() { return cls_; }

 private:
  py::class_<S> cls_;
  std::string name_;
  // (name, setter) of every field, in declaration order; shared with the constructor
  std::shared_ptr<std::vector<std::pair<std::string, std::function<void(S&, py::handle)>>>>
      setters_ = std::make_shared<
          std::vector<std::pair<std::string, std::function<void(S&, py::handle)>>>>();
};

}  // namespace python
}  // namespace lrmoe
