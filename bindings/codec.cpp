// resilient._C.codec_walk: the hot part of resilient.checkpoint.codec.encode() in C++. A save
// walks its whole state (about 1,800 nodes for a 1B model and its AdamW state) on the caller's
// thread, and the Python walk costs about 1.5 us a node, a sizeable part of an overlapped
// save's return. This walk takes exactly the types codec.encode() handles first (exact dict,
// OrderedDict, list, str, int, float, bool, None, tensors) and gives every other object to the
// Python walk (`fallback`) at the same path and depth, so the two produce the same document,
// the same tensor names in the same order, and the same errors (an error case always goes to
// the Python walk, which raises it). tests/python/test_codec_native.py compares them.
#include <Python.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <string>

#include "register.hpp"

namespace resilient::py {

namespace pyb = pybind11;

namespace {

// A new reference, or nullptr with a Python error set.
using Ref = PyObject*;

struct Walk {
  PyObject* tensors;      // dict name -> tensor (shared with the Python walk)
  PyObject* tensor_type;  // torch.Tensor
  PyObject* odict_type;   // collections.OrderedDict
  PyObject* fallback;     // codec's enc(obj, path, depth)
  PyObject* tag_tensor;   // "$tensor"
  PyObject* tag_dict;     // "$dict"
  PyObject* tag_odict;    // "$odict"
  PyObject* key_tag;      // "$key"
  long max_depth;

  // path: a str, or Py_None at the root.
  Ref call_fallback(PyObject* obj, PyObject* path, long depth) const {
    PyObject* d = PyLong_FromLong(depth);
    if (d == nullptr) return nullptr;
    Ref out = PyObject_CallFunctionObjArgs(fallback, obj, path, d, nullptr);
    Py_DECREF(d);
    return out;
  }

  // isinstance(obj, torch.Tensor): 1, 0, or -1 with an error set.
  int is_tensor(PyObject* obj) const { return PyObject_IsInstance(obj, tensor_type); }

  // for_items() of an exact dict without making its items view: the positions PyDict_Next
  // walks are those of the dict's own iterator, and so are the two checks (CPython's
  // dictiter_iternextitem): the size differs from the start's (a callback added or removed a
  // key), or an item beyond the start's count turns up (keys swapped at one size).
  template <class F>
  static bool for_dict_items(PyObject* obj, F& f) {
    const Py_ssize_t used = PyDict_GET_SIZE(obj);
    Py_ssize_t pos = 0, left = used;
    PyObject *k, *v;
    for (;;) {
      if (PyDict_GET_SIZE(obj) != used) {
        PyErr_SetString(PyExc_RuntimeError, "dictionary changed size during iteration");
        return false;
      }
      if (!PyDict_Next(obj, &pos, &k, &v)) return true;
      if (left-- == 0) {
        PyErr_SetString(PyExc_RuntimeError, "dictionary keys changed during iteration");
        return false;
      }
      Py_INCREF(k);  // f may run Python code that changes the dict
      Py_INCREF(v);
      const bool ok = f(k, v);
      Py_DECREF(v);
      Py_DECREF(k);
      if (!ok) return false;
    }
  }

  // Calls f(key, value) for each item of `obj.items()`, through the same iterator Python's loop
  // uses: its order (an OrderedDict's own), and its RuntimeError when a callback (a Stateful's
  // state_dict()) changes the dict. False with an error set when that or `f` failed.
  template <class F>
  static bool for_items(PyObject* obj, F&& f) {
    if (PyDict_CheckExact(obj)) return for_dict_items(obj, f);
    static PyObject* const name = PyUnicode_InternFromString("items");
    Ref items = PyObject_CallMethodNoArgs(obj, name);
    Ref it = items != nullptr ? PyObject_GetIter(items) : nullptr;
    Py_XDECREF(items);
    if (it == nullptr) return false;
    bool ok = true;
    while (ok) {
      Ref pair = PyIter_Next(it);
      if (pair == nullptr) break;
      ok = PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2;
      if (!ok) PyErr_SetString(PyExc_TypeError, "items() did not give pairs");
      if (ok) ok = f(PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));  // held by pair
      Py_DECREF(pair);
    }
    Py_DECREF(it);
    return ok && PyErr_Occurred() == nullptr;
  }

  // codec's tensor(): {"$tensor": name}, the name unique in `tensors`.
  Ref tensor(PyObject* obj, PyObject* path) const {
    PyObject* base = (path == Py_None || PyUnicode_GET_LENGTH(path) == 0) ? nullptr : path;
    Ref name = base != nullptr ? (Py_INCREF(base), base) : PyUnicode_FromString("tensor");
    if (name == nullptr) return nullptr;
    for (long n = 1;; ++n) {
      int taken = PyDict_Contains(tensors, name);
      if (taken < 0) return Py_DECREF(name), nullptr;
      if (taken == 0) break;
      Py_DECREF(name);
      name = base != nullptr ? PyUnicode_FromFormat("%U#%ld", base, n + 1)
                             : PyUnicode_FromFormat("tensor#%ld", n + 1);
      if (name == nullptr) return nullptr;
    }
    Ref out = nullptr;
    if (PyDict_SetItem(tensors, name, obj) == 0) {
      out = PyDict_New();
      if (out != nullptr && PyDict_SetItem(out, tag_tensor, name) != 0) Py_CLEAR(out);
    }
    Py_DECREF(name);
    return out;
  }

