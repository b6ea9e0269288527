// The C++ shim over libtorch: what tch does not expose.
//
//  - an exact CPU tensor-memory meter (a counting allocator in libtorch's CPU allocator slot);
//  - CPU/CUDA autocast state (enable, dtype, nesting, cache);
//  - backward with an explicit output gradient that does not keep the caller's handles alive;
//  - the default CPU generator's state (dropout must replay bitwise under recompute);
//  - TorchScript modules: load, named children, forward, parameters, train/eval.
//
// Every entry point catches C++ exceptions and reports them as a malloc'd message through
// `err` (freed by ckpt_free_str); nothing throws across the C boundary.

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/script.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

char* dup_str(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

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

// ---------------------------------------------------------------------------------------------
// Counting allocator.
//
// Each allocation gets a 64-byte header in front of the data holding its size, so that the
// deleter knows how many bytes go away without a global map (no lock, no extra allocation).
// The context pointer equals the data pointer, which `Allocator::raw_allocate` requires: oneDNN
// allocates through raw_allocate/raw_deleter, and those bytes are counted like any tensor's.
// 64 bytes keep the data at the 64-byte alignment libtorch's default CPU allocator gives.
constexpr size_t kHeader = 64;

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_window_peak{0};
std::atomic<int64_t> g_allocs{0};
c10::Allocator* g_inner = nullptr;
c10::DeleterFnPtr g_inner_raw_deleter = nullptr;

void raise_max(std::atomic<int64_t>& target, int64_t value) {
  int64_t seen = target.load(std::memory_order_relaxed);
  while (value > seen && !target.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

void counting_delete(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t n = *reinterpret_cast<int64_t*>(base);
  g_current.fetch_sub(n, std::memory_order_relaxed);
  g_inner_raw_deleter(base);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* base = g_inner->raw_allocate(n + kHeader);
    *reinterpret_cast<int64_t*>(base) = static_cast<int64_t>(n);
    void* data = static_cast<char*>(base) + kHeader;
    int64_t now = g_current.fetch_add(static_cast<int64_t>(n), std::memory_order_relaxed) +
                  static_cast<int64_t>(n);
    g_allocs.fetch_add(1, std::memory_order_relaxed);
    raise_max(g_peak, now);
    raise_max(g_window_peak, now);
    return {data, data, &counting_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator g_counting;
std::once_flag g_install_once;

// ---------------------------------------------------------------------------------------------
// Backward helper: once the root node has run, its incoming gradient is dead; drop the handle
// the caller's input vector still holds so the engine frees it, as PyTorch frees an
// inter-node gradient after its consumer ran.
struct ReleaseAfterRoot final : torch::autograd::FunctionPostHook {
  explicit ReleaseAfterRoot(torch::autograd::variable_list* held) : held_(held) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (held_ != nullptr) {
      for (auto& t : *held_) t.reset();
      held_ = nullptr;
    }
    return outputs;
  }
  torch::autograd::variable_list* held_;
};

}  // namespace

extern "C" {

void ckpt_free_str(char* s) { std::free(s); }

// ---- meter ----------------------------------------------------------------------------------
int ckpt_meter_install(char** err) {
  return guarded(err, [] {
    std::call_once(g_install_once, [] {
      g_inner = c10::GetDefaultCPUAllocator();
      g_inner_raw_deleter = g_inner->raw_deleter();
      TORCH_CHECK(g_inner_raw_deleter != nullptr,
                  "libtorch's default CPU allocator has no raw deleter; cannot wrap it");
      // Priority above the default registration (0) so a later default registration cannot
      // silently replace the meter.
      c10::SetCPUAllocator(&g_counting, /*priority=*/10);
    });
    TORCH_CHECK(c10::GetCPUAllocator() == &g_counting,
                "another CPU allocator with a higher priority replaced the ckptune meter");
  });
}
int64_t ckpt_meter_current() { return g_current.load(std::memory_order_relaxed); }
int64_t ckpt_meter_peak() { return g_peak.load(std::memory_order_relaxed); }
int64_t ckpt_meter_allocs() { return g_allocs.load(std::memory_order_relaxed); }
void ckpt_meter_reset_peak() { g_peak.store(g_current.load(std::memory_order_relaxed)); }
int64_t ckpt_meter_window_peak() { return g_window_peak.load(std::memory_order_relaxed); }
void ckpt_meter_reset_window() { g_window_peak.store(g_current.load(std::memory_order_relaxed)); }

// ---- autocast -------------------------------------------------------------------------------
// device: 0 = CPU, 1 = CUDA. dtype: a c10::ScalarType value.
struct CkptAutocastState {
  int enabled;
  int dtype;
  int cache_enabled;
};

int ckpt_autocast_enter(int device, int dtype, int enabled, CkptAutocastState* prev, char** err) {
  return guarded(err, [&] {
    at::DeviceType dt = device == 0 ? at::kCPU : at::kCUDA;
    prev->enabled = at::autocast::is_autocast_enabled(dt) ? 1 : 0;
    prev->dtype = static_cast<int>(at::autocast::get_autocast_dtype(dt));
    prev->cache_enabled = at::autocast::is_autocast_cache_enabled() ? 1 : 0;
    at::autocast::set_autocast_enabled(dt, enabled != 0);
    at::autocast::set_autocast_dtype(dt, static_cast<at::ScalarType>(dtype));
    at::autocast::increment_nesting();
  });
}

int ckpt_autocast_exit(int device, const CkptAutocastState* prev, char** err) {
  return guarded(err, [&] {
    at::DeviceType dt = device == 0 ? at::kCPU : at::kCUDA;
    // As torch.autocast.__exit__: the weight-cast cache lives until the outermost region closes.
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(dt, prev->enabled != 0);
    at::autocast::set_autocast_dtype(dt, static_cast<at::ScalarType>(prev->dtype));
    at::autocast::set_autocast_cache_enabled(prev->cache_enabled != 0);
  });
}

int ckpt_autocast_is_enabled(int device) {
  return at::autocast::is_autocast_enabled(device == 0 ? at::kCPU : at::kCUDA) ? 1 : 0;
}
int ckpt_autocast_dtype(int device) {
  return static_cast<int>(at::autocast::get_autocast_dtype(device == 0 ? at::kCPU : at::kCUDA));
}
void ckpt_autocast_clear_cache() { at::autocast::clear_cache(); }

// ---- backward -------------------------------------------------------------------------------
// Takes ownership of `out` and `grad` (heap at::Tensor handles as tch allocates them) and
// deletes them before the graph runs, so that neither the output nor (after the root node ran)
// its gradient is kept alive by us: the engine frees them as PyTorch's own backward would.
// Gradients accumulate into leaves' .grad. `out` must require grad.
int ckpt_backward(at::Tensor* out, at::Tensor* grad, char** err) {
  return guarded(err, [&] {
    at::Tensor o = std::move(*out);
    at::Tensor g = std::move(*grad);
    delete out;
    delete grad;
    TORCH_CHECK(o.requires_grad(), "backward: the output does not require grad");
    TORCH_CHECK(g.sizes() == o.sizes(), "backward: gradient shape ", g.sizes(),
                " differs from output shape ", o.sizes());
    torch::autograd::edge_list roots{torch::autograd::impl::gradient_edge(o)};
    TORCH_CHECK(roots[0].function != nullptr, "backward: the output has no gradient function");
    o.reset();
    torch::autograd::variable_list inputs{std::move(g)};
    if (auto* fn = roots[0].function.get(); fn != nullptr) {
      fn->add_post_hook(std::make_unique<ReleaseAfterRoot>(&inputs));
    }
    torch::autograd::Engine::get_default_engine().execute(roots, inputs, /*keep_graph=*/false,
                                                          /*create_graph=*/false,
                                                          /*accumulate_grad=*/true);
  });
}

// `param.grad = None`, as zero_grad(set_to_none=True) does.
int ckpt_clear_grad(at::Tensor* t, char** err) {
  return guarded(err, [&] { t->mutable_grad().reset(); });
}

// ---- RNG ------------------------------------------------------------------------------------
int ckpt_rng_get_state(at::Tensor** out, char** err) {
  return guarded(err, [&] {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = new at::Tensor(gen.get_state());
  });
}
int ckpt_rng_set_state(const at::Tensor* state, char** err) {
  return guarded(err, [&] {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  });
}

// ---- TorchScript ----------------------------------------------------------------------------
typedef void (*ckpt_named_module_cb)(void* ctx, const char* name, torch::jit::Module* child);
typedef void (*ckpt_named_tensor_cb)(void* ctx, const char* name, at::Tensor* tensor);

int ckpt_jit_load(const char* path, torch::jit::Module** out, char** err) {
  return guarded(err, [&] { *out = new torch::jit::Module(torch::jit::load(path, at::kCPU)); });
}
void ckpt_jit_free(torch::jit::Module* m) { delete m; }

// Children are handles sharing the parent's object: running a child runs the parent's submodule.
int ckpt_jit_named_children(torch::jit::Module* m, void* ctx, ckpt_named_module_cb cb, char** err) {
  return guarded(err, [&] {
    for (const auto& child : m->named_children()) {
      cb(ctx, child.name.c_str(), new torch::jit::Module(child.value));
    }
  });
}

int ckpt_jit_type_name(torch::jit::Module* m, char** out, char** err) {
  return guarded(err, [&] { *out = dup_str(m->type()->name() ? m->type()->name()->qualifiedName() : ""); });
}

int ckpt_jit_named_parameters(torch::jit::Module* m, int buffers, void* ctx, ckpt_named_tensor_cb cb,
                              char** err) {
  return guarded(err, [&] {
    if (buffers != 0) {
      for (const auto& b : m->named_buffers(/*recurse=*/true)) cb(ctx, b.name.c_str(), new at::Tensor(b.value));
    } else {
      for (const auto& p : m->named_parameters(/*recurse=*/true)) cb(ctx, p.name.c_str(), new at::Tensor(p.value));
    }
  });
}

int ckpt_jit_forward(torch::jit::Module* m, at::Tensor* const* inputs, int n, at::Tensor** out, char** err) {
  return guarded(err, [&] {
    std::vector<c10::IValue> args;
    args.reserve(n);
    for (int i = 0; i < n; ++i) args.emplace_back(*inputs[i]);
    c10::IValue r = m->forward(std::move(args));
    TORCH_CHECK(r.isTensor(), "TorchScript forward returned ", r.tagKind(),
                ", expected a single tensor (ckptune chains pass one tensor between blocks)");
    *out = new at::Tensor(r.toTensor());
  });
}

int ckpt_jit_train(torch::jit::Module* m, int on, char** err) {
  return guarded(err, [&] { m->train(on != 0); });
}

}  // extern "C"
