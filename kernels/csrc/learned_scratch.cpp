// What the CPU's kernels allocate beyond fake mode's meta kernels (oneDNN's scratch), learned
// from a real step and replayed in fake steps. The table maps an operator call the step itself
// makes (one inside no other operator: `optrace::outermost_ops` in Rust) with its inputs'
// shapes (`shape_code.h`) to the bytes by which the real call's peak exceeded the fake one's.
//
// The replay observes the same events the operator trace records (RecordFunction at the
// dispatcher's entry, so a decomposed operator such as `aten::conv2d` is seen as the step calls
// it, not as the parts that reach fake mode's fallback). At the end of each matching call on a
// thread in fake mode it allocates and frees, through the meter, what lifts the call's peak by
// those bytes: the peak rises as the real one did, nothing is kept. The excess is relative to
// the call's peak, not to what it keeps, so a call that keeps more in one place (a with-grad
// forward saving its inputs) than where it was learned gets the same scratch on top.

#include <ATen/record_function.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common.h"
#include "meter.h"
#include "shape_code.h"

extern "C" int ckpt_fake_active();

namespace {

using ScratchTable = std::unordered_map<std::string, int64_t>;

std::shared_ptr<const ScratchTable> g_table;
at::CallbackHandle g_handle = 0;
std::mutex g_mutex;

std::shared_ptr<const ScratchTable> table() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_table;
}

// Per open event on this thread (fake mode only): whether an operator is open at or above it.
thread_local std::vector<bool> t_under_operator;

// The bytes by which an event's peak is to rise as it ends (0: none).
struct Open final : at::ObserverContext {
  explicit Open(int64_t b) : bytes(b) {}
  int64_t bytes;
};

// As `is_operator` in optrace.rs: autograd's evaluations are not operators.
bool is_operator(const std::string& name) {
  return name.find("::") != std::string::npos && name.rfind("autograd::", 0) != 0;
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction& fn) {
  if (ckpt_fake_active() == 0) return nullptr;
  const std::string name = ckpt::op_name(fn);
  const bool under = !t_under_operator.empty() && t_under_operator.back();
  const bool op = is_operator(name);
  t_under_operator.push_back(under || op);
  int64_t bytes = 0;
  if (op && !under) {
    auto t = table();
    std::vector<int64_t> codes;
    ckpt::shape_codes(fn.inputs(), codes);
    auto it = t ? t->find(ckpt::op_key(name, codes)) : ScratchTable::const_iterator();
    if (t && it != t->end()) bytes = it->second;
    // Only the step's own calls use the register, one at a time.
    if (bytes > 0) ckpt::meter_set_call_peak(ckpt::meter_current());
  }
  return std::make_unique<Open>(bytes);
}

void on_exit(const at::RecordFunction& /*fn*/, at::ObserverContext* ctx) {
  auto* open = static_cast<Open*>(ctx);
  if (open == nullptr) return;
  if (!t_under_operator.empty()) t_under_operator.pop_back();
  if (open->bytes > 0) {
    const int64_t lift = ckpt::meter_call_peak() + open->bytes - ckpt::meter_current();
    ckpt::meter_alloc(lift);
    ckpt::meter_free(lift);
  }
}

}  // namespace

using ckpt::guarded;

extern "C" {

// Replaces the learned scratch (`n` keys as `ckpt::op_key` writes them, with their bytes); `n` 0
// forgets it and stops observing.
int ckpt_fake_set_scratch(const char* const* keys, const int64_t* bytes, int64_t n, char** err) {
  return guarded(err, [&] {
    auto t = std::make_shared<ScratchTable>();
    for (int64_t i = 0; i < n; ++i) (*t)[keys[i]] = bytes[i];
    std::lock_guard<std::mutex> lock(g_mutex);
    g_table = t->empty() ? nullptr : std::move(t);
    if (g_table && g_handle == 0) {
      at::enableRecordFunction(true);
      g_handle = at::addGlobalCallback(
          at::RecordFunctionCallback(&on_enter, &on_exit).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
    } else if (!g_table && g_handle != 0) {
      at::removeCallback(g_handle);
      g_handle = 0;
    }
  });
}

}  // extern "C"
