// The meter's counters, for the other parts of the shim (backward marks where a backward
// started; fake mode's meta allocator counts into the same counters).
#pragma once

#include <cstdint>

namespace c10 {
struct StorageImpl;
}

namespace ckpt {

// Bytes alive now, as the meter counts them.
int64_t meter_current();
// Records the current level as the start of a backward (what a hook there would see).
void meter_mark_backward_start();
// Counts an allocation of `n` bytes, or a free.
void meter_alloc(int64_t n);
void meter_free(int64_t n);
// As meter_alloc/meter_free, logged under `key`, so that a reader pairs each free with its own
// allocation when several are open at once.
void meter_alloc_keyed(int64_t n, const void* key);
void meter_free_keyed(int64_t n, const void* key);
// Counts the growth of a meta storage since it was allocated or last seen here: resizing a meta
// tensor only sets its size, where the CPU allocates the new bytes before freeing the old.
// Storages not from the counting meta allocator are left alone.
void meter_meta_resized(c10::StorageImpl* storage);
// The highest level since the last `meter_set_op_peak` (which sets it).
int64_t meter_op_peak();
void meter_set_op_peak(int64_t v);
// The same for one operator call at a time (the step's own calls, `learned_scratch.cpp`).
int64_t meter_call_peak();
void meter_set_call_peak(int64_t v);

}  // namespace ckpt
