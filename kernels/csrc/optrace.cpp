// An operator trace: every ATen operator a thread runs, with its nesting depth, the events that
// ran inside it, its inputs' sizes, strides and dtypes (and numbers), its outputs' likewise, the
// meter's level when it starts and ends, the highest level while it runs, and its wall time; and
// the user scopes the runtime opens around each block's forward, recompute and backward
// (`ckpt_scope_enter`), which say what each operator was part of. In a real and a fake run of
// the same step it lines up op by op, which shows where a fake run's bytes differ; its shapes
// give each operator's FLOPs and bytes for the cost model.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "meter.h"
#include "shape_code.h"

namespace {

struct Event {
  std::string name;
  // A user scope (the runtime's block boundaries), not an operator.
  bool scope;
  int32_t depth;
  // One past the last event that started before this one ended: events (this, end) ran inside.
  int64_t end;
  int64_t enter, exit, peak;
  int64_t nanos;
  // The inputs' and the outputs' shapes as `ckpt::shape_codes` writes them (the inputs' with
  // the name key fake mode's learned scratch), and the inputs' numbers as `numbers` writes them.
  std::vector<int64_t> inputs, outputs, numbers;
};

// What an operator's end needs of its start. RecordFunction hands it back at the end, so an
// operator whose end is reported late or out of order still closes its own event.
struct Open final : at::ObserverContext {
  size_t event;
  int64_t saved_op_peak;
  std::chrono::steady_clock::time_point t0;
  Open(size_t e, int64_t p) : event(e), saved_op_peak(p), t0(std::chrono::steady_clock::now()) {}
};

thread_local std::vector<Event> t_events;
thread_local int32_t t_depth = 0;
thread_local at::CallbackHandle t_handle = 0;
// The user scopes open on this thread, innermost last.
thread_local std::vector<std::unique_ptr<at::RecordFunction>> t_scopes;

// Each value as two numbers: `[1, value]` for an integer or a bool (the cost model reads
// `is_causal`, a convolution's `groups`), `[2, bits]` for a double, `[0, 0]` for anything else.
void numbers(c10::ArrayRef<c10::IValue> values, std::vector<int64_t>& out) {
  for (const c10::IValue& v : values) {
    if (v.isInt() || v.isBool()) {
      out.push_back(1);
      out.push_back(v.isInt() ? v.toInt() : static_cast<int64_t>(v.toBool()));
    } else if (v.isDouble()) {
      double d = v.toDouble();
      int64_t bits = 0;
      std::memcpy(&bits, &d, sizeof bits);
      out.push_back(2);
      out.push_back(bits);
    } else {
      out.push_back(0);
      out.push_back(0);
    }
  }
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  Event e;
  e.name = ckpt::op_name(fn);
  // A scope keeps the depth of what runs inside it: the operators a step calls stay at depth 0,
  // so traces with and without scopes line up.
  e.scope = fn.scope() == at::RecordScope::USER_SCOPE;
  e.depth = e.scope ? t_depth : t_depth++;
  e.end = 0;
  e.enter = ckpt::meter_current();
  e.exit = e.peak = e.enter;
  e.nanos = 0;
  ckpt::shape_codes(fn.inputs(), e.inputs);
  numbers(fn.inputs(), e.numbers);
  auto open = std::make_unique<Open>(t_events.size(), ckpt::meter_op_peak());
  ckpt::meter_set_op_peak(e.enter);
  t_events.push_back(std::move(e));
  return open;
}

void on_exit(const at::RecordFunction& fn, at::ObserverContext* ctx) {
  auto* o = static_cast<Open*>(ctx);
  if (o == nullptr || o->event >= t_events.size()) return;
  Event& e = t_events[o->event];
  if (!e.scope) --t_depth;
  e.end = static_cast<int64_t>(t_events.size());
  ckpt::shape_codes(fn.outputs(), e.outputs);
  e.exit = ckpt::meter_current();
  e.peak = ckpt::meter_op_peak();
  e.nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - o->t0).count();
  // The enclosing operator's peak includes this one's.
  ckpt::meter_set_op_peak(std::max(o->saved_op_peak, e.peak));
}

}  // namespace

using ckpt::guarded;

