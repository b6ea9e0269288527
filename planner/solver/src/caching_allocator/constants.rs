//! The caching allocator's size constants (`c10/core/AllocatorConfig.h`, `c10/cuda/
//! CUDACachingAllocator.cpp`), below the config and the size rules that both use them.

/// `kMinBlockSize` (c10/core/AllocatorConfig.h): every size is rounded to at least 512 bytes.
pub const K_MIN_BLOCK_SIZE: u64 = 512;
/// `kSmallSize`: the largest request the small pool serves, 1 MiB.
pub const K_SMALL_SIZE: u64 = 1 << 20;
/// `kSmallBuffer`: small requests are packed into 2 MiB segments (and expandable segments of
/// the small pool map 2 MiB pages).
pub const K_SMALL_BUFFER: u64 = 2 << 20;
/// `kMinLargeAlloc`: requests from 1 MiB up to below 10 MiB share `large_segment_size` segments.
pub const K_MIN_LARGE_ALLOC: u64 = 10 << 20;
/// `kRoundLarge`: segments of larger requests are rounded up to 2 MiB.
pub const K_ROUND_LARGE: u64 = 2 << 20;
/// `kLargeBuffer`: the default `large_segment_size` (`large_segment_size_mb`), 20 MiB, and
/// the default `max_non_split_rounding_size`.
pub const K_LARGE_BUFFER: u64 = 20 << 20;
