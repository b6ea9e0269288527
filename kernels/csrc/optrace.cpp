// An operator trace: every ATen operator a thread runs, with its nesting depth, its inputs'
// sizes and dtypes, the meter's level when it starts and ends, the highest level while it
// runs, and its wall time. In a real and a fake run of the same step it lines up op by op, which
// shows where a fake run's bytes differ; its shapes give each operator's FLOPs and bytes for the
// cost model.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "meter.h"
#include "shape_code.h"

namespace {

struct Event {
  std::string name;
  int32_t depth;
  int64_t enter, exit, peak;
  int64_t nanos;
  // Per input: a tensor's dtype (c10::ScalarType, -1 for a non-tensor), then its sizes.
  std::vector<int64_t> shapes;
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

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  Event e;
  e.name = fn.name();
  std::string overload = fn.overload_name();
  if (!overload.empty()) e.name += "." + overload;
  e.depth = t_depth++;
  e.enter = ckpt::meter_current();
  e.exit = e.peak = e.enter;
  e.nanos = 0;
  ckpt::shape_codes(fn.inputs(), e.shapes);
  auto open = std::make_unique<Open>(t_events.size(), ckpt::meter_op_peak());
  ckpt::meter_set_op_peak(e.enter);
  t_events.push_back(std::move(e));
  return open;
}

void on_exit(const at::RecordFunction& /*fn*/, at::ObserverContext* ctx) {
  auto* o = static_cast<Open*>(ctx);
  if (o == nullptr || o->event >= t_events.size()) return;
  --t_depth;
  Event& e = t_events[o->event];
  e.exit = ckpt::meter_current();
  e.peak = ckpt::meter_op_peak();
  e.nanos = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - o->t0).count();
  // The enclosing operator's peak includes this one's.
  ckpt::meter_set_op_peak(std::max(o->saved_op_peak, e.peak));
}

}  // namespace

using ckpt::guarded;

extern "C" {

typedef void (*ckpt_op_event_cb)(void* ctx, const char* name, int32_t depth, int64_t enter, int64_t exit,
                                 int64_t peak, int64_t nanos, const int64_t* shapes, int64_t nshapes);

// Starts tracing this thread's operators (restarting drops what was traced).
int ckpt_optrace_start(char** err) {
  return guarded(err, [] {
    if (t_handle != 0) at::removeCallback(t_handle);
    t_events.clear();
    t_depth = 0;
    at::enableRecordFunction(true);
    t_handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(&on_enter, &on_exit).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
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
      cb(ctx, e.name.c_str(), e.depth, e.enter, e.exit, e.peak, e.nanos, e.shapes.data(),
         static_cast<int64_t>(e.shapes.size()));
  });
}

// Whether operator `name` (`aten::index_select`, with `.overload` if it has one) has a kernel
// for the Meta key (its own, or a composite one): 1 yes, 0 no, -1 no such operator.
int ckpt_op_has_meta_kernel(const char* name) {
  std::string full(name);
  auto dot = full.find('.', full.find("::") + 2);
  std::string base = dot == std::string::npos ? full : full.substr(0, dot);
  std::string overload = dot == std::string::npos ? "" : full.substr(dot + 1);
  auto op = c10::Dispatcher::singleton().findOp(c10::OperatorName(base, overload));
  if (!op.has_value()) return -1;
  // Not the computed table's entry: libtorch registers a fallback for Meta that only raises.
  for (auto key : {c10::DispatchKey::Meta, c10::DispatchKey::CompositeExplicitAutograd,
                   c10::DispatchKey::CompositeExplicitAutogradNonFunctional, c10::DispatchKey::CompositeImplicitAutograd})
    if (op->hasKernelForDispatchKey(key)) return 1;
  return 0;
}

}  // extern "C"
