// Fake mode: a training step run with every tensor a *fake* CPU tensor — a meta tensor that
// reports the CPU as its device (`TensorImpl::set_fake_device`) — so that autograd, autocast and
// every CPU code path run as for real CPU tensors while no kernel computes and no memory is
// touched. Its storage comes from the meta allocator slot, where the meter counts every byte
// (`meter.cpp`), so a fake step allocates, byte for byte, what the meta kernels allocate.
//
// How: while fake mode is on, the Fake dispatch key is in the thread's included keys, so every
// operator reaches `fake_fallback` below the autograd and autocast layers. It hands the meta
// kernels meta aliases of the fake arguments (same storage and geometry, reporting meta, as the
// kernels expect of what they compute on), turns device arguments into meta (so a factory call
// for the CPU makes a meta tensor), redispatches to the Meta key, and makes the results fake.
// Operators without a meta kernel in libtorch get one in `meta_kernels.cpp`.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common.h"
#include "cpu_extras.h"
#include "meta_kernels.h"
#include "meter.h"
#include "sac.h"

namespace {

bool is_fake(const at::Tensor& t) { return t.defined() && t.unsafeGetTensorImpl()->is_fake(); }

// An alias of fake `t` that reports meta: the same storage, sizes, strides and offset.
at::Tensor meta_alias(const at::Tensor& t) {
  auto* impl = t.unsafeGetTensorImpl();
  auto alias = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(impl->storage()),
                                                        c10::DispatchKeySet(c10::DispatchKey::Meta), impl->dtype());
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(impl->sizes(), impl->strides(), impl->storage_offset());
  return alias;
}

// The fake arguments of one call and their meta aliases.
struct Aliases {
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;

  at::Tensor to_meta(const at::Tensor& t) {
    if (!is_fake(t)) return t;
    for (auto& p : pairs)
      if (p.first.is_same(t)) return p.second;
    pairs.emplace_back(t, meta_alias(t));
    return pairs.back().second;
  }

  // A result: the fake argument it aliases whole (an in-place op's `self`), else itself made fake.
  at::Tensor to_fake(const at::Tensor& t) const {
    if (!t.defined()) return t;
    for (auto& p : pairs)
      if (p.second.is_same(t)) return p.first;
    auto* impl = t.unsafeGetTensorImpl();
    // A meta result, or a view a composite made of a fake tensor (its key set copied, not the
    // device it reports), reports the CPU.
    if (impl->device().is_meta()) impl->set_fake_device(c10::Device(c10::kCPU));
    return t;
  }

  // Arguments the kernel resized or restrided through their alias (`out=`, `resize_`): the
  // fake tensor takes the new geometry.
  void copy_geometry_back() const {
    for (auto& p : pairs) {
      auto* f = p.first.unsafeGetTensorImpl();
      auto* a = p.second.unsafeGetTensorImpl();
      if (f->sizes() != a->sizes() || f->strides() != a->strides() || f->storage_offset() != a->storage_offset())
        f->set_sizes_and_strides(a->sizes(), a->strides(), a->storage_offset());
    }
  }
};

void map_tensors(c10::IValue& v, const std::function<at::Tensor(const at::Tensor&)>& f) {
  if (v.isTensor()) {
    v = f(v.toTensor());
  } else if (v.isTensorList()) {
    auto l = v.toTensorList();
    for (size_t i = 0; i < l.size(); ++i) l.set(i, f(l.get(i)));
    v = l;
  } else if (v.isOptionalTensorList()) {
    auto l = v.toOptionalTensorList();
    for (size_t i = 0; i < l.size(); ++i) {
      std::optional<at::Tensor> o = l.get(i);
      if (o.has_value()) l.set(i, f(*o));
    }
    v = l;
  }
}

// Whether the meta kernel of `name` is a structured kernel's shape function (build.rs lists
// them from libtorch's native_functions.yaml). Those run on the fake tensors themselves: they
// report the CPU, so TensorIterator promotes inputs of another dtype into temporaries as it does
// on the CPU (a Python number in `mul`, a bf16 operand of an fp32 sum), and counts them. Other
// meta kernels share code with the CPU's and compute unless their tensors report meta.
bool structured(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> ops = {
#include "structured_ops.inc"
  };
  std::string key = name.name.substr(name.name.find("::") + 2);
  if (!name.overload_name.empty()) key += "." + name.overload_name;
  return ops.count(key) != 0;
}

