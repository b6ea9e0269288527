// The C++ shim over libtorch: what tch does not expose.
//
//  - an exact CPU tensor-memory meter (a counting allocator in libtorch's CPU allocator slot);
//  - CPU/CUDA autocast state (enable, dtype, nesting, cache);
//  - backward with an explicit output gradient that does not keep the caller's handles alive;
//  - post-accumulate-grad hooks on parameters (the optimizer step in backward);
//  - a non-leaf alias of a leaf, which in-place operators may write under grad mode;
//  - block inputs as non-leaf aliases whose gradient flows into a sink, and backward from
//    output edges, so a boundary's storage lives only as long as a reader saved it;
//  - the default CPU generator's state (dropout must replay bitwise under recompute);
//  - TorchScript modules: load, named children, forward, parameters, train/eval;
//  - one generic boxed call of any dispatcher operator (the torch.export interpreter).
//
// Every entry point catches C++ exceptions and reports them as a malloc'd message through
// `err` (freed by ckpt_free_str); nothing throws across the C boundary.

#include <ATen/ATen.h>
#include <ATen/ScalarOps.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/node.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/script.h>

#include "common.h"
#include "meter.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

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

// Backward helper: a root that hands out several gradients at once, the block outputs' and
// the gradient each of the block's input sinks already holds from later blocks that read it
// (skips). The engine runs it first, so a sink's accumulation buffer starts with that gradient
// and then adds the block's own contributions in the engine's order: the sum a fused graph
// computes, where the later readers' backward also ran first. (Adding the block's total to the leaf's
// .grad afterwards sums in another order, which differs in the last bit when the block reads
// its input more than once, as RMSNorm does.) It moves the gradients out when it runs, so it
// keeps neither alive.
struct SeededRoot final : torch::autograd::Node {
  SeededRoot(torch::autograd::edge_list edges, torch::autograd::variable_list grads)
      : Node(std::move(edges)), grads_(std::move(grads)) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& /*inputs*/) override {
    return std::move(grads_);
  }
  std::string name() const override { return "ckptune::SeededRoot"; }
  torch::autograd::variable_list grads_;
};

// The gradient edge of `out`, a block's output that backward starts from, after checking that
// `grad` fits it.
torch::autograd::Edge output_edge(const at::Tensor& out, const at::Tensor& grad) {
  TORCH_CHECK(out.requires_grad(), "backward: the output does not require grad");
  TORCH_CHECK(grad.sizes() == out.sizes(), "backward: gradient shape ", grad.sizes(),
              " differs from output shape ", out.sizes());
  torch::autograd::Edge edge = torch::autograd::impl::gradient_edge(out);
  TORCH_CHECK(edge.function != nullptr, "backward: the output has no gradient function");
  return edge;
}

// Post-accumulate-grad hook (what `Tensor.register_post_accumulate_grad_hook` registers from
// Python): the AccumulateGrad node calls it after adding into `.grad`, inside the engine, as
// torchtune's optimizer-in-backward relies on. It calls back into Rust with the parameter's
// index; a failure there is thrown into the engine, which ends the backward with it.
using PostAccCb = int (*)(int64_t index);
struct IndexedPostAccHook final : torch::autograd::PostAccumulateGradHook {
  IndexedPostAccHook(PostAccCb cb, int64_t index) : cb_(cb), index_(index) {}
  void operator()(const torch::autograd::Variable& /*tensor*/) override {
    TORCH_CHECK(cb_(index_) == 0, "the optimizer step in backward failed for parameter ", index_);
  }
  PostAccCb cb_;
  int64_t index_;
};

// Runs the engine from one SeededRoot handing `seeds` out along `edges`, accumulating into
// leaves' .grad; the root keeps nothing once it ran.
void run_seeded(torch::autograd::edge_list edges, torch::autograd::variable_list seeds) {
  ckpt::meter_mark_backward_start();
  auto root = c10::make_intrusive<SeededRoot>(std::move(edges), std::move(seeds));
  // The engine feeds its one root a gradient: an empty one, which allocates nothing.
  at::Tensor none = at::empty({0});
  root->add_input_metadata(none);
  torch::autograd::edge_list roots{torch::autograd::Edge(root, 0)};
  torch::autograd::variable_list inputs{std::move(none)};
  root.reset();
  torch::autograd::Engine::get_default_engine().execute(roots, inputs, /*keep_graph=*/false,
                                                        /*create_graph=*/false,
                                                        /*accumulate_grad=*/true);
}