  // prefix + key with '/' escaped as in codec.key_str (a str key) or str(key) for others.
  static Ref sub_path(PyObject* prefix, PyObject* key) {
    Ref text = PyUnicode_CheckExact(key) ? (Py_INCREF(key), key) : PyObject_Str(key);
    if (text == nullptr) return nullptr;
    Ref out = nullptr;
    static PyObject* slash = PyUnicode_InternFromString("/");
    static PyObject* escaped = PyUnicode_InternFromString("%2F");
    Ref esc = PyUnicode_Replace(text, slash, escaped, -1);
    Py_DECREF(text);
    if (esc == nullptr) return nullptr;
    if (prefix == nullptr) return esc;
    out = PyUnicode_Concat(prefix, esc);
    Py_DECREF(esc);
    return out;
  }

  // "" at the root, else path + "/"; nullptr (no error) stands for "".
  static bool make_prefix(PyObject* path, Ref* prefix) {
    *prefix = nullptr;
    if (path == Py_None) return true;
    *prefix = PyUnicode_FromFormat("%U/", path);
    return *prefix != nullptr;
  }

  // codec's _plain_sorted for a dict whose keys are all exact str (else the Python walk):
  // 1 plain sorted, 0 not, -1 error; *exact = false when some key is not an exact str.
  static int plain_sorted(PyObject* obj, bool* exact) {
    PyObject *k, *v, *prev = nullptr;
    Py_ssize_t pos = 0;
    int sorted = 1;
    *exact = true;
    while (PyDict_Next(obj, &pos, &k, &v)) {
      if (!PyUnicode_CheckExact(k)) {
        *exact = false;
        return 0;
      }
      if (sorted && PyUnicode_GET_LENGTH(k) > 0 && PyUnicode_READ_CHAR(k, 0) == '$') sorted = 0;
      if (sorted && prev != nullptr) {
        int lt = PyUnicode_Compare(k, prev) < 0;
        if (PyErr_Occurred()) return -1;
        if (lt) sorted = 0;
      }
      prev = k;
    }
    return sorted;
  }

  Ref value(PyObject* v, PyObject* sub, long depth) const {
    if (depth <= max_depth) {
      int t = is_tensor(v);
      if (t < 0) return nullptr;
      if (t > 0) return tensor(v, sub);
    }
    return enc(v, sub, depth);
  }

  Ref mapping(PyObject* obj, PyObject* path, long depth) const {
    bool exact = true;
    int sorted = plain_sorted(obj, &exact);
    if (sorted < 0) return nullptr;
    if (!exact) return call_fallback(obj, path, depth);
    if (sorted == 0) return tagged_pairs(tag_dict, obj, path, depth);
    Ref prefix;
    if (!make_prefix(path, &prefix)) return nullptr;
    Ref out = PyDict_New();
    if (out != nullptr && !for_items(obj, [&](PyObject* k, PyObject* v) {
          Ref sub = sub_path(prefix, k);
          Ref item = sub != nullptr ? value(v, sub, depth + 1) : nullptr;
          const bool ok = item != nullptr && PyDict_SetItem(out, k, item) == 0;
          Py_XDECREF(item);
          Py_XDECREF(sub);
          return ok;
        })) {
      Py_CLEAR(out);
    }
    Py_XDECREF(prefix);
    return out;
  }

  // {tag: [[key, value]...]}: codec's pairs(), for a dict (plain or ordered) of any keys.
  Ref tagged_pairs(PyObject* tag, PyObject* obj, PyObject* path, long depth) const {
    Ref prefix, key_path;
    if (!make_prefix(path, &prefix)) return nullptr;
    key_path = path == Py_None ? (Py_INCREF(key_tag), key_tag)
                               : PyUnicode_FromFormat("%U/%U", path, key_tag);
    Ref list = key_path != nullptr ? PyList_New(0) : nullptr;
    depth += 3;
    if (list != nullptr && !for_items(obj, [&](PyObject* k, PyObject* v) {
          Ref sub = sub_path(prefix, k);
          Ref key = nullptr;
          if (sub != nullptr) {
            key = (PyUnicode_CheckExact(k) && PyUnicode_IS_ASCII(k)) ? (Py_INCREF(k), k)
                                                                     : enc(k, key_path, depth);
          }
          Ref item = key != nullptr ? value(v, sub, depth) : nullptr;
          Ref pair = item != nullptr ? PyList_New(2) : nullptr;
          if (pair != nullptr) {
            PyList_SET_ITEM(pair, 0, key);  // steals
            PyList_SET_ITEM(pair, 1, item);
            key = item = nullptr;
          }
          const bool ok = pair != nullptr && PyList_Append(list, pair) == 0;
          Py_XDECREF(pair);
          Py_XDECREF(item);
          Py_XDECREF(key);
          Py_XDECREF(sub);
          return ok;
        })) {
      Py_CLEAR(list);
    }
    Py_XDECREF(prefix);
    Py_XDECREF(key_path);
    if (list == nullptr) return nullptr;
    Ref out = PyDict_New();
    if (out != nullptr && PyDict_SetItem(out, tag, list) != 0) Py_CLEAR(out);
    Py_DECREF(list);
    return out;
  }

