// What CUDA's reductions take from the caching allocator inside the call, replayed in fake steps
// traced for a GPU. `gpu_reduce_kernel` (ATen/native/cuda/Reduce.cuh) splits a long reduction
// across thread blocks when few outputs have many inputs each (a Linear's bias gradient, a
// norm's weight gradient: `sum` over the batch and sequence) and then allocates a staging
// buffer for the blocks' partial results and a semaphore per output block, both freed when the
// call returns. A 768-wide bias gradient over 8192 rows takes 50,331,648 B on an H200.
//
// The size follows from the TensorIterator the reduction builds (dimensions reordered with the
// reduced ones first, then coalesced) and `setReduceConfig`, which depends on the GPU's
// multiprocessor count and threads per multiprocessor; both are mirrored here. Checked against
// every allocation an H200 made for 395 reductions (kernels/tests/fixtures/reduce_scratch_h200.json,
// kernels/tests/cuda_reductions.rs). `sum` and `mean` (over dimensions or all) are covered;
// reductions that need 64-bit indexing (an operand over 2 GiB) split into sub-iterators that
// are not modelled, nor other reducing operators.
//
// Observed like the learned scratch (`learned_scratch.cpp`): at the end of each matching call on
// a thread in fake mode, the buffer and the semaphores are allocated and freed through the
// meter, in the order the GPU does it.

#include <ATen/record_function.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "meter.h"
#include "shape_code.h"

extern "C" int ckpt_fake_active();

namespace {

std::atomic<int> g_multiprocessors{0};
std::atomic<int> g_threads_per_multiprocessor{0};
at::CallbackHandle g_handle = 0;
std::mutex g_mutex;

int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

int last_pow2(int n) {
  n |= (n >> 1);
  n |= (n >> 2);
  n |= (n >> 4);
  n |= (n >> 8);
  n |= (n >> 16);
  return std::max(1, n - (n >> 1));
}

// The reduction's TensorIterator: shape and byte strides of the output (0 on reduced dimensions)
// and the input, reordered and coalesced as TensorIteratorBase does.
struct Iter {
  std::vector<int64_t> shape;
  std::vector<int64_t> out;
  std::vector<int64_t> in;
};

std::vector<int64_t> contiguous(const std::vector<int64_t>& shape) {
  std::vector<int64_t> st(shape.size());
  int64_t acc = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    st[i] = acc;
    acc *= shape[i];
  }
  return st;
}

// `reorder_dimensions`: reduced dimensions first, then by strides (the output's, then the input's).
void reorder(Iter& it) {
  const size_t n = it.shape.size();
  std::vector<size_t> perm(n);
  std::iota(perm.rbegin(), perm.rend(), 0);
  auto should_swap = [&](size_t d0, size_t d1) {
    for (int arg = 0; arg < 2; ++arg) {
      const auto& st = arg == 0 ? it.out : it.in;
      int64_t s0 = st[d0], s1 = st[d1];
      if (arg == 0 && (s0 == 0) != (s1 == 0)) return s1 == 0 ? 1 : -1;
      if (s0 == 0 || s1 == 0) continue;
      if (s0 < s1) return -1;
      if (s0 > s1) return 1;
      if (it.shape[d0] > it.shape[d1]) return 1;
    }
    return 0;
  };
  for (size_t i = 1; i < n; ++i) {
    size_t d1 = i;
    for (size_t d0 = i; d0-- > 0;) {
      int c = should_swap(perm[d0], perm[d1]);
      if (c > 0) {
        std::swap(perm[d0], perm[d1]);
        d1 = d0;
      } else if (c < 0) {
        break;
      }
    }
  }
  Iter r;
  for (size_t p : perm) {
    r.shape.push_back(it.shape[p]);
    r.out.push_back(it.out[p]);
    r.in.push_back(it.in[p]);
  }
  it = r;
}

// `coalesce_dimensions`: adjacent dimensions one stride apart merge.
void coalesce(Iter& it) {
  const size_t n = it.shape.size();
  if (n <= 1) return;
  size_t prev = 0;
  for (size_t d = 1; d < n; ++d) {
    int64_t s0 = it.shape[prev], s1 = it.shape[d];
    bool can = s0 == 1 || s1 == 1 || (s0 * it.out[prev] == it.out[d] && s0 * it.in[prev] == it.in[d]);
    if (can) {
      if (it.shape[prev] == 1) {
        it.out[prev] = it.out[d];
        it.in[prev] = it.in[d];
      }
      it.shape[prev] *= it.shape[d];
    } else {
      ++prev;
      if (prev != d) {
        it.out[prev] = it.out[d];
        it.in[prev] = it.in[d];
        it.shape[prev] = it.shape[d];
      }
    }
  }
  it.shape.resize(prev + 1);
  it.out.resize(prev + 1);
  it.in.resize(prev + 1);
}

