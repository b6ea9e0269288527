// Selective activation checkpointing: what `torch.utils.checkpoint` does with
// `context_fn=partial(create_selective_checkpoint_contexts, policy)`, for ckptune's runtime.
//
// While a selective block's forward records, every operator reaching the Fake dispatch key (below
// autograd and autocast, where PyTorch's TorchDispatchMode sees operators too) runs as usual, and
// the policy, shown the operator with its inputs and outputs, decides whether its outputs are
// kept in a cache or recomputed; the decision is recorded per call, in call order per operator.
// While its recompute replays the cache, autograd records every operator as in a plain forward,
// and the n-th call of an operator takes the n-th decision: a kept call returns its cached
// outputs instead of computing them, the others run (as PyTorch 2.13's
// `_CachedTorchDispatchMode` pops its storage by operator and index). The cache keeps aliases
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

#include <ATen/core/enum_tag.h>

#include <algorithm>
#include <deque>
#include <optional>
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

// The fused attention kernels: the `matmul` policy keeps their outputs, `attention` recomputes
// them from the q, k, v it keeps.
const std::unordered_set<std::string>& attention_kernels() {
  static const std::unordered_set<std::string> ops = {
      "aten::_scaled_dot_product_flash_attention_for_cpu",
      "aten::_scaled_dot_product_flash_attention",
      "aten::_scaled_dot_product_efficient_attention",
      "aten::_scaled_dot_product_cudnn_attention",
      "aten::_scaled_dot_product_fused_attention_overrideable",
  };
  return ops;
}

// Policy 0, `matmul` (torchtitan's `op` policy without its every-other-mm rule): matrix products,
// every overload, and the attention kernels.
const std::unordered_set<std::string>& matrix_products() {
  static const std::unordered_set<std::string> ops = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"};
  return ops;
}

// Operators that make a tensor without computing its values from their inputs' values: cheap to
// make again, and often filled in place afterwards (the CPU's dropout fills an `empty_like` with
// `bernoulli_`), a fill that is then recomputed with them.
const std::unordered_set<std::string>& factories() {
  static const std::unordered_set<std::string> ops = {
      "aten::empty",     "aten::empty_like", "aten::empty_strided", "aten::new_empty", "aten::new_empty_strided",
      "aten::zeros",     "aten::zeros_like", "aten::new_zeros",     "aten::ones",      "aten::ones_like",
      "aten::new_ones",  "aten::full",       "aten::full_like",     "aten::new_full",  "aten::scalar_tensor",
      "aten::arange",
  };
  return ops;
}

// The attention-score shape, [..., s, s]: three dimensions or more, the last two equal.
bool score_shaped(const at::Tensor& t) {
  return t.defined() && t.dim() >= 3 && t.sizes()[t.dim() - 1] == t.sizes()[t.dim() - 2];
}

bool any_score_shaped(const c10::IValue* begin, const c10::IValue* end) {
  for (const auto* v = begin; v != end; ++v) {
    if (v->isTensor() && score_shaped(v->toTensor())) return true;
    if (v->isList())
      for (const auto& e : v->toListRef())
        if (e.isTensor() && score_shaped(e.toTensor())) return true;
  }
  return false;
}

// Operators PyTorch's selective checkpointing runs without asking the policy (`SAC_IGNORED_OPS`:
// checkpointing itself calls them a different number of times in forward and recompute).
bool ignored(const c10::OperatorHandle& op) {
  const auto& n = op.operator_name();
  return (n.name == "aten::detach" && n.overload_name.empty()) || n.name == "prim::device";
}

struct Entry {
  std::vector<c10::IValue> returns;
  std::vector<uint32_t> versions;
};

// One call of an operator in a selective block's forward: its kept outputs, or none (recompute).
using Call = std::optional<Entry>;

}  // namespace

struct CkptSacCache {
  int policy = 0;
  std::unordered_map<std::string, std::deque<Call>> storage;
  // The storages of the outputs kept so far in the forward (alive while cached, so never reused).
  std::unordered_set<const c10::StorageImpl*> kept_storages;
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

// The decision the forward took for this call of `op` (first in, first out per operator).
Call next_call(const c10::OperatorHandle& op) {
  const std::string key = key_of(op);
  auto it = t_cache->storage.find(key);
  TORCH_CHECK(it != t_cache->storage.end() && !it->second.empty(), key,
              " ran in a selective block's recompute more often than in its forward");
  Call c = std::move(it->second.front());
  it->second.pop_front();
  return c;
}

// `attention` keeps outputs that the block then writes in place (and keeps those writes), so it
// takes them as they are, as `allow_cache_entry_mutation=True` does.
void replay(const c10::OperatorHandle& op, Entry e, torch::jit::Stack* stack) {
  if (t_cache->policy == 0)
    for (size_t k = 0; k < e.returns.size(); ++k)
      if (e.returns[k].isTensor() && e.returns[k].toTensor().defined())
        TORCH_CHECK(e.returns[k].toTensor()._version() == e.versions[k], "selective checkpointing: the output of ",
                    key_of(op), " was changed in place after the forward saved it");
  torch::jit::drop(*stack, op.schema().arguments().size());
  for (auto& v : e.returns) stack->push_back(std::move(v));
}

// What the `attention` policy reads of a call's inputs, before the call.
struct Inputs {
  bool score_shaped = false;
  // -1: writes no input in place; 0: writes one whose storage holds no kept output; 1: one that does.
  int writes_kept = -1;
};

const c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr;
}

