// A native thread whose noexcept destructor takes the GIL, as a gloo worker's work object does.
#include <Python.h>
#include <chrono>
#include <thread>

namespace {
struct TakesGilWhenDestroyed {
  ~TakesGilWhenDestroyed() noexcept {
    PyGILState_STATE state = PyGILState_Ensure();
    PyGILState_Release(state);
  }
};

PyObject* start(PyObject*, PyObject* delay) {
  double seconds = PyFloat_AsDouble(delay);
  std::thread([seconds] {
    TakesGilWhenDestroyed work;
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }).detach();
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {{"start", start, METH_O, nullptr}, {nullptr, nullptr, 0, nullptr}};
PyModuleDef module = {PyModuleDef_HEAD_INIT, "late_gil", nullptr, -1, methods};
}  // namespace

PyMODINIT_FUNC PyInit_late_gil() { return PyModule_Create(&module); }
