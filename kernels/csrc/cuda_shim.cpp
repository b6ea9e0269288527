// CUDA half of the shim (compiled only with the `cuda` feature): the CUDA caching allocator's
// statistics, which are what a GPU budget is about (allocated and reserved, current and peak),
// and the CUDA generator's state for bitwise dropout replay.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include "common.h"

using ckpt::guarded;

extern "C" {

struct CkptCudaMem {
  int64_t allocated_current;
  int64_t allocated_peak;
  int64_t reserved_current;
  int64_t reserved_peak;
};

int ckpt_cuda_device_count() { return static_cast<int>(c10::cuda::device_count()); }

int ckpt_cuda_memory_stats(int device, CkptCudaMem* out, char** err) {
  return guarded(err, [&] {
    using c10::CachingAllocator::StatType;
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    auto agg = static_cast<size_t>(StatType::AGGREGATE);
    out->allocated_current = stats.allocated_bytes[agg].current;
    out->allocated_peak = stats.allocated_bytes[agg].peak;
    out->reserved_current = stats.reserved_bytes[agg].current;
    out->reserved_peak = stats.reserved_bytes[agg].peak;
  });
}

int ckpt_cuda_reset_peak(int device, char** err) {
  return guarded(err, [&] {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
  });
}

}  // extern "C"
