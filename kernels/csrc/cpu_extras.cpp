// What CPU kernels allocate after their outputs exist, which a structured kernel's shape
// function (all a meta kernel runs) does not: a reduction's input converted to the output's
// dtype, mean's sum and divide. Each replay calls the operators the CPU implementation calls,
// on the fake tensors, so that fake mode counts their bytes in the CPU's order
// (aten/src/ATen/native/ReduceOps.cpp).

#include "cpu_extras.h"

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <unordered_map>

namespace {

using at::Tensor;

bool reduced(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// `make_reduction_from_out_ty` on the CPU: an input of another dtype than the output is
// converted first.
void reduction_input_cast(const Tensor& self, at::ScalarType out_dtype) {
  if (self.scalar_type() != out_dtype) Tensor converted = self.to(out_dtype);
}

// sum.dim_IntList(self, dim, keepdim, dtype) -> result; sum.IntList_out(..., out) -> out.
void sum_dim(const std::vector<c10::IValue>& args, const std::vector<c10::IValue>& results) {
  reduction_input_cast(args[0].toTensor(), results[0].toTensor().scalar_type());
}

// mean.dim(self, dim, keepdim, dtype) -> result: a float copy of a reduced-precision result,
// summed into (the sum converting its input), divided by the count (a Python number), and
// copied back.
void mean_dim(const std::vector<c10::IValue>& args, const std::vector<c10::IValue>& results) {
  const Tensor& self = args[0].toTensor();
  const Tensor& result = results[0].toTensor();
  std::optional<std::vector<int64_t>> dim;
  if (!args[1].isNone()) dim = args[1].toIntVector();
  int64_t count = 1;
  if (!dim.has_value() || dim->empty() || self.dim() == 0) {
    count = self.numel();
  } else {
    for (int64_t d : *dim) count *= self.size(d);
  }
  const bool half = reduced(result.scalar_type());
  Tensor temp = half ? result.to(at::kFloat) : result;
  at::OptionalIntArrayRef dims = dim.has_value() ? at::OptionalIntArrayRef(*dim) : std::nullopt;
  at::sum_out(temp, self, dims, args[2].toBool(), temp.scalar_type()).div_(count);
  if (half) result.copy_(temp);
}

}  // namespace

namespace ckpt {

CpuExtras cpu_extras(const c10::OperatorName& name) {
  static const std::unordered_map<std::string, CpuExtras> table = {
      {"aten::sum.dim_IntList", &sum_dim},
      {"aten::sum.IntList_out", &sum_dim},
      {"aten::mean.dim", &mean_dim},
  };
  auto it = table.find(name.overload_name.empty() ? name.name : name.name + "." + name.overload_name);
  return it == table.end() ? nullptr : it->second;
}

}  // namespace ckpt
