// The meter: exact tensor memory from a counting allocator in libtorch's CPU allocator slot
// (and, for fake mode, in the meta slot: `fake.cpp`). Reading the counters allocates nothing.
// The Python harness compiles this file alone (python/ckptune_harness/meter.py), so it depends
// on nothing else of the shim but the headers.

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <vector>

#include "common.h"
#include "meter.h"

namespace {

// Counting allocator.
//
// Each allocation gets a 64-byte header in front of the data holding its size and where malloc
// put the block, so that the deleter knows how many bytes go away without a global map (no
// lock, no extra allocation). The context pointer equals the data pointer, which
// `Allocator::raw_allocate` requires: oneDNN allocates through raw_allocate/raw_deleter, and
// those bytes are counted like any tensor's. The data sits at the 64-byte alignment libtorch's
// default CPU allocator gives.
//
// The block comes from malloc, aligned here, not from the default allocator's posix_memalign:
// glibc serves an aligned request by taking more and giving the ends back as separate chunks,
// which small allocations then take, so a freed block is smaller than the next request of its
// size. While freed memory is held (kernels/src/host_memory.rs) such a block is never reused
// and the heap grows by every step's large tensors; malloc's own blocks are reused exactly.
constexpr size_t kHeader = 64;
constexpr size_t kAlign = 64;
// What malloc guarantees; the rest of the alignment is found inside the block.
constexpr size_t kMallocAlign = alignof(std::max_align_t);

struct Header {
  int64_t bytes;
  void* block;
};
static_assert(sizeof(Header) <= kHeader, "the header fits in front of the data");

std::atomic<int64_t> g_current{0};
std::atomic<int64_t> g_peak{0};
std::atomic<int64_t> g_window_peak{0};
// A third peak, of the operator running now, for `optrace.cpp`.
std::atomic<int64_t> g_op_peak{0};
// A fourth, of the step's operator call running now, for `learned_scratch.cpp`.
std::atomic<int64_t> g_call_peak{0};
std::atomic<int64_t> g_allocs{0};
// The level when the latest ckpt_backward* call had let go of its output tensor, before the
// engine ran: what a hook at the start of that backward sees (FSDP's pre-backward).
std::atomic<int64_t> g_backward_start{0};

void raise_max(std::atomic<int64_t>& target, int64_t value) {
  int64_t seen = target.load(std::memory_order_relaxed);
  while (value > seen && !target.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

// The allocation log (`ckpt_meter_log_*`): while it records, every counted allocation and free
// is appended in the order the counters saw it, keyed by what identifies the allocation while it
// lives (a CPU data pointer, a meta context). When it does not record, counting costs one
// relaxed load more; when it does, counting and appending happen under one lock, so the log's
// order is the counters' order even when oneDNN's threads allocate.
struct LogEvent {
  int64_t bytes;  // >= 0: an allocation of `bytes`, < 0: a free of `~bytes` (zero-byte ones too)
  uint64_t key;
};
std::atomic<bool> g_logging{false};
std::mutex g_log_lock;
std::vector<LogEvent> g_log;

void count_alloc_unlogged(int64_t n) {
  int64_t now = g_current.fetch_add(n, std::memory_order_relaxed) + n;
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  raise_max(g_peak, now);
  raise_max(g_window_peak, now);
  raise_max(g_op_peak, now);
  raise_max(g_call_peak, now);
}

void count_alloc(int64_t n, const void* key) {
  if (!g_logging.load(std::memory_order_relaxed)) return count_alloc_unlogged(n);
  std::lock_guard<std::mutex> lock(g_log_lock);
  count_alloc_unlogged(n);
  g_log.push_back({n, reinterpret_cast<uint64_t>(key)});
}

void count_free(int64_t n, const void* key) {
  if (!g_logging.load(std::memory_order_relaxed)) {
    g_current.fetch_sub(n, std::memory_order_relaxed);
    return;
  }
  std::lock_guard<std::mutex> lock(g_log_lock);
  g_current.fetch_sub(n, std::memory_order_relaxed);
  g_log.push_back({~n, reinterpret_cast<uint64_t>(key)});
}

Header* header_of(void* data) { return reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader); }

void counting_delete(void* data) {
  if (data == nullptr) return;
  Header* h = header_of(data);
  count_free(h->bytes, data);
  std::free(h->block);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    constexpr size_t extra = kHeader + kAlign - kMallocAlign;
    void* block = n <= SIZE_MAX - extra ? std::malloc(n + extra) : nullptr;
    TORCH_CHECK_WITH(OutOfMemoryError, block != nullptr,
                     "ckptune's CPU allocator: can't allocate memory: you tried to allocate ", n, " bytes");
    auto at = reinterpret_cast<uintptr_t>(block) + kHeader;
    void* data = reinterpret_cast<void*>((at + kAlign - 1) & ~(kAlign - 1));
    *header_of(data) = Header{static_cast<int64_t>(n), block};
    count_alloc(static_cast<int64_t>(n), data);
    return {data, data, &counting_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counting_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator g_counting;
std::once_flag g_install_once;


// The meta allocator of fake mode: a storage's bytes are counted, nothing is allocated. The
// context holds the size for the deleter; the data pointer stays null, as meta tensors have.
void meta_delete(void* ctx) {
  auto* n = static_cast<int64_t*>(ctx);
  count_free(*n, ctx);
  delete n;
}

struct CountingMetaAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    auto* ctx = new int64_t(static_cast<int64_t>(n));
    count_alloc(static_cast<int64_t>(n), ctx);
    return {nullptr, ctx, &meta_delete, c10::Device(c10::DeviceType::Meta)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* /*dest*/, const void* /*src*/, std::size_t /*count*/) const override {}
};

CountingMetaAllocator g_counting_meta;
std::once_flag g_install_meta_once;

}  // namespace

namespace ckpt {

int64_t meter_current() { return g_current.load(std::memory_order_relaxed); }
void meter_mark_backward_start() { g_backward_start.store(meter_current(), std::memory_order_relaxed); }
// Keyed 0: a learned scratch is freed right after it is counted, before any other key-0 event.
void meter_alloc(int64_t n) { count_alloc(n, nullptr); }
void meter_free(int64_t n) { count_free(n, nullptr); }
void meter_alloc_keyed(int64_t n, const void* key) { count_alloc(n, key); }
void meter_free_keyed(int64_t n, const void* key) { count_free(n, key); }
void meter_meta_resized(c10::StorageImpl* storage) {
  const c10::DataPtr& data = storage->data_ptr();
  if (data.get_deleter() != &meta_delete) return;
  auto* counted = static_cast<int64_t*>(data.get_context());
  const auto now = static_cast<int64_t>(storage->nbytes());
  if (now <= *counted) return;
  // Logged as the CPU does it: the new bytes, then the old freed, both under the storage's key
  // (a reader pairs a key's frees with its allocations oldest first).
  count_alloc(now, counted);
  count_free(*counted, counted);
  *counted = now;
}
int64_t meter_op_peak() { return g_op_peak.load(std::memory_order_relaxed); }
void meter_set_op_peak(int64_t v) { g_op_peak.store(v, std::memory_order_relaxed); }

int64_t meter_call_peak() { return g_call_peak.load(std::memory_order_relaxed); }

void meter_set_call_peak(int64_t v) { g_call_peak.store(v, std::memory_order_relaxed); }

}  // namespace ckpt

using ckpt::guarded;

extern "C" {

int ckpt_meter_install(char** err) {
  return guarded(err, [] {
    std::call_once(g_install_once, [] {
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
int64_t ckpt_meter_backward_start() { return g_backward_start.load(std::memory_order_relaxed); }
void ckpt_meter_reset_peak() { g_peak.store(g_current.load(std::memory_order_relaxed)); }
int64_t ckpt_meter_window_peak() { return g_window_peak.load(std::memory_order_relaxed); }
void ckpt_meter_reset_window() { g_window_peak.store(g_current.load(std::memory_order_relaxed)); }

// The allocation log: `start` clears it and records from now on, `stop` stops recording,
// `len` is the number of events so far, and `read` copies up to `cap` events from `from` into
// `bytes`/`keys` (an allocation as its bytes, a free as `~bytes`) and returns how many it copied.
void ckpt_meter_log_start() {
  std::lock_guard<std::mutex> lock(g_log_lock);
  g_log.clear();
  g_logging.store(true, std::memory_order_relaxed);
}
void ckpt_meter_log_stop() {
  std::lock_guard<std::mutex> lock(g_log_lock);
  g_logging.store(false, std::memory_order_relaxed);
}
int64_t ckpt_meter_log_len() {
  std::lock_guard<std::mutex> lock(g_log_lock);
  return static_cast<int64_t>(g_log.size());
}
int64_t ckpt_meter_log_read(int64_t from, int64_t cap, int64_t* bytes, uint64_t* keys) {
  std::lock_guard<std::mutex> lock(g_log_lock);
  int64_t n = 0;
  for (auto i = static_cast<size_t>(from); i < g_log.size() && n < cap; ++i, ++n) {
    bytes[n] = g_log[i].bytes;
    keys[n] = g_log[i].key;
  }
  return n;
}


// Installs the counting meta allocator: every storage a meta (or fake) tensor gets is counted.
int ckpt_meter_install_meta(char** err) {
  return guarded(err, [] {
    std::call_once(g_install_meta_once, [] { c10::SetAllocator(c10::DeviceType::Meta, &g_counting_meta, /*priority=*/10); });
    TORCH_CHECK(c10::GetAllocator(c10::DeviceType::Meta) == &g_counting_meta,
                "another meta allocator with a higher priority replaced the ckptune meter");
  });
}

}  // extern "C"