// A block input's gradient sink: what a leaf's AccumulateGrad is, without the leaf. A block's
// input is a detached alias of the previous block's output (same storage and version counter,
// no view) whose gradient edge is this node, so it is a non-leaf as the previous layer's output
// is in PyTorch: autocast does not cache its casts, in-place operators may write it, and
// nothing but what its readers' graphs saved holds its storage once the runtime drops its
// handles (the node holds no tensor of the forward). Every reader's backward ends here; the
// sum is the previous block's output gradient. The first gradient is kept as it comes (PyTorch
// hands the previous layer's nodes the buffer itself, never a copy); a later one is added in
// place, as AccumulateGrad adds into `.grad` outside grad mode, unless the sum is shared.
struct GradSink final : torch::autograd::Node {
  // Highest priority, as AccumulateGrad's: it runs as soon as its gradient is complete.
  GradSink() : Node(/*sequence_nr=*/UINT64_MAX) {}
  torch::autograd::variable_list apply(torch::autograd::variable_list&& inputs) override {
    at::Tensor g = std::move(inputs[0]);
    if (!g.defined()) return {};
    if (!grad.defined()) {
      grad = std::move(g);
    } else if (grad.use_count() == 1) {
      grad.add_(g);
    } else {
      grad = grad + g;
    }
    return {};
  }
  std::string name() const override { return "ckptune::GradSink"; }
  at::Tensor grad;
};

// The gradient edge of a block's output, kept in place of the output so that backward can
// start from it after the output's storage went: what the edge needs of the tensor (its shape,
// to check the gradient) is copied out.
struct OutputEdge {
  torch::autograd::Edge edge;
  std::vector<int64_t> sizes;
};

}  // namespace

using ckpt::dup_str;
using ckpt::guarded;

