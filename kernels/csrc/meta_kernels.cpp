// Meta kernels for the operators a training step calls that libtorch has no C++ meta kernel
// for (PyTorch's own are Python registrations, absent from libtorch). Each allocates what the
// CPU kernel allocates — its outputs, and the temporaries a CPU run's meter sees, in the same
// order — so that a step in fake mode (`fake.cpp`) counts the bytes of the same step on the CPU.
// What each CPU kernel allocates was read off a real run operator by operator
// (`runtime/examples/op_bytes.rs`) and follows the kernels in aten/src/ATen/native/.

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <ATen/Parallel.h>
#include <ATen/WrapDimUtils.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include "meta_kernels.h"

#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

bool reduced(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// Whether a reduced-precision input meets float parameters (autocast's case), as the CPU's
// layer and group norms ask (`is_mixed_type`): their statistics are then float.
bool mixed_type(const Tensor& input, const OptTensor& weight, const OptTensor& bias) {
  const auto is_float = [](const OptTensor& t) { return t.has_value() && t->defined() && t->scalar_type() == at::kFloat; };
  return reduced(input.scalar_type()) && (is_float(weight) || is_float(bias));
}

// `index_select`: the output, as the CPU kernel resizes it.
Tensor index_select_meta(const Tensor& self, int64_t dim, const Tensor& index) {
  auto sizes = self.sizes().vec();
  if (self.dim() > 0) sizes[c10::maybe_wrap_dim(dim, self.dim())] = index.numel();
  return at::empty(sizes, self.options());
}

// `where.self_out` (`where_self_out`): the operands promoted to the result type where they
// differ (a Python number is a CPU scalar of its own type), a byte condition made bool, then the
// output resized to the broadcast shape (no allocation when it has it: `_safe_softmax`, the
// softmax of SDPA's math path, writes its result in place this way).
Tensor& where_self_out_meta(const Tensor& condition, const Tensor& self, const Tensor& other, Tensor& out) {
  const auto result_type = at::result_type(self, other);
  Tensor self_ = self.scalar_type() != result_type ? self.to(result_type) : self;
  Tensor other_ = other.scalar_type() != result_type ? other.to(result_type) : other;
  Tensor condition_ = condition.scalar_type() == at::kByte ? condition.to(at::kBool) : condition;
  const auto shape = at::infer_size(condition_.sizes(), at::infer_size(self_.sizes(), other_.sizes()));
  if (out.sizes() != c10::IntArrayRef(shape)) out.resize_(shape);
  return out;
}

// `where.self`: an empty output of the result type, then `where.self_out`.
Tensor where_self_meta(const Tensor& condition, const Tensor& self, const Tensor& other) {
  Tensor out = at::empty({0}, self.options().dtype(at::result_type(self, other)));
  where_self_out_meta(condition, self, other, out);
  return out;
}

// `layer_norm_cpu`: the input made contiguous if it is not, the output, then the mean and rstd
// per row in the parameters' dtype when a reduced-precision input meets float parameters.
std::tuple<Tensor, Tensor, Tensor> native_layer_norm_meta(const Tensor& input, c10::SymIntArrayRef normalized_shape,
                                                          const OptTensor& weight, const OptTensor& bias,
                                                          double /*eps*/) {
  const int64_t axis = input.dim() - static_cast<int64_t>(normalized_shape.size());
  int64_t M = 1;
  for (int64_t i = 0; i < axis; ++i) M *= input.size(i);
  const bool mixed = mixed_type(input, weight, bias);
  Tensor X = input.contiguous();
  Tensor Y = at::empty_like(X, at::MemoryFormat::Contiguous);
  const auto stats = X.options().dtype(mixed ? at::kFloat : input.scalar_type());
  Tensor mean = at::empty({M}, stats);
  Tensor rstd = at::empty({M}, stats);
  std::vector<int64_t> stat_shape(input.sizes().begin(), input.sizes().begin() + axis);
  stat_shape.resize(input.dim(), 1);
  return {Y, mean.view(stat_shape), rstd.view(stat_shape)};
}

// `embedding_dense_backward_cpu`: the gradient table (zeros), then contiguous copies of the
// indices and the gradient where they are strided (an expanded `token_type_ids`).
Tensor embedding_dense_backward_meta(const Tensor& grad, const Tensor& indices, c10::SymInt num_weights,
                                     c10::SymInt /*padding_idx*/, bool /*scale_grad_by_freq*/) {
  Tensor grad_weight = at::zeros({num_weights.expect_int(), grad.size(-1)}, grad.options());
  Tensor indices_contig = indices.contiguous();
  Tensor grad_contig = grad.contiguous();
  return grad_weight;
}

// `layer_norm_backward_cpu`: dX, dgamma, dbeta, and the kernel's per-thread buffer of
// `[threads, 2N]` in the input's dtype while it reduces dgamma and dbeta.
std::tuple<Tensor, Tensor, Tensor> native_layer_norm_backward_meta(const Tensor& dY, const Tensor& input,
                                                                  c10::SymIntArrayRef normalized_shape,
                                                                  const Tensor& /*mean*/, const Tensor& /*rstd*/,
                                                                  const OptTensor& weight, const OptTensor& bias,
                                                                  std::array<bool, 3> mask) {
  int64_t N = 1;
  for (const auto& s : normalized_shape) N *= s.expect_int();
  const int64_t M = N == 0 ? 0 : input.numel() / N;
  Tensor X = input.contiguous();
  Tensor dX, dgamma, dbeta;
  if (mask[0]) dX = at::empty_like(X, at::MemoryFormat::Contiguous);
  if (mask[1] && weight.has_value()) dgamma = at::empty_like(weight->contiguous(), at::MemoryFormat::Contiguous);
  if (mask[2] && bias.has_value()) dbeta = at::empty_like(bias->contiguous(), at::MemoryFormat::Contiguous);
  if (M > 0 && N > 0 && (dgamma.defined() || dbeta.defined())) {
    Tensor dY_contig = dY.contiguous();
    Tensor buffer = at::zeros({at::get_num_threads(), 2 * N}, X.options());
  }
  return {dX, dgamma, dbeta};
}

// The dtype batch norm keeps its statistics in: the parameters' (float when a reduced-precision
// input meets float parameters, autocast's case), else the input's.
at::ScalarType stat_dtype(const Tensor& input, const OptTensor& weight) {
  bool mixed = reduced(input.scalar_type()) && weight.has_value() && weight->scalar_type() == at::kFloat;
  return mixed ? at::kFloat : input.scalar_type();
}

// Whether the CPU kernels take their channels-last path: channels-last input, or one whose
// image is a single pixel (NC11 is channels-last too).
bool channels_last_path(const Tensor& input) {
  int64_t image = input.dim() > 2 ? input.numel() / input.size(0) / input.size(1) : 1;
  return input.suggest_memory_format() == at::MemoryFormat::ChannelsLast || image == 1;
}

// `batch_norm_cpu` in training: the output, save_mean and save_invstd; while the statistics are
// collected, the mean and variance sums (and in the channels-last path a per-thread buffer);
// then while the output is written, the per-channel linear and constant terms.
std::tuple<Tensor, Tensor, Tensor> native_batch_norm_meta(const Tensor& input, const OptTensor& weight,
                                                          const OptTensor& /*bias*/, const OptTensor& running_mean,
                                                          const OptTensor& /*running_var*/, bool training,
                                                          double /*momentum*/, double /*eps*/) {
  const int64_t C = input.size(1);
  const auto stats = input.options().dtype(stat_dtype(input, weight));
  Tensor output = at::empty_like(input, input.suggest_memory_format());
  if (!training) {
    Tensor alpha = at::empty({C}, input.options().dtype(at::kFloat));
    Tensor beta = at::empty({C}, input.options().dtype(at::kFloat));
    return {output, at::empty({0}, stats), at::empty({0}, stats)};
  }
  Tensor save_mean = at::empty({C}, stats);
  Tensor save_invstd = at::empty({C}, stats);
  {
    Tensor mean = at::empty({C}, stats);
    Tensor var_sum = at::empty({C}, stats);
    const int64_t threads = at::get_num_threads();
    if (channels_last_path(input) && input.numel() / C > threads) {
      Tensor buffer = at::zeros({threads, C}, input.options().dtype(at::kFloat));
    } else if (reduced(input.scalar_type()) && !reduced(stats.dtype().toScalarType())) {
      // nothing more: the mixed-type contiguous path reduces into the float sums
    }
  }
  {
    Tensor alpha = at::empty({C}, input.options().dtype(at::kFloat));
    Tensor beta = at::empty({C}, input.options().dtype(at::kFloat));
  }
  (void)running_mean;
  return {output, save_mean, save_invstd};
}

// `batch_norm_backward_cpu` in training: grad_input, grad_weight, grad_bias, then what its
// kernel allocates. The channels-last kernel (channels-last input, or a single-pixel image: NC11
// is channels-last too) reduces into a zeroed buffer of {2, threads, C} (float for a reduced-
// precision input, which also gets float copies of weight, mean and invstd); the contiguous one
// an input-sized temporary while the gradient is reduced.
std::tuple<Tensor, Tensor, Tensor> native_batch_norm_backward_meta(
    const Tensor& grad_out, const Tensor& input, const OptTensor& weight, const OptTensor& /*running_mean*/,
    const OptTensor& /*running_var*/, const OptTensor& /*save_mean*/, const OptTensor& /*save_invstd*/,
    bool train, double /*eps*/, std::array<bool, 3> mask) {
  const int64_t C = input.size(1);
  const auto params = input.options().dtype(stat_dtype(input, weight));
  Tensor grad_input, grad_weight, grad_bias;
  if (mask[0]) grad_input = at::empty_like(input, input.suggest_memory_format());
  if (mask[1]) grad_weight = at::empty({C}, params);
  if (mask[2]) grad_bias = at::empty({C}, params);
  if (channels_last_path(input)) {
    const bool reduce = reduced(input.scalar_type());
    const auto acc = input.options().dtype(reduce ? at::kFloat : input.scalar_type());
    std::vector<Tensor> per_channel;
    if (reduce) {
      for (int i = 0; i < 3; ++i) per_channel.push_back(at::empty({C}, acc));  // weight, mean, invstd
    } else {
      if (!(weight.has_value() && weight->defined())) per_channel.push_back(at::empty({C}, acc));
      if (!train) per_channel.push_back(at::empty({C}, acc));
    }
    Tensor buffer = at::empty({2, at::get_num_threads(), C}, acc);
  } else {
    Tensor scratch = at::empty_like(grad_out, input.suggest_memory_format());
  }
  return {grad_input, grad_weight, grad_bias};
}

// Fused optimizers update their tensors in place and allocate nothing.
void in_place_only(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  torch::jit::drop(*stack, op.schema().arguments().size());
}

// `native_dropout` as CUDA's fused kernel allocates (a step traced for a GPU calls it where the
// CPU would draw its mask with bernoulli_): the output, then a bool mask, both shaped as the
// input (`dropout_cuda`). Outside training it returns the input and an all-true mask.
std::tuple<at::Tensor, at::Tensor> native_dropout_meta(const at::Tensor& input, double /*p*/,
                                                       std::optional<bool> train) {
  if (train.has_value() && !*train) {
    return {input.clone(), at::empty_like(input, input.options().dtype(at::kBool))};
  }
  at::Tensor output = at::empty_like(input);
  at::Tensor mask = at::empty_like(input, input.options().dtype(at::kBool));
  return {output, mask};
}

// `native_dropout_backward`: one gradient shaped as the incoming one (CUDA's fused kernel).
at::Tensor native_dropout_backward_meta(const at::Tensor& grad, const at::Tensor& /*mask*/, double /*scale*/) {
  return at::empty_like(grad);
}

// `roll` (`roll_cpu`, TensorTransformations.cpp): along one dimension the two slices
// concatenated, along several one dimension at a time (each roll a tensor of its own, as
// `roll_common` makes them; Swin's shifted windows roll two).
Tensor roll_meta(const Tensor& self, c10::SymIntArrayRef shifts_sym, at::IntArrayRef dims) {
  const auto shifts = C10_AS_INTARRAYREF_SLOW(shifts_sym);
  TORCH_CHECK(!shifts.empty(), "`shifts` required");
  if (dims.empty() && shifts.size() == 1) {
    return at::roll(self.contiguous().view(self.numel()), shifts[0], 0).view(self.sizes());
  }
  TORCH_CHECK(shifts.size() == dims.size(), "shifts and dimensions must align. shifts: ", shifts.size(),
              ", dims:", dims.size());
  if (dims.size() > 1) return at::roll(at::roll(self, shifts[0], dims[0]), shifts.slice(1), dims.slice(1));
  if (self.numel() == 0) return self.clone(at::MemoryFormat::Preserve);
  const int64_t dim = c10::maybe_wrap_dim(dims[0], self.dim());
  const int64_t size = self.size(dim);
  int64_t start = (size - shifts[0]) % size;
  if (start < 0) start += size;
  return at::cat({self.narrow(dim, start, size - start), self.narrow(dim, 0, start)}, dim);
}

// `_adaptive_avg_pool2d` (AdaptiveAveragePooling.cpp, AdaptiveAvgPoolKernel.cpp): the output
// resized in the input's suggested memory format, then the kernel's contiguous copy of the input
// in that format (none where it already is: VGG's and AlexNet's `avgpool`). The kernel's copy
// of the output is never made: the output was just laid out in that format.
Tensor adaptive_avg_pool2d_meta(const Tensor& input, c10::SymIntArrayRef output_size) {
  TORCH_CHECK(output_size.size() == 2, "adaptive_avg_pool2d: output_size must be 2");
  TORCH_CHECK(input.dim() == 3 || input.dim() == 4, "adaptive_avg_pool2d(): Expected 3D or 4D tensor, but got ",
              input.sizes());
  const auto format = input.suggest_memory_format();
  const int64_t oh = output_size[0].guard_int(__FILE__, __LINE__);
  const int64_t ow = output_size[1].guard_int(__FILE__, __LINE__);
  Tensor output = at::empty({0}, input.options());
  if (input.dim() == 3) {
    output.resize_({input.size(0), oh, ow});
  } else {
    output.resize_({input.size(0), input.size(1), oh, ow}, format);
  }
  if (output.numel() == 0) return output;
  const Tensor in = input.contiguous(format);
  return output;
}

// `_adaptive_avg_pool2d_backward`: the input's gradient resized as the input in its suggested
// format (then zeroed), and the kernel's contiguous copies of both gradients in the incoming
// gradient's suggested format.
Tensor adaptive_avg_pool2d_backward_meta(const Tensor& grad_output, const Tensor& input) {
  Tensor grad_input = at::empty({0}, input.options());
  grad_input.resize_(input.sizes(), input.suggest_memory_format());
  const auto format = grad_output.suggest_memory_format();
  const Tensor g = grad_output.contiguous(format);
  const Tensor gi = grad_input.contiguous(format);
  return grad_input;
}

// `repeat` (TensorShape.cpp): the result, written through an unfolded alias of itself from the
// expanded input, then (unless a repeat is 0) the dimension order that views it back, made from
// index tensors: `arange(D)`, it plus `D`, and their `[D, 2]` concatenation, alive together.
// The CompositeExplicitAutograd kernel would run on meta but reads the alias's storage.
Tensor repeat_meta(const Tensor& self, c10::SymIntArrayRef repeats_sym) {
  const auto repeats = C10_AS_INTARRAYREF_SLOW(repeats_sym);
  TORCH_CHECK(repeats.size() >= static_cast<size_t>(self.dim()),
              "Number of dimensions of repeat dims can not be smaller than number of dimensions of tensor");
  const auto D = static_cast<int64_t>(repeats.size());
  const int64_t pad = D - self.dim();
  std::vector<int64_t> target(repeats.size());
  bool zero = false;
  for (int64_t i = 0; i < D; ++i) {
    TORCH_CHECK(repeats[i] >= 0, "Trying to create tensor with negative dimension ", repeats[i]);
    target[i] = repeats[i] * (i < pad ? 1 : self.size(i - pad));
    zero = zero || repeats[i] == 0;
  }
  Tensor result = at::empty(target, self.options());
  if (zero) return result;
  const Tensor first = at::arange(D, self.options().dtype(at::kLong));
  const Tensor second = first.add(D);
  const Tensor order = at::cat({first.unsqueeze(1), second.unsqueeze(1)}, 1);
  return result;
}

// `native_group_norm` (group_norm.cpp, contiguous kernel of group_norm_kernel.cpp): the input
// made contiguous if it is not, the output, then the mean and reciprocal deviation per group in
// the parameters' dtype when a reduced-precision input meets float parameters. Without this
// kernel the meta device runs `math_group_norm`, a decomposition the CPU never runs. The
// channels-last kernel allocates per-thread buffers by a rule of its own: not modelled, refused.
std::tuple<Tensor, Tensor, Tensor> native_group_norm_meta(const Tensor& X, const OptTensor& gamma,
                                                          const OptTensor& beta, c10::SymInt N, c10::SymInt /*C*/,
                                                          c10::SymInt /*HxW*/, int64_t group, double /*eps*/) {
  const auto format = X.suggest_memory_format();
  TORCH_CHECK(format == at::MemoryFormat::Contiguous,
              "aten::native_group_norm: attempted to run this operator with Meta tensors on a channels-last input, "
              "whose CPU kernel's buffers ckptune's meta kernel does not model");
  const bool mixed = mixed_type(X, gamma, beta);
  const auto stats = X.options().dtype(mixed ? at::kFloat : X.scalar_type());
  const int64_t n = N.expect_int();
  Tensor X_ = X.contiguous(format);
  Tensor Y = at::empty_like(X_);
  Tensor mean = at::empty({n, group}, stats);
  Tensor rstd = at::empty({n, group}, stats);
  return {Y, mean, rstd};
}

// `native_group_norm_backward`: contiguous copies of dY and X where they are strided, the
// gradients asked for (dgamma and dbeta in the weight's dtype), then the kernel's float sums
// `ds` and `db` of `[N, C]` while it works.
std::tuple<Tensor, Tensor, Tensor> native_group_norm_backward_meta(const Tensor& dY, const Tensor& X,
                                                                   const Tensor& /*mean*/, const Tensor& /*rstd*/,
                                                                   const OptTensor& gamma, c10::SymInt N,
                                                                   c10::SymInt C, c10::SymInt /*HxW*/,
                                                                   int64_t /*group*/, std::array<bool, 3> mask) {
  const auto format = X.suggest_memory_format();
  TORCH_CHECK(format == at::MemoryFormat::Contiguous,
              "aten::native_group_norm_backward: attempted to run this operator with Meta tensors on a channels-last "
              "input, whose CPU kernel's buffers ckptune's meta kernel does not model");
  const bool has_gamma = gamma.has_value() && gamma->defined();
  const auto params = has_gamma ? gamma->options() : X.options();
  const int64_t n = N.expect_int();
  const int64_t c = C.expect_int();
  Tensor dY_ = dY.contiguous(format);
  Tensor X_ = X.contiguous(format);
  Tensor dX, dgamma, dbeta;
  if (mask[0]) dX = at::empty_like(X_);
  if (mask[1]) dgamma = at::empty({c}, params);
  if (mask[2]) dbeta = at::empty({c}, params);
  if (X.numel() > 0) {
    Tensor ds = at::empty({n, c}, X.options().dtype(at::kFloat));
    Tensor db = at::empty({n, c}, X.options().dtype(at::kFloat));
  }
  return {dX, dgamma, dbeta};
}

// `_weight_norm_interface` (WeightNorm.cpp, WeightNormKernel.cpp): the weight, contiguous, and
// the norms shaped as `g` (float for a bf16 `g`); along the last dimension the kernel also sums
// into a per-thread buffer of `[threads, N]` (wav2vec2's positional convolution, `dim=2`).
std::tuple<Tensor, Tensor> weight_norm_interface_meta(const Tensor& v, const Tensor& g, int64_t dim) {
  TORCH_CHECK(dim == 0 || dim == v.dim() - 1, "fused kernels can only be applied for first or last dim");
  Tensor w = at::empty_like(v, at::MemoryFormat::Contiguous);
  const auto norm_dtype = g.scalar_type() == at::kBFloat16 ? at::kFloat : g.scalar_type();
  Tensor norm = at::empty_strided(g.sizes(), g.strides(), g.options().dtype(norm_dtype));
  if (dim != 0) Tensor buffer = at::empty({at::get_num_threads(), v.size(-1)}, norm.options());
  return {w, norm};
}

// `_weight_norm_interface_backward`: the gradients of `v` and `g`, contiguous; along the last
// dimension the kernel's buffer of `[max(3, threads), N]` (its sums, then two coefficients).
std::tuple<Tensor, Tensor> weight_norm_interface_backward_meta(const Tensor& /*grad_w*/, const Tensor& saved_v,
                                                               const Tensor& saved_g, const Tensor& saved_norms,
                                                               int64_t dim) {
  TORCH_CHECK(dim == 0 || dim == saved_v.dim() - 1, "fused kernels can only be applied for first or last dim");
  Tensor grad_v = at::empty_like(saved_v, at::MemoryFormat::Contiguous);
  Tensor grad_g = at::empty_like(saved_g, at::MemoryFormat::Contiguous);
  if (dim != 0) {
    const int64_t rows = std::max<int64_t>(3, at::get_num_threads());
    Tensor buffer = at::empty({rows, saved_v.size(-1)}, saved_norms.options());
  }
  return {grad_v, grad_g};
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  auto own = [&](const char* name, auto&& fn) { ckpt::register_own(m, name, std::forward<decltype(fn)>(fn)); };
  own("index_select", TORCH_FN(index_select_meta));
  own("where.self", TORCH_FN(where_self_meta));
  own("native_dropout", TORCH_FN(native_dropout_meta));
  own("native_dropout_backward", TORCH_FN(native_dropout_backward_meta));
  own("where.self_out", TORCH_FN(where_self_out_meta));
  own("embedding_dense_backward", TORCH_FN(embedding_dense_backward_meta));
  own("native_layer_norm", TORCH_FN(native_layer_norm_meta));
  own("native_layer_norm_backward", TORCH_FN(native_layer_norm_backward_meta));
  own("native_batch_norm", TORCH_FN(native_batch_norm_meta));
  own("native_batch_norm_backward", TORCH_FN(native_batch_norm_backward_meta));
  own("roll", TORCH_FN(roll_meta));
  own("_adaptive_avg_pool2d", TORCH_FN(adaptive_avg_pool2d_meta));
  own("_adaptive_avg_pool2d_backward", TORCH_FN(adaptive_avg_pool2d_backward_meta));
  own("repeat", TORCH_FN(repeat_meta));
  own("native_group_norm", TORCH_FN(native_group_norm_meta));
  own("native_group_norm_backward", TORCH_FN(native_group_norm_backward_meta));
  own("_weight_norm_interface", TORCH_FN(weight_norm_interface_meta));
  own("_weight_norm_interface_backward", TORCH_FN(weight_norm_interface_backward_meta));
  for (const char* op : {"_fused_adamw_", "_fused_adamw_.tensor_lr", "_fused_adam_", "_fused_adam_.tensor_lr",
                         "_fused_sgd_", "_fused_sgd_.tensor_lr"})
    own(op, torch::CppFunction::makeFromBoxedFunction<&in_place_only>());
}

}  // namespace

namespace ckpt {

namespace {
std::unordered_set<std::string>& own_kernels() {
  static std::unordered_set<std::string> names;
  return names;
}
}  // namespace

bool own_meta_kernel(const std::string& name) { return own_kernels().count(name) != 0; }
void note_own_meta_kernel(const std::string& name) { own_kernels().insert(name); }
int meta_kernels_linked() { return meta_conv_linked() + meta_elementwise_linked() + meta_attention_linked(); }

}  // namespace ckpt