Inputs read_inputs(const CkptSacCache& cache, const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  Inputs in;
  const auto& args = op.schema().arguments();
  const c10::IValue* first = stack.data() + stack.size() - args.size();
  in.score_shaped = any_score_shaped(first, stack.data() + stack.size());
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    if (alias == nullptr || !alias->isWrite() || !first[i].isTensor()) continue;
    const bool kept = cache.kept_storages.count(storage_of(first[i].toTensor())) != 0;
    in.writes_kept = std::max(in.writes_kept, kept ? 1 : 0);
  }
  return in;
}

// Policy 1, `attention` (Megatron's selective recompute of the attention core). An operator
// writing an input in place follows that input: kept when its storage holds a kept output (the
// recompute must not write it twice), recomputed otherwise (a recomputed tensor must be written
// again). Otherwise recomputed are the attention kernels, every operator reading or writing a
// tensor of the score shape (q@k^T, its scale, the mask's add, softmax and its casts, dropout,
// probabilities@v), random operators (so the recompute draws the forward's numbers in the
// forward's order), pointwise operators (cheap, and many: kept, they were 230,400 B of the
// 427,008 B the reference tiny Llama's eager layer kept at batch 2, sequence 64), factories and
// views (keeping them keeps nothing); every other output is kept: matrix products, norms,
// reductions, concatenations.
bool attention_keeps(const c10::OperatorHandle& op, const Inputs& in, const torch::jit::Stack& stack) {
  if (in.writes_kept >= 0) return in.writes_kept == 1;
  const auto& name = op.operator_name().name;
  if (attention_kernels().count(name) != 0 || factories().count(name) != 0 || in.score_shaped) return false;
  const size_t m = op.schema().returns().size();
  if (any_score_shaped(stack.data() + stack.size() - m, stack.data() + stack.size())) return false;
  if (op.hasTag(at::Tag::nondeterministic_seeded) || op.hasTag(at::Tag::pointwise)) return false;
  for (const auto& r : op.schema().returns())
    if (r.alias_info() != nullptr) return false;
  return true;
}

// Policy 0, `matmul`: whether it keeps a call of operator `name` (`aten::mm`, no overload); the
// name alone decides.
bool matmul_keeps(const std::string& name) {
  return matrix_products().count(name) != 0 || attention_kernels().count(name) != 0;
}

// Whether the policy keeps this call's outputs; `stack` holds them, after the call.
bool keeps(const CkptSacCache& cache, const c10::OperatorHandle& op, const Inputs& in, const torch::jit::Stack& stack) {
  if (cache.policy == 0) return matmul_keeps(op.operator_name().name);
  return attention_keeps(op, in, stack);
}

}  // namespace

namespace ckpt {

void sac_call(const c10::OperatorHandle& op, torch::jit::Stack* stack, const std::function<void()>& run) {
  if (t_cache == nullptr || t_busy || ignored(op)) {
    run();
    return;
  }
  if (!t_recording) {
    Call c = next_call(op);
    if (c) {
      replay(op, std::move(*c), stack);
      return;
    }
    Busy b;
    run();
    return;
  }
  const Inputs in = t_cache->policy == 1 ? read_inputs(*t_cache, op, *stack) : Inputs{};
  {
    Busy b;
    run();
  }
  const size_t m = op.schema().returns().size();
  Call c;
  if (keeps(*t_cache, op, in, *stack)) {
    c = keep(*stack, m);
    for (const auto& v : c->returns)
      if (v.isTensor()) t_cache->kept_storages.insert(storage_of(v.toTensor()));
  }
  t_cache->storage[key_of(op)].push_back(std::move(c));
}

bool sac_active() { return t_cache != nullptr; }

}  // namespace ckpt

using ckpt::guarded;

extern "C" {

// Starts recording a selective block's forward under `policy` into a new cache.
int ckpt_sac_record(int policy, CkptSacCache** out, char** err) {
  return guarded(err, [&] {
    TORCH_CHECK(t_cache == nullptr, "selective checkpointing: a block is already recording or replaying");
    TORCH_CHECK(policy == 0 || policy == 1, "selective checkpointing: unknown policy ", policy);
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
  for (const auto& kv : cache->storage)
    for (const auto& c : kv.second) n += c.has_value() ? 1 : 0;
  return n;
}

void ckpt_sac_free(CkptSacCache* cache) { delete cache; }

// Whether policy `policy` saves every call of operator `name` (`aten::addmm`, with or without
// its overload, as the operator trace names it), so a selective block's recompute takes its
// outputs from the cache rather than running it: the cost model times a selective recompute
// without them. 1 or 0 for `matmul`, whose test reads the name alone (`keeps`); -1 for
// `attention`, whose test reads each call's shapes, tags and in-place writes, which a name does
// not carry.
int ckpt_sac_saves(int policy, const char* name) {
  if (policy != 0) return -1;
  try {
    const std::string full(name);
    const auto colons = full.find("::");
    const auto dot = full.find('.', colons == std::string::npos ? 0 : colons + 2);
    return matmul_keeps(dot == std::string::npos ? full : full.substr(0, dot)) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

}  // extern "C"