// Whether `op` runs on the fake tensors themselves rather than meta aliases: a structured
// kernel's shape function, a meta kernel of ckptune's, or a composite (no meta kernel of its
// own) whose parts come back here and which does not compute itself.
// Composites that compute on the data themselves, on the CPU, unless their tensors report meta.
bool computes(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> ops = {
      "aten::copy_",         "aten::convolution_backward",        "aten::_nnpack_spatial_convolution",
      "aten::_pin_memory",   "aten::_grid_sampler_2d_cpu_fallback", "aten::_grid_sampler_2d_cpu_fallback_backward",
      "aten::_assert_scalar", "aten::_print",                     "aten::_linalg_check_errors",
  };
  return ops.count(name.name) != 0;
}

bool runs_on_fake(const c10::OperatorHandle& op) {
  const auto& name = op.schema().operator_name();
  if (structured(name)) return true;
  if (ckpt::own_meta_kernel(name.overload_name.empty() ? name.name : name.name + "." + name.overload_name))
    return true;
  if (computes(name)) return false;
  return !op.hasKernelForDispatchKey(c10::DispatchKey::Meta) &&
         (op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
          op.hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional));
}

// Operators whose result depends on tensor values, which fake tensors do not have.
bool data_dependent(const c10::OperatorName& name) {
  return name.name == "aten::_local_scalar_dense" || name.name == "aten::nonzero" ||
         name.name == "aten::nonzero_static" || name.name == "aten::unique" || name.name == "aten::_unique2" ||
         name.name == "aten::masked_select" || name.name == "aten::equal" || name.name == "aten::is_nonzero";
}

// A shallow copy of a fake tensor (`tensor_data()`, as autograd saves an output) keeps the Fake
// key but not the device it reports: it says meta, and CPU kernels' device checks fail. It is
// made to report the CPU again.
void repair(const at::Tensor& t) {
  auto* impl = t.unsafeGetTensorImpl();
  if (impl->is_fake() && impl->device().is_meta()) impl->set_fake_device(c10::Device(c10::kCPU));
}

// Whether any tensor argument of the call on top of `stack` is fake, and whether it has tensors;
// fake arguments are repaired on the way.
std::pair<bool, bool> inspect(const torch::jit::Stack& stack, size_t base) {
  bool fake = false, tensors = false;
  auto see = [&](const at::Tensor& t) {
    tensors = tensors || t.defined();
    if (is_fake(t)) {
      repair(t);
      fake = true;
    }
  };
  for (size_t i = base; i < stack.size(); ++i) {
    const c10::IValue& v = stack[i];
    if (v.isTensor()) {
      see(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList().vec()) see(t);
    } else if (v.isOptionalTensorList()) {
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList().vec())
        if (t.has_value()) see(*t);
    }
  }
  return {fake, tensors};
}

// The meta storages of a call's tensor arguments, held so that what the call grows (`resize_`,
// an `out=` argument) is counted after it returns, as the CPU allocates it.
struct MetaStorages {
  std::vector<c10::Storage> held;

  MetaStorages(const torch::jit::Stack& stack, size_t base) {
    for (size_t i = base; i < stack.size(); ++i) {
      const c10::IValue& v = stack[i];
      if (v.isTensor()) {
        hold(v.toTensor());
      } else if (v.isTensorList()) {
        for (const at::Tensor& t : v.toTensorList().vec()) hold(t);
      }
    }
  }
  void hold(const at::Tensor& t) {
    if (!t.defined() || !t.unsafeGetTensorImpl()->has_storage()) return;
    const c10::Storage& s = t.unsafeGetTensorImpl()->storage();
    if (s.device_type() == c10::DeviceType::Meta) held.push_back(s);
  }
  ~MetaStorages() {
    for (const auto& s : held) ckpt::meter_meta_resized(s.unsafeGetStorageImpl());
  }
};

// Fake mode's guards on this thread, innermost last, and the suspensions of it.
thread_local std::vector<std::unique_ptr<c10::impl::IncludeDispatchKeyGuard>> t_fake_guards;
thread_local std::vector<std::unique_ptr<c10::impl::ExcludeDispatchKeyGuard>> t_suspensions;