extern "C" {

typedef void (*ckpt_op_event_cb)(void* ctx, const char* name, int32_t scope, int32_t depth, int64_t end,
                                 int64_t enter, int64_t exit, int64_t peak, int64_t nanos, const int64_t* inputs,
                                 int64_t ninputs, const int64_t* outputs, int64_t noutputs, const int64_t* numbers,
                                 int64_t nnumbers);

// Starts tracing this thread's operators (restarting drops what was traced).
int ckpt_optrace_start(char** err) {
  return guarded(err, [] {
    if (t_handle != 0) at::removeCallback(t_handle);
    t_events.clear();
    t_depth = 0;
    at::enableRecordFunction(true);
    t_handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_enter, &on_exit)
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
  });
}

// Stops tracing and hands every event to `cb`, in the order the operators started.
int ckpt_optrace_stop(void* ctx, ckpt_op_event_cb cb, char** err) {
  return guarded(err, [&] {
    if (t_handle != 0) at::removeCallback(t_handle);
    t_handle = 0;
    std::vector<Event> events = std::move(t_events);
    t_events.clear();
    t_depth = 0;
    for (const Event& e : events)
      cb(ctx, e.name.c_str(), e.scope ? 1 : 0, e.depth, e.end, e.enter, e.exit, e.peak, e.nanos, e.inputs.data(),
         static_cast<int64_t>(e.inputs.size()), e.outputs.data(), static_cast<int64_t>(e.outputs.size()),
         e.numbers.data(), static_cast<int64_t>(e.numbers.size()));
  });
}

// Opens a user scope named `name` on this thread (`at::RecordFunction` with USER_SCOPE, as
// `torch.profiler.record_function` opens one): the trace, and any other RecordFunction observer
// such as the PyTorch profiler, sees it around what runs until `ckpt_scope_exit`.
int ckpt_scope_enter(const char* name, char** err) {
  return guarded(err, [&] {
    auto rf = std::make_unique<at::RecordFunction>(at::RecordScope::USER_SCOPE);
    if (rf->isActive()) rf->before(std::string(name));
    t_scopes.push_back(std::move(rf));
  });
}

// Closes this thread's innermost user scope (none open: nothing to do).
void ckpt_scope_exit() {
  if (t_scopes.empty()) return;
  t_scopes.back()->end();
  t_scopes.pop_back();
}

}  // extern "C"

namespace {

// The dispatcher's operator named `name` (`aten::add.Tensor`), if libtorch has it.
std::optional<c10::OperatorHandle> find_op(const std::string& full) {
  auto dot = full.find('.', full.find("::") + 2);
  std::string base = dot == std::string::npos ? full : full.substr(0, dot);
  std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
  return c10::Dispatcher::singleton().findOp(c10::OperatorName(base, overload));
}

}  // namespace

extern "C" {

// What the cost model needs to know of operator `name` (`aten::addmm`, with `.overload` if it
// has one), as bits: 1 it exists; 2 a decomposition (only a CompositeImplicitAutograd kernel:
// the operators it calls do its work); 4 it returns a view of an input; 8 it writes into an
// input (in place, or `out=`). 0: no such operator.
int ckpt_op_traits(const char* name) {
  auto op = find_op(name);
  if (!op.has_value()) return 0;
  int bits = 1;
  bool kernel = false;
  for (auto key : {c10::DispatchKey::CPU, c10::DispatchKey::CompositeExplicitAutograd,
                   c10::DispatchKey::CompositeExplicitAutogradNonFunctional})
    kernel = kernel || op->hasKernelForDispatchKey(key);
  if (!kernel && op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd)) bits |= 2;
  if (op->hasSchema() && !op->schema().returns().empty()) {
    const c10::AliasInfo* alias = op->schema().returns()[0].alias_info();
    if (alias != nullptr) bits |= alias->isWrite() ? 8 : 4;
  }
  return bits;
}

// Whether operator `name` (`aten::index_select`, with `.overload` if it has one) has a kernel
// for the Meta key (its own, or a composite one): 1 yes, 0 no, -1 no such operator.
int ckpt_op_has_meta_kernel(const char* name) {
  auto op = find_op(name);
  if (!op.has_value()) return -1;
  // Not the computed table's entry: libtorch registers a fallback for Meta that only raises.
  for (auto key : {c10::DispatchKey::Meta, c10::DispatchKey::CompositeExplicitAutograd,
                   c10::DispatchKey::CompositeExplicitAutogradNonFunctional, c10::DispatchKey::CompositeImplicitAutograd})
    if (op->hasKernelForDispatchKey(key)) return 1;
  return 0;
}

}  // extern "C"