extern "C" {

void ckpt_free_str(char* s) { std::free(s); }

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
    torch::autograd::edge_list roots{output_edge(o, g)};
    o.reset();
    ckpt::meter_mark_backward_start();
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

// Sets (cb non-null) or removes (cb null) the post-accumulate-grad hook of leaf `t`.
int ckpt_set_post_accumulate_hook(at::Tensor* t, PostAccCb cb, int64_t index, char** err) {
  return guarded(err, [&] {
    TORCH_CHECK(t->is_leaf() && t->requires_grad(),
                "a post-accumulate-grad hook needs a leaf that requires grad");
    if (cb == nullptr) {
      torch::autograd::impl::post_acc_grad_hooks(*t).reset();
    } else {
      torch::autograd::impl::set_post_acc_grad_hooks(*t, std::make_unique<IndexedPostAccHook>(cb, index));
    }
  });
}

// A handle on `t` that an in-place operator may write as PyTorch lets it write the previous
// layer's output (a non-leaf there). Under grad mode, for a leaf that requires grad (which
// PyTorch refuses to write in place, as it does a view of one): a detached alias (same storage
// and version counter, not a view) whose gradient edge is an `Identity` node feeding the leaf's
// gradient accumulator; the identity passes the gradient through by move, so backward
// allocates nothing more. Otherwise (no grad mode, or no leaf) `t` itself.
int ckpt_writable_alias(const at::Tensor* t, at::Tensor** out, char** err) {
  return guarded(err, [&] {
    if (!torch::autograd::GradMode::is_enabled() || !t->requires_grad() || !t->is_leaf()) {
      *out = new at::Tensor(*t);
      return;
    }
    at::Tensor alias = t->detach();
    auto identity = c10::make_intrusive<torch::autograd::Identity>();
    identity->add_next_edge(torch::autograd::impl::gradient_edge(*t));
    torch::autograd::create_gradient_edge(alias, std::move(identity));
    *out = new at::Tensor(std::move(alias));
  });
}

// ---- boundary sinks -------------------------------------------------------------------------
struct CkptSink {
  c10::intrusive_ptr<GradSink> node;
};

// `*out`: a non-leaf alias of `t` whose gradient flows into the new sink `*sink` (see GradSink).
int ckpt_sink_alias(const at::Tensor* t, at::Tensor** out, CkptSink** sink, char** err) {
  return guarded(err, [&] {
    TORCH_CHECK(t->is_floating_point(), "a gradient sink needs a floating-point tensor, not ",
                t->scalar_type());
    at::Tensor alias = t->detach();
    auto node = c10::make_intrusive<GradSink>();
    torch::autograd::create_gradient_edge(alias, node);
    *sink = new CkptSink{std::move(node)};
    *out = new at::Tensor(std::move(alias));
  });
}

// `*out`: one more reader's alias of `t` feeding `sink`, whose first alias was of `t` (each
// reader holds its own alias, so the boundary's storage goes with the last of them).
int ckpt_sink_reader(CkptSink* sink, const at::Tensor* t, at::Tensor** out, char** err) {
  return guarded(err, [&] {
    const torch::autograd::InputMetadata& meta = sink->node->input_metadata(0);
    TORCH_CHECK(t->dtype() == meta.dtype() && meta.is_same_shape(*t),
                "a gradient sink's readers must read one tensor: ", t->dtype(), t->sizes(),
                " is not the sink's ", meta.dtype(), " tensor");
    at::Tensor alias = t->detach();
    torch::autograd::impl::set_gradient_edge(alias, {sink->node, 0});
    *out = new at::Tensor(std::move(alias));
  });
}

// The gradient the sink holds (undefined if none reached it), taken off it.
int ckpt_sink_take_grad(CkptSink* sink, at::Tensor** out, char** err) {
  return guarded(err, [&] { *out = new at::Tensor(std::exchange(sink->node->grad, at::Tensor())); });
}
void ckpt_sink_free(CkptSink* sink) { delete sink; }

// The gradient edge of `out`, which must require grad; takes ownership of `out` and deletes it.
int ckpt_output_edge(at::Tensor* out, OutputEdge** edge, char** err) {
  return guarded(err, [&] {
    at::Tensor o = std::move(*out);
    delete out;
    TORCH_CHECK(o.requires_grad(), "backward: the output does not require grad");
    torch::autograd::Edge e = torch::autograd::impl::gradient_edge(o);
    TORCH_CHECK(e.function != nullptr, "backward: the output has no gradient function");
    *edge = new OutputEdge{std::move(e), o.sizes().vec()};
  });
}
void ckpt_output_edge_free(OutputEdge* edge) { delete edge; }

// How many holders `t`'s storage has besides `*t` itself: other handles on its tensor (a graph
// that saved it as an operator's input holds the tensor) and other tensors on its storage (one
// that saved it as an operator's output holds a second tensor; so does a view).
int64_t ckpt_storage_holders(const at::Tensor* t) {
  if (!t->defined() || !t->unsafeGetTensorImpl()->has_storage()) return 0;
  return static_cast<int64_t>(t->use_count() - 1 + t->storage().use_count() - 1);
}

// Backward from the `n` output edges (the outputs themselves may be gone) with their
// gradients, and with the gradient each of the `m` sinks already holds from later readers fed in
// first, all handed out by one SeededRoot. Takes ownership of every edge and gradient handle.
int ckpt_backward_edges(OutputEdge** edges, at::Tensor** grads, int64_t n, CkptSink* const* sinks, int64_t m,
                        char** err) {
  return guarded(err, [&] {
    torch::autograd::edge_list roots;
    torch::autograd::variable_list seeds;
    std::vector<std::vector<int64_t>> sizes;
    for (int64_t i = 0; i < n; ++i) {
      roots.push_back(std::move(edges[i]->edge));
      sizes.push_back(std::move(edges[i]->sizes));
      seeds.push_back(std::move(*grads[i]));
      delete edges[i];
      delete grads[i];
    }
    TORCH_CHECK(n > 0, "backward: no output to start from");
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(seeds[i].sizes() == at::IntArrayRef(sizes[i]), "backward: gradient shape ", seeds[i].sizes(),
                  " differs from output shape ", at::IntArrayRef(sizes[i]));
    }
    for (int64_t j = 0; j < m; ++j) {
      GradSink& node = *sinks[j]->node;
      if (!node.grad.defined()) continue;
      seeds.push_back(std::exchange(node.grad, at::Tensor()));
      roots.emplace_back(sinks[j]->node, 0);
    }
    run_seeded(std::move(roots), std::move(seeds));
  });
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

// The generator's whole state (its Mersenne Twister and the cached second normal samples)
// outside any tensor: get_state() returns a 5,056-byte tensor, which a meter counts.
struct CkptRngSnapshot {
  at::mt19937 engine;
  std::optional<float> next_float_normal;
  std::optional<double> next_double_normal;
};
int ckpt_rng_snapshot(CkptRngSnapshot** out, char** err) {
  return guarded(err, [&] {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
    *out = new CkptRngSnapshot{impl->engine(), impl->next_float_normal_sample(),
                               impl->next_double_normal_sample()};
  });
}
int ckpt_rng_restore(const CkptRngSnapshot* snap, char** err) {
  return guarded(err, [&] {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    auto* impl = at::check_generator<at::CPUGeneratorImpl>(gen);
    impl->set_engine(snap->engine);
    impl->set_next_float_normal_sample(snap->next_float_normal);
    impl->set_next_double_normal_sample(snap->next_double_normal);
  });
}
void ckpt_rng_snapshot_free(CkptRngSnapshot* snap) { delete snap; }

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


// ---- dispatcher operators --------------------------------------------------------------------
// One generic path for every node of an exported program, as PyTorch's nativert C10Kernel: look
// the schema up by name, build the stack by the schema's argument types, callBoxed. The call
// goes through the dispatcher like eager PyTorch's, so autograd, autocast and the CPU allocator
// (the meter) see exactly what they see under Python.

// A value handed in from Rust. `tag` says which field holds it; the schema decides the IValue.
struct CkptArg {
  const char* name;  // the schema's argument name
  int32_t tag;       // 0 none, 1 tensor, 2 int, 3 float, 4 bool, 5 ints, 6 floats, 7 bools (in ints),
                     // 8 tensors (null entries are None), 9 string
  int64_t i;
  double f;
  const int64_t* ints;
  const double* floats;
  at::Tensor* const* tensors;
  int64_t len;
  const char* str;
  const at::Tensor* tensor;
};

// Receives each returned value: `ret` is the schema's return index; a list return calls once per
// element with `item` its position (-1 for a non-list). tag: 0 none, 1 tensor (a fresh heap
// handle the callee owns), 2 int, 3 float, 4 bool; a list return first calls with tag 5 and
// `i` its length (so an empty list is seen too).
typedef void (*ckpt_value_cb)(void* ctx, int ret, int item, int tag, at::Tensor* t, int64_t i, double f);

// Receives what a number scope saw (ckpt_numbers_end).
typedef void (*ckpt_number_cb)(void* ctx, int saved, at::Tensor* kept);

namespace {

std::string describe_arg(const CkptArg& a) {
  static const char* names[] = {"None", "a tensor", "an int", "a float", "a bool", "an int list",
                                "a float list", "a bool list", "a tensor list", "a string"};
  return (a.tag >= 0 && a.tag <= 9) ? names[a.tag] : "an unknown value";
}

// Block forwards' number scopes (`ckpt_numbers_begin`): a Python number where the schema wants
// a tensor becomes a 0-dim wrapped number (to_ivalue), as PyTorch's Python binding makes it, and
// an operator's backward may save it (`x / 8.0` is div.Tensor, whose backward divides by the
// saved 8.0). Autograd saves a wrapped number as it is, past any saved-tensor hooks
// (SavedVariable's constructor skips the hooks for wrapped numbers, so they never leak to them),
// so `torch.utils.checkpoint`'s forward keeps the 8 bytes of each such number until the
// checkpointed module's backward, where a no-grad forward keeps none. While a scope is open on a
// thread, each call's wrapped numbers are counted in order: in a block's run with grad, whether
// autograd saved the number (something besides the call's own handle holds it afterwards); in its
// run without grad, the number is kept when the block's grad run saved the one in its place, or
// when the block has not run with grad yet (`learned` off). The block's run decides, not the
// operator's grad mode: a block run with grad may turn grad off inside (transformers' rotary
// embedding is `@torch.no_grad()`), and a number made there is saved by nothing, in either run.
struct NumberScope {
  bool grad = false;     // the block runs with grad
  bool learned = false;
  std::vector<uint8_t> saved_before;  // per number of the block's grad run: saved or not
  size_t next = 0;
  std::vector<uint8_t> saved;         // per number made with grad on
  std::vector<at::Tensor> kept;       // numbers made with grad off that the checkpoint would keep
};
thread_local std::unique_ptr<NumberScope> t_numbers;

// A call's wrapped numbers, each with no holder but `made` once the call returned unless its
// backward saved it.
void numbers_seen(std::vector<at::Tensor>& made) {
  NumberScope* s = t_numbers.get();
  if (s == nullptr) return;
  for (auto& t : made) {
    const size_t k = s->next++;
    if (s->grad) {
      s->saved.push_back(t.use_count() > 1 || t.storage().use_count() > 1 ? 1 : 0);
    } else if (!s->learned || k >= s->saved_before.size() || s->saved_before[k] != 0) {
      s->kept.push_back(std::move(t));
    }
  }
}

// `made`: where a wrapped number made for a tensor argument is handed to as well.
c10::IValue to_ivalue(const c10::Argument& formal, const CkptArg& a, std::vector<at::Tensor>& made) {
  c10::TypePtr type = formal.type();
  if (auto opt = type->cast<c10::OptionalType>()) {
    if (a.tag == 0) return c10::IValue();
    type = opt->getElementType();
  }
  auto bad = [&]() -> c10::IValue {
    TORCH_CHECK(false, "argument '", formal.name(), "' has schema type ", formal.type()->str(),
                " but the program gives ", describe_arg(a));
  };
  switch (type->kind()) {
    case c10::TypeKind::TensorType: {
      if (a.tag == 1 && a.tensor != nullptr) return *a.tensor;
      // A Python number where the schema wants a tensor (`buf.add_(1)` is add_.Tensor): the
      // Python binding passes a 0-dim "wrapped number" tensor, which type promotion treats as a
      // scalar; do the same so dtypes and allocations match eager.
      at::Tensor t;
      if (a.tag == 2) t = at::scalar_to_tensor(at::Scalar(a.i));
      else if (a.tag == 3) t = at::scalar_to_tensor(at::Scalar(a.f));
      else if (a.tag == 4) t = at::scalar_to_tensor(at::Scalar(a.i != 0));
      else return bad();
      t.unsafeGetTensorImpl()->set_wrapped_number(true);
      made.push_back(t);
      return t;
    }
    case c10::TypeKind::IntType:
    case c10::TypeKind::SymIntType:
    case c10::TypeKind::ScalarTypeType:
    case c10::TypeKind::LayoutType:
    case c10::TypeKind::MemoryFormatType:
      if (a.tag == 2) return a.i;
      if (a.tag == 4) return static_cast<int64_t>(a.i != 0);
      return bad();
    case c10::TypeKind::FloatType:
    case c10::TypeKind::SymFloatType:
      if (a.tag == 3) return a.f;
      if (a.tag == 2) return static_cast<double>(a.i);
      return bad();
    case c10::TypeKind::BoolType:
    case c10::TypeKind::SymBoolType:
      if (a.tag == 4 || a.tag == 2) return a.i != 0;
      return bad();
    case c10::TypeKind::NumberType:  // Scalar: the program's literal keeps its Python type
      if (a.tag == 2) return a.i;
      if (a.tag == 3) return a.f;
      if (a.tag == 4) return a.i != 0;
      return bad();
    case c10::TypeKind::StringType:
      if (a.tag == 9) return std::string(a.str);
      return bad();
    case c10::TypeKind::DeviceObjType:
      if (a.tag == 9) return c10::Device(std::string(a.str));
      return bad();
    case c10::TypeKind::ListType: {
      c10::TypePtr elem = type->castRaw<c10::ListType>()->getElementType();
      bool opt_elem = false;
      if (auto o = elem->cast<c10::OptionalType>()) {
        elem = o->getElementType();
        opt_elem = true;
      }
      switch (elem->kind()) {
        case c10::TypeKind::IntType:
        case c10::TypeKind::SymIntType:
          if (a.tag == 5) return c10::List<int64_t>(std::vector<int64_t>(a.ints, a.ints + a.len));
          if (a.tag == 2) return c10::List<int64_t>(std::vector<int64_t>{a.i});  // `int[2] x = 3` style
          return bad();
        case c10::TypeKind::FloatType:
          if (a.tag == 6) return c10::List<double>(std::vector<double>(a.floats, a.floats + a.len));
          return bad();
        case c10::TypeKind::BoolType: {
          if (a.tag != 7) return bad();
          c10::List<bool> l;
          for (int64_t k = 0; k < a.len; ++k) l.push_back(a.ints[k] != 0);
          return l;
        }
        case c10::TypeKind::TensorType:
          if (a.tag != 8) return bad();
          if (opt_elem) {
            c10::List<std::optional<at::Tensor>> l;
            for (int64_t k = 0; k < a.len; ++k) {
              l.push_back(a.tensors[k] != nullptr ? std::optional<at::Tensor>(*a.tensors[k]) : std::nullopt);
            }
            return l;
          } else {
            c10::List<at::Tensor> l;
            for (int64_t k = 0; k < a.len; ++k) {
              TORCH_CHECK(a.tensors[k] != nullptr, "argument '", formal.name(), "' element ", k,
                          " is None, but the schema's list holds tensors");
              l.push_back(*a.tensors[k]);
            }
            return l;
          }
        case c10::TypeKind::NumberType: {  // Scalar[]: torch.optim's foreach ops take one per tensor
          if (a.tag == 6) {
            c10::impl::GenericList l(c10::NumberType::get());
            for (int64_t k = 0; k < a.len; ++k) l.push_back(a.floats[k]);
            return l;
          }
          if (a.tag == 5) {
            c10::impl::GenericList l(c10::NumberType::get());
            for (int64_t k = 0; k < a.len; ++k) l.push_back(a.ints[k]);
            return l;
          }
          return bad();
        }
        default:
          return bad();
      }
    }
    default:
      return bad();
  }
}

void emit(const c10::IValue& v, int ret, int item, void* ctx, ckpt_value_cb cb) {
  if (v.isNone()) {
    cb(ctx, ret, item, 0, nullptr, 0, 0.0);
  } else if (v.isTensor()) {
    cb(ctx, ret, item, 1, new at::Tensor(v.toTensor()), 0, 0.0);
  } else if (v.isInt() || v.isSymInt()) {
    cb(ctx, ret, item, 2, nullptr, v.isInt() ? v.toInt() : v.toSymInt().expect_int(), 0.0);
  } else if (v.isDouble()) {
    cb(ctx, ret, item, 3, nullptr, 0, v.toDouble());
  } else if (v.isBool()) {
    cb(ctx, ret, item, 4, nullptr, v.toBool() ? 1 : 0, 0.0);
  } else {
    TORCH_CHECK(false, "return ", ret, " is a ", v.tagKind(), ", which ckptune does not pass between nodes");
  }
}

}  // namespace

// Whether the dispatcher knows `name.overload`; its schema as text in `out` when it does.
int ckpt_op_schema(const char* name, const char* overload, char** out, char** err) {
  return guarded(err, [&] {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
    std::ostringstream s;
    s << op.schema();
    *out = dup_str(s.str());
  });
}

// Calls `name.overload` with `args` matched to the schema by name (missing ones take the
// schema's default) and reports every returned value through `cb`.
int ckpt_op_call(const char* name, const char* overload, const CkptArg* args, int nargs, void* ctx,
                 ckpt_value_cb cb, char** err) {
  return guarded(err, [&] {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name, overload);
    const c10::FunctionSchema& schema = op.schema();
    const auto& formals = schema.arguments();
    std::vector<bool> used(nargs, false);
    std::vector<at::Tensor> made;  // the wrapped numbers the arguments became
    torch::jit::Stack stack;
    stack.reserve(formals.size());
    for (const auto& formal : formals) {
      int found = -1;
      for (int k = 0; k < nargs; ++k) {
        if (!used[k] && formal.name() == args[k].name) {
          found = k;
          break;
        }
      }
      if (found >= 0) {
        used[found] = true;
        stack.push_back(to_ivalue(formal, args[found], made));
      } else if (formal.default_value().has_value()) {
        stack.push_back(*formal.default_value());
      } else {
        TORCH_CHECK(false, "argument '", formal.name(), "' of ", schema.name(), ".", schema.overload_name(),
                    " is missing and has no default");
      }
    }
    for (int k = 0; k < nargs; ++k) {
      TORCH_CHECK(used[k], "the schema ", schema, " has no argument '", args[k].name, "'");
    }
    op.callBoxed(stack);
    numbers_seen(made);
    made.clear();
    for (size_t r = 0; r < stack.size(); ++r) {
      const c10::IValue& v = stack[r];
      if (v.isTensorList()) {
        auto l = v.toTensorList();
        cb(ctx, static_cast<int>(r), -1, 5, nullptr, static_cast<int64_t>(l.size()), 0.0);
        for (size_t k = 0; k < l.size(); ++k) cb(ctx, static_cast<int>(r), static_cast<int>(k), 1,
                                                 new at::Tensor(l.get(k)), 0, 0.0);
      } else if (v.isList()) {
        auto l = v.toList();
        cb(ctx, static_cast<int>(r), -1, 5, nullptr, static_cast<int64_t>(l.size()), 0.0);
        for (size_t k = 0; k < l.size(); ++k) emit(l.get(k), static_cast<int>(r), static_cast<int>(k), ctx, cb);
      } else {
        emit(v, static_cast<int>(r), -1, ctx, cb);
      }
    }
    // The stack's handles die here, before the caller sees the outputs: nothing of the call's
    // own survives it (the meter sees what eager PyTorch frees).
    stack.clear();
  });
}