void fake_call(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t base = stack->size() - n;
  auto [fake, tensors] = inspect(*stack, base);
  MetaStorages storages(*stack, base);
  if (tensors && !fake) {
    // Real tensors only (the optimizer's step count on the host, an RNG state): computed for
    // real, as in a real step, down to the temporaries its kernels make (TensorIterator's
    // dtype conversions are factory calls that would otherwise come out fake and empty).
    c10::impl::ExcludeDispatchKeyGuard real(c10::DispatchKey::Fake);
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Fake), stack);
    return;
  }
  TORCH_CHECK(!data_dependent(schema.operator_name()), schema.operator_name().name,
              " depends on tensor values, which a step measured on the meta device does not have "
              "(data-dependent operators such as .item() or nonzero() in the model's forward)");
  Aliases aliases;
  const bool direct = runs_on_fake(op);
  for (size_t k = 0; k < n; ++k) {
    auto& v = (*stack)[base + k];
    if (!direct) map_tensors(v, [&](const at::Tensor& t) { return aliases.to_meta(t); });
    bool cpu_device = v.isDevice() && v.toDevice().is_cpu();
    if (cpu_device || (v.isNone() && schema.arguments()[k].name() == "device")) v = c10::IValue(c10::Device(c10::kMeta));
  }
  // The arguments, for what the CPU kernel allocates after its outputs exist.
  const ckpt::CpuExtras extras = ckpt::cpu_extras(schema.operator_name());
  std::vector<c10::IValue> args;
  if (extras != nullptr) args.assign(stack->begin() + base, stack->end());
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::Meta), stack);
  const size_t m = schema.returns().size();
  for (size_t i = stack->size() - m; i < stack->size(); ++i)
    map_tensors((*stack)[i], [&](const at::Tensor& t) { return aliases.to_fake(t); });
  aliases.copy_geometry_back();
  if (extras != nullptr) {
    for (auto& v : args) map_tensors(v, [&](const at::Tensor& t) { return aliases.to_fake(t); });
    extras(args, std::vector<c10::IValue>(stack->end() - m, stack->end()));
  }
}

// The key's one fallback, shared with selective checkpointing (sac.cpp), which may have
// included the key while fake mode is off: then the operator runs for real below the key.
void fake_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  ckpt::sac_call(op, stack, [&] {
    if (!t_fake_guards.empty()) {
      fake_call(op, ks, stack);
      return;
    }
    c10::impl::ExcludeDispatchKeyGuard real(c10::DispatchKey::Fake);
    op.redispatchBoxed(ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Fake), stack);
  });
}

TORCH_LIBRARY_IMPL(_, Fake, m) { m.fallback(torch::CppFunction::makeFromBoxedFunction<&fake_fallback>()); }

}  // namespace

using ckpt::guarded;

extern "C" {

// Turns fake mode on for this thread (nesting).
int ckpt_fake_enter(char** err) {
  return guarded(err, [] {
    TORCH_CHECK(ckpt::meta_kernels_linked() != 0, "meta kernels missing");
    t_fake_guards.push_back(std::make_unique<c10::impl::IncludeDispatchKeyGuard>(c10::DispatchKey::Fake));
  });
}

// Turns off the innermost fake mode of this thread.
void ckpt_fake_exit() {
  if (!t_fake_guards.empty()) t_fake_guards.pop_back();
}

int ckpt_fake_active() { return t_fake_guards.empty() || !t_suspensions.empty() ? 0 : 1; }

// Suspends fake mode on this thread (what is created meanwhile is real) until resumed.
int ckpt_fake_suspend(char** err) {
  return guarded(err, [] {
    t_suspensions.push_back(std::make_unique<c10::impl::ExcludeDispatchKeyGuard>(c10::DispatchKey::Fake));
  });
}

void ckpt_fake_resume() {
  if (!t_suspensions.empty()) t_suspensions.pop_back();
}

int ckpt_is_fake(const at::Tensor* t) { return is_fake(*t) ? 1 : 0; }

// Whether two handles hold the same tensor (one TensorImpl).
int ckpt_same_tensor(const at::Tensor* a, const at::Tensor* b) {
  return a->unsafeGetTensorImpl() == b->unsafeGetTensorImpl() ? 1 : 0;
}

}  // extern "C"
