// Meta kernels for the CPU's convolutions, run on fake tensors (`fake.cpp`), so that libtorch's
// own `_convolution` picks the backend the CPU would (oneDNN, or the slow im2col path) and makes
// the same contiguous copies; these kernels then allocate what that backend allocates: its
// outputs, resized as the CPU kernels resize them, and the column buffers of the slow path.
// oneDNN's own scratch (it allocates through the CPU allocator's raw interface) is not modelled:
// the fake-mode tests list it per operator and bound it.
// (aten/src/ATen/native/mkldnn/Conv.cpp, ConvolutionMM2d.cpp, Convolution.cpp)

#include <ATen/ATen.h>
#include <ATen/native/ConvUtils.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "meta_kernels.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using Ints = c10::SymIntArrayRef;

std::vector<int64_t> ints(Ints s) {
  std::vector<int64_t> out;
  for (const auto& v : s) out.push_back(v.expect_int());
  return out;
}

at::MemoryFormat mkldnn_format(const Tensor& input, const Tensor& weight) {
  if (!at::native::mkldnn_conv_use_channels_last(input, weight)) return at::MemoryFormat::Contiguous;
  return input.dim() == 5 ? at::MemoryFormat::ChannelsLast3d : at::MemoryFormat::ChannelsLast;
}

// `_mkldnn_convolution`: the operands in the kernel's memory format, an empty output resized to
// the output size.
Tensor mkldnn_convolution_meta(const Tensor& input_t, const Tensor& weight_t, const OptTensor& /*bias*/,
                               Ints padding, Ints stride, Ints dilation, c10::SymInt /*groups*/) {
  const auto format = mkldnn_format(input_t, weight_t);
  Tensor input = input_t.contiguous(format);
  Tensor weight = weight_t.contiguous(format);
  auto sizes = at::native::conv_output_size(input.sizes(), weight.sizes(), ints(padding), ints(stride), ints(dilation));
  Tensor output = at::empty({0}, input.options());
  output.resize_(sizes, format);
  return output;
}

// `mkldnn_convolution_backward`: grad_output and input in the kernel's format, grad_input
// (empty, resized), then grad_weight and grad_bias.
std::tuple<Tensor, Tensor, Tensor> mkldnn_backward(const Tensor& input_t, const Tensor& grad_output_t,
                                                   const Tensor& weight, std::array<bool, 3> mask) {
  const auto format = mkldnn_format(input_t, weight);
  Tensor grad_output = grad_output_t.contiguous(format);
  Tensor input = input_t.contiguous(format);
  Tensor grad_input, grad_weight, grad_bias;
  if (mask[0]) {
    grad_input = at::empty({0}, grad_output.options());
    grad_input.resize_(input.sizes(), format);
  }
  if (mask[1] || mask[2]) {
    grad_weight = at::empty(weight.sizes(), grad_output.options().memory_format(format));
    if (mask[2]) grad_bias = at::empty({grad_output.size(1)}, grad_output.options());
  }
  return {grad_input, grad_weight, grad_bias};
}

// The slow path's column buffer (`compute_columns2d`): none for a 1x1 kernel with stride 1 and
// no padding, which reads the input as it is.
void columns2d(const Tensor& input, at::IntArrayRef kernel, at::IntArrayRef stride, at::IntArrayRef padding,
               int64_t out_h, int64_t out_w) {
  const bool identity = kernel[0] == 1 && kernel[1] == 1 && stride[0] == 1 && stride[1] == 1 && padding[0] == 0 &&
                        padding[1] == 0;
  if (!identity) Tensor columns = at::empty({input.size(0), input.size(1) * kernel[0] * kernel[1], out_h * out_w}, input.options());
}

// `convolution_backward` as the CPU runs it: the backend the forward chose, its operands made
// contiguous in the backend's format, then the backend's gradients. Backends with no model here
// allocate the gradients alone.
std::tuple<Tensor, Tensor, Tensor> convolution_backward_meta(const Tensor& grad_output, const Tensor& input,
                                                             const Tensor& weight, at::OptionalSymIntArrayRef bias_sizes,
                                                             Ints stride, Ints padding, Ints dilation, bool transposed,
                                                             Ints output_padding, c10::SymInt groups,
                                                             std::array<bool, 3> mask) {
  using at::native::ConvBackend;
  ConvBackend backend;
  {
    // As the backward sees it: gradients wanted.
    c10::AutoGradMode grad(true);
    backend = at::native::select_conv_backend(input, weight, std::nullopt, stride, padding, dilation, transposed,
                                              output_padding, groups, bias_sizes);
  }
  const auto format = at::native::_determine_backend_memory_format(input, weight, backend);
  if (backend == ConvBackend::Mkldnn) return mkldnn_backward(input.contiguous(format), grad_output, weight, mask);
  Tensor in = input.contiguous(format);
  Tensor w = weight.contiguous(format);
  Tensor grad_input, grad_weight, grad_bias;
  if (backend == ConvBackend::Slow2d && groups == 1) {
    const int64_t out_h = grad_output.size(2), out_w = grad_output.size(3);
    auto k = w.sizes().slice(2);
    auto s = ints(stride), p = ints(padding);
    Tensor go = grad_output.contiguous(format);
    if (mask[0]) {
      grad_input = at::empty_like(in, format);
      columns2d(in, k, s, p, out_h, out_w);
    }
    if (mask[1]) {
      grad_weight = at::empty_like(w, format);
      columns2d(in, k, s, p, out_h, out_w);
    }
    if (mask[2]) grad_bias = at::empty({w.size(0)}, go.options());
    return {grad_input, grad_weight, grad_bias};
  }
  if (mask[0]) grad_input = at::empty_like(in, format);
  if (mask[1]) grad_weight = at::empty_like(w, format);
  if (mask[2]) grad_bias = at::empty({w.size(transposed ? 1 : 0) * (transposed ? groups.expect_int() : 1)}, w.options());
  return {grad_input, grad_weight, grad_bias};
}

// `_slow_conv2d_forward` (`slow_conv2d_forward_out_cpu`): the input contiguous, the output,
// then the column buffer.
Tensor slow_conv2d_forward_meta(const Tensor& self, const Tensor& weight, Ints kernel_size, const OptTensor& /*bias*/,
                                Ints stride, Ints padding) {
  const auto format = at::native::thnn_conv_use_channels_last(self, weight) ? at::MemoryFormat::ChannelsLast
                                                                            : at::MemoryFormat::Contiguous;
  Tensor input = self.contiguous(format);
  auto k = ints(kernel_size), s = ints(stride), p = ints(padding);
  const int64_t out_h = (input.size(2) + 2 * p[0] - k[0]) / s[0] + 1;
  const int64_t out_w = (input.size(3) + 2 * p[1] - k[1]) / s[1] + 1;
  Tensor output = at::empty({0}, self.options());
  output.resize_({input.size(0), weight.size(0), out_h, out_w}, format);
  columns2d(input, k, s, p, out_h, out_w);
  return output;
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  auto own = [&](const char* name, auto&& fn) { ckpt::register_own(m, name, std::forward<decltype(fn)>(fn)); };
  own("mkldnn_convolution", TORCH_FN(mkldnn_convolution_meta));
  own("convolution_backward", TORCH_FN(convolution_backward_meta));
  own("_slow_conv2d_forward", TORCH_FN(slow_conv2d_forward_meta));
}

}  // namespace

namespace ckpt {
int meta_conv_linked() { return 1; }
}  // namespace ckpt
