// An operator call's name and inputs as numbers, the same in the operator trace (`optrace.cpp`),
// in fake mode (`learned_scratch.cpp`) and in its reductions (`cuda_reductions.cpp`): each tensor as `[dtype, ndim, sizes..., strides...]` (oneDNN's
// scratch depends on the layout: a product of a transposed operand reorders it), anything else
// as `[-1]`. With the operator's name it keys what fake mode learns of a call from a real one
// (its scratch).
#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <string>
#include <vector>

namespace ckpt {

inline void shape_codes(c10::ArrayRef<c10::IValue> args, std::vector<int64_t>& out) {
  for (const c10::IValue& v : args) {
    if (v.isTensor() && v.toTensor().defined()) {
      const at::Tensor& t = v.toTensor();
      out.push_back(static_cast<int64_t>(t.scalar_type()));
      out.push_back(t.dim());
      for (int64_t s : t.sizes()) out.push_back(s);
      for (int64_t s : t.strides()) out.push_back(s);
    } else {
      out.push_back(-1);
    }
  }
}

// The operator a RecordFunction event is for, with its overload: `aten::add.Tensor`, `aten::mm`.
inline std::string op_name(const at::RecordFunction& fn) {
  std::string name = fn.name();
  std::string overload = fn.overload_name();
  if (!overload.empty()) name += "." + overload;
  return name;
}

// `name|code,code,...`: `optrace::op_key` writes the same in Rust.
inline std::string op_key(const std::string& name, const std::vector<int64_t>& codes) {
  std::string key = name + "|";
  for (size_t i = 0; i < codes.size(); ++i) {
    if (i > 0) key += ",";
    key += std::to_string(codes[i]);
  }
  return key;
}

}  // namespace ckpt
