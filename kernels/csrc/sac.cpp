// Selective activation checkpointing: what `torch.utils.checkpoint` does with
// `context_fn=partial(create_selective_checkpoint_contexts, policy)`, for ckptune's runtime.
//
// While a selective block's forward records, every operator reaching the Fake dispatch key (below
// autograd and autocast, where PyTorch's TorchDispatchMode sees operators too) runs as usual, and
// the outputs of the operators the policy saves are kept in a cache, in call order per operator.
// While its recompute replays the cache, autograd records every operator as in a plain forward,
// and an operator the policy saves returns its cached outputs instead of computing them (first in,
// first out per operator, as `_CachedTorchDispatchMode` pops them). The cache keeps aliases
// (`tensor_data`: the same storage and version counter, no autograd history), so a cached output
// costs no bytes beyond the forward's, and one changed in place after it was cached is refused at
// replay, as PyTorch refuses it.
//
// The key is shared with fake mode (one fallback per key): fake.cpp's fallback calls `sac_call`
// around its own work, so a selective block also runs on the meta device.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common.h"
#include "sac.h"

namespace {

// What the policies save, by operator name (every overload).
// Policy 0, matmul-class ("op", torchtitan's): matrix products and attention kernels.
const std::unordered_set<std::string>& matmul_class() {
  static const std::unordered_set<std::string> ops = {
      "aten::mm",
      "aten::addmm",
      "aten::bmm",
      "aten::baddbmm",
      "aten::_scaled_dot_product_flash_attention_for_cpu",
      "aten::_scaled_dot_product_flash_attention",
      "aten::_scaled_dot_product_efficient_attention",
      "aten::_scaled_dot_product_cudnn_attention",
      "aten::_scaled_dot_product_fused_attention_overrideable",
  };
  return ops;
}

bool saves(int /*policy*/, const c10::OperatorHandle& op) { return matmul_class().count(op.operator_name().name) != 0; }

struct Entry {
  std::vector<c10::IValue> returns;
  std::vector<uint32_t> versions;
};

}  // namespace

struct CkptSacCache {
  int policy = 0;
  std::unordered_map<std::string, std::deque<Entry>> storage;
};

namespace {

thread_local CkptSacCache* t_cache = nullptr;
thread_local bool t_recording = false;
// Inside an operator the mode already handles: its inner calls are the operator's business.
thread_local bool t_busy = false;
thread_local std::unique_ptr<c10::impl::IncludeDispatchKeyGuard> t_guard;

std::string key_of(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return n.name + "." + n.overload_name;
}

struct Busy {
  Busy() { t_busy = true; }
  ~Busy() { t_busy = false; }
};

Entry keep(const torch::jit::Stack& stack, size_t m) {
  Entry e;
  for (size_t i = stack.size() - m; i < stack.size(); ++i) {
    const auto& v = stack[i];
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      e.versions.push_back(t.defined() ? t._version() : 0);
      at::Tensor alias = t.defined() ? t.tensor_data() : t;
      // A fake tensor's alias reports the CPU as the tensor does (fake.cpp).
      auto* impl = t.defined() ? t.unsafeGetTensorImpl() : nullptr;
      if (impl != nullptr && impl->is_fake()) alias.unsafeGetTensorImpl()->set_fake_device(impl->device());
      e.returns.emplace_back(std::move(alias));
    } else {
      TORCH_CHECK(!v.isTensorList() && !v.isList(), "selective checkpointing: operator returns a list");
      e.versions.push_back(0);
      e.returns.push_back(v);
    }
  }
  return e;
}

void replay(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const std::string key = key_of(op);
  auto it = t_cache->storage.find(key);
  TORCH_CHECK(it != t_cache->storage.end() && !it->second.empty(), key,
              " ran in a selective block's recompute more often than in its forward");
  Entry e = std::move(it->second.front());
  it->second.pop_front();
  for (size_t k = 0; k < e.returns.size(); ++k)
    if (e.returns[k].isTensor() && e.returns[k].toTensor().defined())
      TORCH_CHECK(e.returns[k].toTensor()._version() == e.versions[k], "selective checkpointing: the output of ", key,
                  " was changed in place after the forward saved it");
  torch::jit::drop(*stack, op.schema().arguments().size());
  for (auto& v : e.returns) stack->push_back(std::move(v));
}

}  // namespace

namespace ckpt {

void sac_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::function<void()>& run) {
  if (t_cache == nullptr || t_busy) {
    run();
    return;
  }
  const bool save = saves(t_cache->policy, op);
  if (save && !t_recording) {
    replay(op, stack);
    return;
  }
  {
    Busy b;
    run();
  }
  if (save) t_cache->storage[key_of(op)].push_back(keep(*stack, op.schema().returns().size()));
}

bool sac_active() { return t_cache != nullptr; }

}  // namespace ckpt

using ckpt::guarded;

extern "C" {

// Starts recording a selective block's forward under `policy` into a new cache.
int ckpt_sac_record(int policy, CkptSacCache** out, char** err) {
  return guarded(err, [&] {
    TORCH_CHECK(t_cache == nullptr, "selective checkpointing: a block is already recording or replaying");
    TORCH_CHECK(policy == 0, "selective checkpointing: unknown policy ", policy);
    auto* cache = new CkptSacCache();
    cache->policy = policy;
    t_guard = std::make_unique<c10::impl::IncludeDispatchKeyGuard>(c10::DispatchKey::Fake);
    t_cache = cache;
    t_recording = true;
    *out = cache;
  });
}

// Starts replaying `cache` in a recompute.
int ckpt_sac_replay(CkptSacCache* cache, char** err) {
  return guarded(err, [&] {
    TORCH_CHECK(t_cache == nullptr, "selective checkpointing: a block is already recording or replaying");
    t_guard = std::make_unique<c10::impl::IncludeDispatchKeyGuard>(c10::DispatchKey::Fake);
    t_cache = cache;
    t_recording = false;
  });
}

// Ends the recording or replay on this thread.
void ckpt_sac_stop() {
  t_cache = nullptr;
  t_recording = false;
  t_guard.reset();
}

// Cached outputs left after a replay (0 when the recompute used every one).
int64_t ckpt_sac_left(const CkptSacCache* cache) {
  int64_t n = 0;
  for (const auto& kv : cache->storage) n += static_cast<int64_t>(kv.second.size());
  return n;
}

void ckpt_sac_free(CkptSacCache* cache) { delete cache; }

// Whether `policy` saves operator `name` (`aten::addmm`, `aten::add.Tensor`: with its overload,
// as the operator trace names it), so a selective block's recompute takes its outputs from the
// cache rather than running it: the cost model times a selective recompute without it. The same
// test `sac_call` applies; an operator libtorch lacks is saved by no policy.
int ckpt_sac_saves(int policy, const char* name) {
  try {
    const std::string full(name);
    const auto colons = full.find("::");
    const auto dot = full.find('.', colons == std::string::npos ? 0 : colons + 2);
    const std::string base = dot == std::string::npos ? full : full.substr(0, dot);
    const std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
    auto op = c10::Dispatcher::singleton().findSchema({base, overload});
    return op.has_value() && saves(policy, *op) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

}  // extern "C"