// Opens this thread's number scope for a block's forward or recompute (see NumberScope): `grad`
// says whether the block runs with grad; without, `learned` says whether `saved` (n entries) is
// the block's grad run's answer per number.
int ckpt_numbers_begin(int grad, const uint8_t* saved, int64_t n, int learned, char** err) {
  return guarded(err, [&] {
    TORCH_CHECK(t_numbers == nullptr, "number scope: one is already open on this thread");
    auto s = std::make_unique<NumberScope>();
    s->grad = grad != 0;
    s->learned = learned != 0;
    if (s->learned) s->saved_before.assign(saved, saved + n);
    t_numbers = std::move(s);
  });
}

// Closes this thread's number scope (none open: nothing is reported) and reports what it saw
// through `cb`: in a run with grad, each number as whether autograd saved it (`kept` null); in
// one without, each number kept as a fresh handle the callee owns (`saved` -1).
void ckpt_numbers_end(void* ctx, ckpt_number_cb cb) {
  std::unique_ptr<NumberScope> s = std::move(t_numbers);
  if (s == nullptr || cb == nullptr) return;
  for (uint8_t v : s->saved) cb(ctx, v, nullptr);
  for (auto& t : s->kept) cb(ctx, -1, new at::Tensor(std::move(t)));
}

}  // extern "C"