struct Scratch {
  int64_t buffer = 0;
  int64_t semaphores = 0;
};

// `get_output_vec_size`: the widest of 4, 2, 1 that divides the input's element offset, the
// first kept dimension and every other input stride.
int output_vec_size(const Iter& it, int nred, int64_t esize, int64_t offset) {
  int v = 4;
  auto fit = [&v](int64_t x) {
    while (x % v != 0) v /= 2;
  };
  fit(offset);
  fit(it.shape[nred]);
  for (size_t j = 0; j < it.in.size(); ++j) {
    if (static_cast<int>(j) != nred) fit(it.in[j] / esize);
  }
  return v;
}

// `setReduceConfig` and `global_memory_size`/`semaphore_size` for an iterator (vt0 = 4,
// input_vec_size = 4, at most 512 threads), or nothing when no global reduction happens.
std::optional<Scratch> config(const Iter& it, int64_t esize, int64_t arg_size, int64_t offset, int mps, int tpm) {
  const int ndim = static_cast<int>(it.shape.size());
  int64_t numel = 1, num_outputs = 1;
  int nred = 0;
  for (int d = 0; d < ndim; ++d) {
    numel *= it.shape[d];
    if (it.out[d] == 0) ++nred; else num_outputs *= it.shape[d];
  }
  const int64_t inputs_per_output = numel / num_outputs;
  bool fastest = true;
  int64_t dim0 = 1, dim1 = 1, fms = esize;
  if (ndim > 0) {
    fastest = nred == ndim || it.in[0] < it.in[nred];
    dim0 = fastest ? inputs_per_output : num_outputs;
    dim1 = fastest ? num_outputs : inputs_per_output;
    fms = fastest ? it.in[0] : it.in[nred];
  }
  int out_vec = 1;
  if (fms == esize) {
    if (fastest && dim0 > 128 && nred == 1) {
      dim0 /= 4;
    } else if (!fastest) {
      out_vec = output_vec_size(it, nred, esize, offset);
      dim0 /= out_vec;
    }
  }
  const int max_threads = 512 / out_vec;
  int d0 = dim0 < max_threads ? last_pow2(static_cast<int>(dim0)) : max_threads;
  int d1 = dim1 < max_threads ? last_pow2(static_cast<int>(dim1)) : max_threads;
  int width = std::min(d0, 32);
  int height = std::min(d1, max_threads / width);
  width = std::min(d0, max_threads / height);
  const int threads = width * height;
  int64_t step_in = 1, step_out = 1;
  bool x_reduce = false;
  if (ndim == 0 || fastest) {
    x_reduce = true;
    step_in *= width;
  } else {
    step_out *= width;
  }
  auto per_thread = [&] { return div_up(inputs_per_output, step_in); };
  bool y_reduce = per_thread() >= std::min(height * 16, 256);
  if (y_reduce) step_in *= height; else step_out *= height;
  const int64_t target = static_cast<int64_t>(mps) * (tpm / threads);
  const int64_t grid = div_up(num_outputs / out_vec, step_out);
  if (!y_reduce || per_thread() < 256 || grid > target) return std::nullopt;
  int64_t ctas = std::max(std::min(div_up(target, grid), div_up(per_thread(), 16)), div_up(per_thread(), 256));
  if (ctas <= 1) return std::nullopt;
  Scratch s;
  s.buffer = arg_size * num_outputs * ctas * (x_reduce ? 1 : width * out_vec);
  s.semaphores = 4 * grid;
  return s;
}

// The iterator of `self` reduced over `dims` (all when empty), or nothing when it needs 64-bit
// indexing.
std::optional<Iter> iterator(const at::Tensor& self, std::vector<int64_t> dims, int64_t esize, int64_t osize) {
  const auto n = static_cast<int64_t>(self.dim());
  std::vector<int64_t> shape(self.sizes().begin(), self.sizes().end());
  // A 0-d tensor has no dimension to name (its `dim` 0 or -1 is the tensor itself).
  std::vector<bool> reduced(n, dims.empty());
  if (n > 0) {
    for (int64_t d : dims) reduced[((d % n) + n) % n] = true;
  }
  std::vector<int64_t> oshape(shape);
  for (int64_t d = 0; d < n; ++d) if (reduced[d]) oshape[d] = 1;
  auto ost = contiguous(oshape);
  Iter it;
  it.shape = shape;
  int64_t max_in = 0, max_out = 0;
  for (int64_t d = 0; d < n; ++d) {
    it.out.push_back(oshape[d] == 1 && shape[d] != 1 ? 0 : ost[d] * osize);
    it.in.push_back(self.strides()[d] * esize);
    max_in += (shape[d] - 1) * it.in.back();
    max_out += (shape[d] - 1) * it.out.back();
  }
  constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
  if (self.numel() > kMax32 || max_in > kMax32 || max_out > kMax32) return std::nullopt;
  reorder(it);
  coalesce(it);
  return it;
}

