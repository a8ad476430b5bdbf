//===- GroupHandle.cpp - The C++ group behind a torch.distributed group ---===//
//
// torch.distributed's groups are Python objects that pybind11 made of a
// c10d::ProcessGroup, which PyTorch 1.13's operator schemas cannot take
// (they expect TorchScript objects). moec_torch hands the Python object to
// moec_process_group through ctypes.PyDLL (the GIL held), which takes the
// C++ group out with pybind11's caster, the one torch registered the type
// with (same pybind11 and compiler ABI: Debian builds both from its
// pybind11-dev), and returns it with a reference of its own that the layer
// or exchange constructor takes over (c10::intrusive_ptr::reclaim).
//
//===----------------------------------------------------------------------===//

#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>

PYBIND11_DECLARE_HOLDER_TYPE(T, c10::intrusive_ptr<T>, true);

/// The c10d::ProcessGroup of `group` with one more reference, or null with
/// a Python TypeError when `group` is not a torch.distributed group.
extern "C" __attribute__((visibility("default"))) void *moec_process_group(PyObject *group) {
  try {
    auto *pg = pybind11::handle(group).cast<c10d::ProcessGroup *>();
    if (!pg) {
      PyErr_SetString(PyExc_TypeError, "moec: group is None, not a torch.distributed group");
      return nullptr;
    }
    c10::raw::intrusive_ptr::incref(pg);
    return pg;
  } catch (const std::exception &e) {
    const std::string text = std::string("moec: group must be a torch.distributed process group "
                                         "(ProcessGroup): ") +
                             e.what();
    PyErr_SetString(PyExc_TypeError, text.c_str());
    return nullptr;
  }
}
