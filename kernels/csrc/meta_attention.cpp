// Meta kernels for the CPU's flash attention, which `scaled_dot_product_attention` runs on the
// CPU when there is no dropout (fake tensors report the CPU, so libtorch's backend choice is the
// CPU's). libtorch has no meta kernel for either direction. Each allocates what the CPU kernel
// allocates, in its order: the outputs, then the kernel's contiguous copies, its per-thread
// buffers in the accumulation type and, for bf16 and fp16, in the input's type, and the packed
// keys and values it makes for oneDNN's brgemm where it packs.
// (aten/src/ATen/native/transformers/attention.cpp, aten/src/ATen/native/cpu/FlashAttentionKernel.cpp)
//
// And for CUDA's memory-efficient attention, which a model traced for a GPU calls (models/src/
// sdpa.rs): what it allocated on an H200 (torch 2.11), recorded by the allocator's history
// (scripts/gpu_attention_probe.py wrote kernels/tests/fixtures/efficient_attention_h200.json).

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "meta_kernels.h"

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

bool reduced(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The kernels' blocks: query rows per block by the query length, at most 512 keys per block.
struct Blocks {
  int64_t q_split;
  int64_t kv_split;
};

Blocks blocks(int64_t q_size, int64_t kv_size) {
  const int64_t q = q_size >= 768 ? 256 : q_size >= 192 ? 64 : 32;
  return {std::min(q, q_size), std::min<int64_t>(512, kv_size)};
}

// A tensor in the kernels' [batch, seq, heads, dim] layout: as it is where its last dimension is
// dense, else the contiguous copy the kernels make.
Tensor last_dim_dense(const Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// `reshape_attn_mask_to_4d`: the mask broadcast to [batch or 1, heads or 1, q, kv], copied only
// where its last dimension is strided. The kernels hold the result until they return.
OptTensor mask_4d(const OptTensor& attn_mask, int64_t batch, int64_t heads, int64_t q_size, int64_t kv_size) {
  if (!attn_mask.has_value() || attn_mask->numel() == 0) return std::nullopt;
  const Tensor& m = *attn_mask;
  const int64_t b = m.dim() == 4 && m.size(0) == batch ? batch : 1;
  const int64_t h = m.dim() == 4 && m.size(1) == heads ? heads : 1;
  Tensor out = m.view({b, h, m.size(-2), m.size(-1)}).expand({b, h, q_size, kv_size});
  if (out.stride(-1) != 1 && out.stride(-1) != 0) out = out.contiguous();
  return out;
}

// Whether the forward packs keys and values for brgemm (`need_pack`): bf16 or fp16 on a CPU
// oneDNN packs for, sequences long enough, and enough products per thread to repay the packing.
bool needs_pack(at::ScalarType dtype, int64_t batch, int64_t heads, int64_t kv_heads, int64_t q_size, int64_t kv_size,
                int64_t head_size, const Blocks& b, bool is_causal) {
  if (!reduced(dtype) || !at::native::cpublas::could_pack(dtype)) return false;
  const int64_t thresh = dtype == at::kBFloat16 ? 64 : 16;
  if (kv_size < thresh || q_size < thresh) return false;
  const int64_t threads = at::get_num_threads();
  const int64_t q_slice = (q_size + b.q_split - 1) / b.q_split;
  const double pack_size = static_cast<double>(batch * kv_heads * kv_size * head_size);
  const double qs_per_thread = static_cast<double>((batch * heads * q_slice + threads - 1) / threads);
  const double gemm_per_thread =
      qs_per_thread * b.q_split * (is_causal ? std::min(q_size, kv_size) : kv_size) * head_size;
  return gemm_per_thread / pack_size >= (dtype == at::kBFloat16 ? 4 : 1);
}

// `cpu_flash_attention`'s allocations on [batch, seq, heads, dim] views, all freed when it returns
// except the packing transpose buffer, freed once the keys and values are packed.
void forward_scratch(const Tensor& q, const Tensor& k, const Tensor& v, const OptTensor& attn_mask, bool is_causal) {
  const Tensor query = last_dim_dense(q.transpose(1, 2));
  const Tensor key = last_dim_dense(k.transpose(1, 2));
  const Tensor value = last_dim_dense(v.transpose(1, 2));
  const int64_t batch = query.size(0), q_size = query.size(1), kv_size = value.size(1);
  const int64_t heads = query.size(2), kv_heads = key.size(2), head_size = query.size(3);
  const OptTensor mask = mask_4d(attn_mask, batch, heads, q_size, kv_size);
  const Blocks b = blocks(q_size, kv_size);
  const auto dtype = query.scalar_type();
  const bool pack = needs_pack(dtype, batch, heads, kv_heads, q_size, kv_size, head_size, b, is_causal);
  const int64_t kv_tail = (kv_size - 1) % b.kv_split + 1;
  const int64_t e_head = pack && head_size % 2 != 0 ? head_size + 1 : head_size;
  const int64_t e_kv_split = pack && b.kv_split % 2 != 0 ? b.kv_split + 1 : b.kv_split;
  const int64_t e_kv_tail = pack && kv_tail % 2 != 0 ? kv_tail + 1 : kv_tail;
  const int64_t threads = at::get_num_threads();
  const int64_t per_thread = b.q_split * b.kv_split + 2 * b.q_split + b.q_split * head_size;
  Tensor buf = at::empty({threads, per_thread}, query.options().dtype(at::toOpMathType(dtype)));
  Tensor buf_reduced = at::empty({threads, b.q_split, reduced(dtype) ? e_kv_split : 0}, query.options());
  Tensor key_reorder, value_reorder, query_padding;
  if (pack) {
    const int64_t kv_padding = (kv_size - 1) / b.kv_split * e_kv_split + e_kv_tail;
    key_reorder = at::empty({batch, kv_heads, e_head, kv_size}, query.options());
    value_reorder = at::empty({batch, kv_heads, kv_padding, head_size}, query.options());
  }
  if (pack && head_size % 2 != 0) query_padding = at::empty({threads, b.q_split, e_head}, query.options());
  if (pack) Tensor transpose = at::empty({threads, b.kv_split, head_size}, query.options());
}

// `_scaled_dot_product_flash_attention_cpu`: the output (laid out as the query is, returned as
// [batch, heads, seq, dim] over [batch, seq, heads, dim] storage) and the log-sum-exp in the
// accumulation type, then the kernel's scratch.
std::tuple<Tensor, Tensor> flash_attention_meta(const Tensor& query, const Tensor& key, const Tensor& value,
                                                double /*dropout_p*/, bool is_causal, const OptTensor& attn_mask,
                                                std::optional<double> /*scale*/) {
  const auto dtype = query.scalar_type();
  Tensor output = at::empty_like(query, query.options()).transpose(1, 2);
  Tensor logsumexp =
      at::empty({query.size(0), query.size(2), query.size(1)}, query.options().dtype(at::toOpMathType(dtype)));
  forward_scratch(query, key, value, attn_mask, is_causal);
  return {output.transpose(1, 2), logsumexp.transpose(1, 2)};
}

// `flash_attention_backward_kernel_impl` and `cpu_flash_attention_backward`: the incoming
// gradient made contiguous, copies of operands with a strided last dimension, the mask, the
// per-thread buffers, and a row-sum buffer each worker thread holds while it runs.
void backward_scratch(const Tensor& grad_out_t, const Tensor& q_t, const Tensor& k_t, const Tensor& v_t,
                      const OptTensor& attn_mask) {
  const Tensor grad_out = grad_out_t.contiguous();
  const Tensor query = last_dim_dense(q_t);
  const Tensor key = last_dim_dense(k_t);
  const Tensor value = last_dim_dense(v_t);
  const int64_t batch = query.size(0), q_size = query.size(1), kv_size = value.size(1);
  const int64_t heads = query.size(2), kv_heads = key.size(2);
  const OptTensor mask = mask_4d(attn_mask, batch, heads, q_size, kv_size);
  const Blocks b = blocks(q_size, kv_size);
  const auto dtype = query.scalar_type();
  const auto accumulate = query.options().dtype(at::toOpMathType(dtype));
  const int64_t threads = at::get_num_threads();
  const int64_t per_thread = 2 * b.q_split * b.kv_split;
  Tensor buf = at::empty({threads, per_thread}, accumulate);
  Tensor buf_reduced = at::empty({threads, reduced(dtype) ? per_thread : 0}, query.options());
  // at::parallel_for over batch x key/value heads, one task per thread with work: each makes
  // its row sums as it starts and frees them when done, so they are alive together.
  const int64_t range = batch * kv_heads;
  int64_t workers = range > 0 ? 1 : 0;
  if (range > 1 && threads > 1 && !at::in_parallel_region()) {
    const int64_t chunk = (range + std::min(threads, range) - 1) / std::min(threads, range);
    workers = (range + chunk - 1) / chunk;
  }
  std::vector<Tensor> dsum;
  for (int64_t w = 0; w < workers; ++w) dsum.push_back(at::empty({b.q_split}, accumulate));
}

// `_scaled_dot_product_flash_attention_cpu_backward`: zeroed gradients in [batch, seq, heads,
// dim] layout, then the kernel's scratch; the gradients are returned as [batch, heads, seq, dim].
std::tuple<Tensor, Tensor, Tensor> flash_attention_backward_meta(const Tensor& grad_out, const Tensor& query,
                                                                 const Tensor& key, const Tensor& value,
                                                                 const Tensor& /*out*/, const Tensor& /*logsumexp*/,
                                                                 double /*dropout_p*/, bool /*is_causal*/,
                                                                 const OptTensor& attn_mask,
                                                                 std::optional<double> /*scale*/) {
  if (!grad_out.defined()) return {Tensor(), Tensor(), Tensor()};
  const Tensor q_t = query.transpose(1, 2), k_t = key.transpose(1, 2), v_t = value.transpose(1, 2);
  Tensor grad_q = at::zeros(q_t.sizes(), query.options());
  Tensor grad_k = at::zeros(k_t.sizes(), key.options());
  Tensor grad_v = at::zeros(v_t.sizes(), value.options());
  backward_scratch(grad_out.transpose(1, 2), q_t, k_t, v_t, attn_mask);
  return {grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2)};
}

// `_scaled_dot_product_efficient_attention` on CUDA: the output in [batch, seq, heads, dim]
// layout, returned as [batch, heads, seq, dim], and the log-sum-exp in f32 with the query length
// rounded up to 32 (none when no gradient is needed). The philox seed and offset are CPU tensors
// there, no GPU bytes: they are left undefined here.
std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_attention_meta(const Tensor& query, const Tensor& key,
                                                                    const Tensor& value, const OptTensor& /*bias*/,
                                                                    bool compute_log_sumexp, double /*dropout_p*/,
                                                                    bool /*is_causal*/, std::optional<double> /*scale*/) {
  const int64_t batch = query.size(0), heads = query.size(1), q_size = query.size(2);
  Tensor output = at::empty({batch, q_size, heads, value.size(3)}, query.options());
  const int64_t lse_size = compute_log_sumexp ? (q_size + 31) / 32 * 32 : 0;
  Tensor logsumexp = at::empty({batch, heads, lse_size}, query.options().dtype(at::kFloat));
  return {output.transpose(1, 2), logsumexp, Tensor(), Tensor()};
}

// A gradient laid out as its input is (PyTorch's `empty_strided` of the input), or contiguous
// where the input's strides overlap (a broadcast).
Tensor grad_like(const Tensor& t) {
  return t.is_non_overlapping_and_dense() ? at::empty_strided(t.sizes(), t.strides(), t.options())
                                          : at::empty(t.sizes(), t.options());
}

// `_scaled_dot_product_efficient_attention_backward` on CUDA, as the H200 allocated it: the three
// gradients, an output-sized buffer and two f32 [batch, heads, q] rows, one of those freed with
// the buffer before the kernel's f32 workspace (per batch and head, 64 x 64 gradient tiles of the
// query, each with 16 bytes of counter, by 64-row block of queries and 64-column block of the
// head dimension), then the rest freed. A bias that needs a gradient gets one of its shape.
std::tuple<Tensor, Tensor, Tensor, Tensor> efficient_attention_backward_meta(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& attn_bias,
    const Tensor& out, const Tensor& /*logsumexp*/, const Tensor& /*philox_seed*/, const Tensor& /*philox_offset*/,
    double /*dropout_p*/, std::array<bool, 4> grad_input_mask, bool /*is_causal*/, std::optional<double> /*scale*/) {
  if (!grad_out.defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
  const int64_t batch = query.size(0), heads = query.size(1), q_size = query.size(2), dim = query.size(3);
  Tensor grad_q = grad_like(query), grad_k = grad_like(key), grad_v = grad_like(value);
  {
    Tensor buffer = at::empty({batch, q_size, heads, out.size(3)}, query.options());
    Tensor first = at::empty({batch, heads, q_size}, query.options().dtype(at::kFloat));
    Tensor second = at::empty({batch, heads, q_size}, query.options().dtype(at::kFloat));
    first.reset();
    buffer.reset();
    const int64_t tiles = (q_size + 63) / 64 * ((dim + 63) / 64);
    Tensor workspace = at::empty({batch * heads * tiles * (64 * 64 + 4)}, query.options().dtype(at::kFloat));
    second.reset();
  }
  Tensor grad_bias;
  if (grad_input_mask[3] && attn_bias.defined()) grad_bias = at::empty(attn_bias.sizes(), attn_bias.options());
  return {grad_q, grad_k, grad_v, grad_bias};
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  auto own = [&](const char* name, auto&& fn) { ckpt::register_own(m, name, std::forward<decltype(fn)>(fn)); };
  own("_scaled_dot_product_flash_attention_for_cpu", TORCH_FN(flash_attention_meta));
  own("_scaled_dot_product_flash_attention_for_cpu_backward", TORCH_FN(flash_attention_backward_meta));
  own("_scaled_dot_product_efficient_attention", TORCH_FN(efficient_attention_meta));
  own("_scaled_dot_product_efficient_attention_backward", TORCH_FN(efficient_attention_backward_meta));
}

}  // namespace

namespace ckpt {
int meta_attention_linked() { return 1; }
}  // namespace ckpt