// The scratch of one call of `name` (`aten::sum`, `aten::sum.dim_IntList`, `aten::mean`,
// `aten::mean.dim`) with `inputs`, on the configured GPU.
std::optional<Scratch> scratch_of(const std::string& name, c10::ArrayRef<const c10::IValue> inputs) {
  const bool with_dims = name == "aten::sum.dim_IntList" || name == "aten::mean.dim";
  if (inputs.empty() || !inputs[0].isTensor()) return std::nullopt;
  const at::Tensor& self = inputs[0].toTensor();
  if (self.numel() == 0 || !at::isFloatingType(self.scalar_type())) return std::nullopt;
  std::vector<int64_t> dims;
  // `int[1]? dim`: a list (an int list, or a generic one as the CPU's decompositions pass it).
  if (with_dims && inputs.size() > 1 && inputs[1].isList()) {
    for (const auto& d : inputs[1].toListRef()) dims.push_back(d.toInt());
  }
  const size_t dtype_at = with_dims ? 3 : 1;
  at::ScalarType out = self.scalar_type();
  if (inputs.size() > dtype_at && inputs[dtype_at].isInt()) out = static_cast<at::ScalarType>(inputs[dtype_at].toInt());
  const int64_t esize = static_cast<int64_t>(self.element_size());
  const int64_t osize = static_cast<int64_t>(c10::elementSize(out));
  // The accumulation type: float for float, half and bfloat16 inputs, double for double.
  const int64_t arg_size = self.scalar_type() == at::kDouble ? 8 : 4;
  auto it = iterator(self, dims, esize, osize);
  if (!it) return std::nullopt;
  return config(*it, esize, arg_size, self.storage_offset(), g_multiprocessors.load(), g_threads_per_multiprocessor.load());
}

struct Open final : at::ObserverContext {
  explicit Open(std::optional<Scratch> s) : scratch(s) {}
  std::optional<Scratch> scratch;
};

// Reductions open on this thread: a reduction that calls another (the CPU's `sum` over all
// dimensions calls `sum.dim_IntList`, its `mean.dim` calls `sum.IntList_out`) is one kernel on
// the GPU, so only the outermost allocates.
thread_local int t_open = 0;

bool is_reduction(const std::string& name) {
  return name == "aten::sum" || name == "aten::sum.dim_IntList" || name == "aten::mean" || name == "aten::mean.dim";
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (ckpt_fake_active() == 0 || g_multiprocessors.load() == 0) return nullptr;
  const std::string name = ckpt::op_name(fn);
  if (!is_reduction(name)) return nullptr;
  auto open = std::make_unique<Open>(t_open == 0 ? scratch_of(name, fn.inputs()) : std::nullopt);
  ++t_open;
  return open;
}

// Two distinct keys, so that a reader pairs each free with its own allocation.
char g_buffer_key;
char g_semaphores_key;

void on_exit(const at::RecordFunction& /*fn*/, at::ObserverContext* ctx) {
  auto* open = static_cast<Open*>(ctx);
  if (open == nullptr) return;
  --t_open;
  if (!open->scratch) return;
  ckpt::meter_alloc_keyed(open->scratch->buffer, &g_buffer_key);
  ckpt::meter_alloc_keyed(open->scratch->semaphores, &g_semaphores_key);
  ckpt::meter_free_keyed(open->scratch->semaphores, &g_semaphores_key);
  ckpt::meter_free_keyed(open->scratch->buffer, &g_buffer_key);
}

}  // namespace

using ckpt::guarded;

extern "C" {

// The GPU whose reductions fake steps allocate for (`multiprocessors` 0: none, and stop observing).
int ckpt_fake_set_cuda_reductions(int multiprocessors, int threads_per_multiprocessor, char** err) {
  return guarded(err, [&] {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_multiprocessors.store(multiprocessors);
    g_threads_per_multiprocessor.store(threads_per_multiprocessor);
    if (multiprocessors > 0 && g_handle == 0) {
      at::enableRecordFunction(true);
      g_handle = at::addGlobalCallback(
          at::RecordFunctionCallback(&on_enter, &on_exit).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
    } else if (multiprocessors == 0 && g_handle != 0) {
      at::removeCallback(g_handle);
      g_handle = 0;
    }
  });
}

}  // extern "C"
