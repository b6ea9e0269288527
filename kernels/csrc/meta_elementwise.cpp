// Meta kernels for elementwise operators whose CPU kernels are not structured (so libtorch has
// no meta kernel for them): each builds the TensorIterator its CPU kernel builds, on the fake
// tensors (`fake.cpp`), which resizes the output and makes the dtype promotions' temporaries as
// the CPU does, and stops before the loop, or makes the calls the CPU kernel makes.
// (aten/src/ATen/native/BinaryOps.cpp, UnaryOps.cpp, Activation.cpp)

#include <ATen/ATen.h>
#include <ATen/TensorIterator.h>
#include <torch/library.h>

#include <utility>

#include "meta_kernels.h"

namespace {

using at::Tensor;

// `logical_not_out`: a unary iterator that allows a bool output.
Tensor& logical_not_out_meta(const Tensor& self, Tensor& result) {
  at::TensorIteratorConfig().check_all_same_dtype(false).add_output(result).add_const_input(self).build();
  return result;
}

// `logical_and_out`, `logical_or_out`, `logical_xor_out`: comparison iterators.
Tensor& logical_binary_out_meta(const Tensor& self, const Tensor& other, Tensor& result) {
  at::TensorIterator::comparison_op(result, self, other);
  return result;
}

// `relu`: the CPU's is `clamp_min(self, 0)` (structured, so it runs on the fake tensors).
// Out-of-place ReLU (`F.relu`, OPT's and many CNNs' activations) had no meta kernel.
Tensor relu_meta(const Tensor& self) {
  TORCH_CHECK(self.scalar_type() != at::kBool, "Boolean inputs not supported for relu");
  return at::clamp_min(self, 0);
}

// `hardtanh_backward` (ReLU6's backward, MobileNet's): a binary iterator over the gradient and
// the input that allocates its output.
Tensor hardtanh_backward_meta(const Tensor& grad_output, const Tensor& self, const at::Scalar&, const at::Scalar&) {
  Tensor result;
  auto iter = at::TensorIterator::borrowing_binary_op(result, grad_output, self);
  return iter.output();
}

// `hardswish_backward` (Hardswish's backward, MobileNetV3's): the same binary iterator.
Tensor hardswish_backward_meta(const Tensor& grad_output, const Tensor& self) {
  Tensor result;
  auto iter = at::TensorIterator::borrowing_binary_op(result, grad_output, self);
  return iter.output();
}

// `abs.out` (`abs` calls it with an empty output): a unary iterator, which resizes the output
// (T5's and DeBERTa's relative position buckets take `abs` of integer distances).
Tensor& abs_out_meta(const Tensor& self, Tensor& result) {
  TORCH_CHECK(!self.is_complex(), "ckptune's meta abs: complex inputs are not modelled");
  at::TensorIterator::unary_op(result, self);
  return result;
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  auto own = [&](const char* name, auto&& fn) { ckpt::register_own(m, name, std::forward<decltype(fn)>(fn)); };
  own("logical_not.out", TORCH_FN(logical_not_out_meta));
  own("logical_and.out", TORCH_FN(logical_binary_out_meta));
  own("logical_or.out", TORCH_FN(logical_binary_out_meta));
  own("logical_xor.out", TORCH_FN(logical_binary_out_meta));
  own("relu", TORCH_FN(relu_meta));
  own("hardtanh_backward", TORCH_FN(hardtanh_backward_meta));
  own("hardswish_backward", TORCH_FN(hardswish_backward_meta));
  own("abs.out", TORCH_FN(abs_out_meta));
}

}  // namespace

namespace ckpt {
int meta_elementwise_linked() { return 1; }
}  // namespace ckpt
