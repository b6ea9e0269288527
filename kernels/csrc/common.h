// What every C entry point of the shim shares: errors reported as a malloc'd message through
// `err` (freed by ckpt_free_str), so that no C++ exception crosses the C boundary.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace ckpt {

inline char* dup_str(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

// Runs `f`; 0 on success, else 1 with the exception's message in `*err`.
template <typename F>
int guarded(char** err, F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    if (err != nullptr) *err = dup_str(e.what());
  } catch (...) {
    if (err != nullptr) *err = dup_str("unknown C++ exception");
  }
  return 1;
}

}  // namespace ckpt
