// What the c10d shim's two files share: the group handle the C ABI passes around as
// `void*`, and the guard that turns every C++ exception into a malloc'd message.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <cstdlib>
#include <cstring>

namespace lakeml {
// One process group and the store its ranks met through: gloo's (shim.cpp), or NCCL's,
// which keeps its keys in the gloo group's store under a prefix (nccl.cpp).
struct Group {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::Backend> pg;
};

inline char* copy(const char* s) {
  size_t n = std::strlen(s);
  char* p = static_cast<char*>(std::malloc(n + 1));
  if (p) std::memcpy(p, s, n + 1);
  return p;
}
}  // namespace lakeml

#define LK_GUARD(...)                                \
  try {                                              \
    __VA_ARGS__;                                     \
    return nullptr;                                  \
  } catch (const c10::Error& e) {                    \
    return lakeml::copy(e.what_without_backtrace()); \
  } catch (const std::exception& e) {                \
    return lakeml::copy(e.what());                   \
  } catch (...) {                                    \
    return lakeml::copy("unknown C++ exception");    \
  }