  Ref sequence(PyObject* obj, PyObject* path, long depth) const {
    Ref prefix;
    if (!make_prefix(path, &prefix)) return nullptr;
    Ref out = PyList_New(0);
    // As Python's enumerate over a list: the length is read again at each step, so a callback
    // that changes the list changes what is walked, as in the Python walk.
    for (Py_ssize_t i = 0; out != nullptr && i < PyList_GET_SIZE(obj); ++i) {
      PyObject* v = PyList_GET_ITEM(obj, i);
      Py_INCREF(v);
      Ref sub = prefix != nullptr ? PyUnicode_FromFormat("%U%zd", prefix, i)
                                  : PyUnicode_FromFormat("%zd", i);
      Ref item = sub != nullptr ? enc(v, sub, depth + 1) : nullptr;
      Py_DECREF(v);
      Py_XDECREF(sub);
      if (item == nullptr || PyList_Append(out, item) != 0) Py_CLEAR(out);
      Py_XDECREF(item);
    }
    Py_XDECREF(prefix);
    return out;
  }

  // codec's enc(); every case it does not take goes to `fallback`.
  Ref enc(PyObject* obj, PyObject* path, long depth) const {
    if (depth > max_depth) return call_fallback(obj, path, depth);  // raises "too deeply"
    if (PyUnicode_CheckExact(obj)) {
      if (PyUnicode_IS_ASCII(obj) || PyUnicode_AsUTF8AndSize(obj, nullptr) != nullptr) {
        Py_INCREF(obj);
        return obj;
      }
      PyErr_Clear();
      return call_fallback(obj, path, depth);  // not UTF-8 (lone surrogates): raises
    }
    if (PyDict_CheckExact(obj)) return mapping(obj, path, depth);
    if (PyList_CheckExact(obj)) return sequence(obj, path, depth);
    if (obj == Py_None || PyBool_Check(obj)) {
      Py_INCREF(obj);
      return obj;
    }
    if (PyLong_CheckExact(obj)) {
      int overflow = 0;
      (void)PyLong_AsLongLongAndOverflow(obj, &overflow);
      if (overflow == 0) {
        Py_INCREF(obj);
        return obj;
      }
      return call_fallback(obj, path, depth);  // tagged as a big int
    }
    if (PyFloat_CheckExact(obj)) {
      if (std::isfinite(PyFloat_AS_DOUBLE(obj))) {
        Py_INCREF(obj);
        return obj;
      }
      return call_fallback(obj, path, depth);
    }
    int t = is_tensor(obj);
    if (t < 0) return nullptr;
    if (t > 0) return tensor(obj, path);
    if (Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(odict_type))
      return tagged_pairs(tag_odict, obj, path, depth);
    return call_fallback(obj, path, depth);
  }
};

}  // namespace

void register_codec(pyb::module_& m) {
  m.def(
      "codec_walk",
      [](pyb::handle obj, pyb::handle path, long depth, pyb::dict tensors, pyb::type tensor_type,
         pyb::type odict_type, pyb::function fallback, long max_depth) {
        static PyObject* tag_tensor = PyUnicode_InternFromString("$tensor");
        static PyObject* tag_dict = PyUnicode_InternFromString("$dict");
        static PyObject* tag_odict = PyUnicode_InternFromString("$odict");
        static PyObject* key_tag = PyUnicode_InternFromString("$key");
        if (!path.is_none() && !PyUnicode_Check(path.ptr()))
          throw pyb::type_error("path must be a str or None");
        const Walk walk{tensors.ptr(),  tensor_type.ptr(), odict_type.ptr(),
                        fallback.ptr(), tag_tensor,        tag_dict,
                        tag_odict,      key_tag,           max_depth};
        PyObject* out = walk.enc(obj.ptr(), path.ptr(), depth);
        if (out == nullptr) throw pyb::error_already_set();
        return pyb::reinterpret_steal<pyb::object>(out);
      },
      pyb::arg("obj"), pyb::arg("path"), pyb::arg("depth"), pyb::arg("tensors"),
      pyb::arg("tensor_type"), pyb::arg("odict_type"), pyb::arg("fallback"), pyb::arg("max_depth"),
      "resilient.checkpoint.codec's walk of `obj` at `path` (str or None) and `depth`, in C++ "
      "for exact dicts, OrderedDicts, lists, plain scalars and tensors; every other object "
      "goes to `fallback(obj, path, depth)`. Adds the tensors it meets to `tensors`.");
}

}  // namespace resilient::py
