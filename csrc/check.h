// SYM_CHECK(cond, parts...): TORCH_CHECK with the message put together here, without iostreams.
//
// TORCH_CHECK formats its message parts through a std::ostringstream (c10::str). On one GPU
// machine's image (Ubuntu 24.04, g++ 13.3, torch 2.11.0+cu130 from its wheel, Intel Xeon model
// 207) every check of this library whose message streamed a number (an int, a shape) crashed the
// process with SIGSEGV instead of raising, under both the CPU-only and the CUDA build, while the
// checks whose parts were only strings and dtypes raised as they should (perf/RESULTS.md, "GPU":
// 50 bad-input tests split exactly along that line). Here numbers become text with
// std::to_string and snprintf, shapes are written out by hand, and TORCH_CHECK gets one
// std::string, which c10::str passes through untouched: no stream, no locale facet is used
// on any error path of this library.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace symphony {
namespace msg_detail {

inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void put(std::string& s, char v) { s += v; }
inline void put(std::string& s, double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  s += buf;
}
inline void put(std::string& s, float v) { put(s, double(v)); }
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                        !std::is_same_v<T, char>, int> = 0>
inline void put(std::string& s, T v) {
  s += std::to_string(v);
}
inline void put(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void put(std::string& s, at::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, const c10::Device& v) { s += v.str(); }

}  // namespace msg_detail

// The parts (strings, integers, floating-point numbers, shapes, dtypes, devices) as one string.
template <class... Parts>
std::string msg(const Parts&... parts) {
  std::string s;
  (msg_detail::put(s, parts), ...);
  return s;
}

}  // namespace symphony

// The parts are only evaluated when the check fails, as with TORCH_CHECK.
#define SYM_CHECK(cond, ...) TORCH_CHECK(cond, ::symphony::msg(__VA_ARGS__))
